"""``kvxfer bench hold-check``: what the hold check costs a pull request.

A request read with a hold ticket (:mod:`kvxfer.engine.holds`) is DONE only after one
more small READ (the producer rank's 32-byte hold slot) has come back, and its ReadDone
goes out after that; a request without one is DONE when its data READ completes. This
benchmark measures both on the same engines, interleaved: a real
:class:`~kvxfer.engine.producer.Producer` in a spawned process (the first-contact
bench's 128-view layout, 16-byte blocks), a :class:`~kvxfer.engine.consumer.Consumer`
here; each request's latency runs from ``read()`` to DONE, polled without pause (the
way a busy decode step polls); every request's bytes are verified. Reported per
request size: median and p90 without and with the check, the extra, and the ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxfer.bench.first_contact import _recv_from, _verify, bench_spec, region_pattern
from kvxfer.engine.config import EngineConfig, RequestState, allocate_cache

__all__ = ["COLUMNS", "run", "run_bench", "table_rows"]

DEFAULT_SIZES = (1, 16, 128)  # blocks per request (x 128 views = descriptors)
NUM_VIEWS = 128
NUM_BLOCKS = 4096
MODEL = "hold-check-bench"


def _producer_main(conn: Connection) -> None:
    from kvxfer.engine.producer import Producer

    spec = bench_spec(NUM_BLOCKS, NUM_VIEWS)
    bufs = allocate_cache(spec)
    for r, b in enumerate(bufs):
        b[:] = region_pattern(r, np.arange(b.size, dtype=np.int64))
    with Producer(EngineConfig("hc-p", model_name=MODEL, lease_s=600), [(spec, bufs)]) as prod:
        conn.send(prod.address)
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            conn.send([prod.hold(rid, n).ticket for rid, n in cmd[1]])  # ("hold", items)


def _one(cons: Any, address: str, rid: str, lids: np.ndarray, rids: np.ndarray,
         ticket: int | None) -> tuple[float, bool]:  # fmt: skip
    t0 = time.perf_counter()
    t = cons.read(rid, address, local_block_ids=lids, remote_block_ids=rids, hold_ticket=ticket)
    while not (state := t.poll()).is_terminal:
        pass
    return time.perf_counter() - t0, state is RequestState.DONE


def run_bench(sizes: Sequence[int], repeat: int, *, seed: int = 0) -> dict[str, Any]:
    """Every size, ``repeat`` requests each way (alternating); the result document."""
    from kvxfer.engine.consumer import Consumer

    t_start = time.perf_counter()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer_main, args=(child,), daemon=True)
    proc.start()
    spec = bench_spec(NUM_BLOCKS, NUM_VIEWS)
    bufs = allocate_cache(spec)
    rng = np.random.default_rng(seed)
    results = []
    try:
        address = _recv_from(proc, conn, 120.0)
        cfg = EngineConfig("hc-d", model_name=MODEL, deadline_s=60.0, handshake_timeout_s=60.0)
        with Consumer(cfg, [(spec, bufs)]) as cons:
            cons.connect(address)
            warm = rng.choice(NUM_BLOCKS, 4, replace=False)
            conn.send(("hold", [("warm", 4)]))
            (wt,) = _recv_from(proc, conn, 60.0)
            _one(cons, address, "warm", warm, warm, wt)  # the path's first use, untimed
            for n in sizes:
                ids = [f"s{n}-{i}" for i in range(2 * repeat)]
                conn.send(("hold", [(rid, n) for rid in ids]))
                tickets = _recv_from(proc, conn, 60.0)
                times: dict[str, list[float]] = {"without": [], "with": []}
                ok = True
                for i, (rid, ticket) in enumerate(zip(ids, tickets, strict=True)):
                    lids, rids = (rng.choice(NUM_BLOCKS, n, replace=False) for _ in range(2))
                    way = "with" if i % 2 else "without"
                    s, done = _one(cons, address, rid, lids, rids, ticket if i % 2 else None)
                    ok = ok and done and _verify(spec, bufs, lids, rids)
                    times[way].append(s)
                results.append(_summary(n, times, ok))
        conn.send(("stop",))
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return {
        "benchmark": "hold_check", "format": 1,
        "config": {"sizes": list(sizes), "repeat": repeat, "seed": seed,
                   "num_views": NUM_VIEWS, "num_blocks": NUM_BLOCKS,
                   "layout": "split_kv, 16 B blocks; real NIXL, producer in a spawned process; "
                             "read() to DONE, polled without pause; alternating"},
        "results": results, "wall_seconds": time.perf_counter() - t_start,
    }  # fmt: skip


def _summary(blocks: int, times: dict[str, list[float]], verified: bool) -> dict[str, Any]:
    med = {k: float(np.median(v)) for k, v in times.items()}
    p90 = {k: float(np.percentile(v, 90)) for k, v in times.items()}
    return {
        "blocks": blocks, "descriptors": blocks * NUM_VIEWS, "verified": verified,
        "median_s": med, "p90_s": p90, "extra_median_s": med["with"] - med["without"],
        "ratio_median": med["with"] / med["without"], "samples": times,
    }  # fmt: skip


COLUMNS = ["blocks", "descriptors", "without (median)", "with (median)", "extra", "ratio",
           "without (p90)", "with (p90)", "verified"]  # fmt: skip


def table_rows(doc: dict[str, Any]) -> list[list[object]]:
    from kvxfer.bench.report import fmt_ratio
    from kvxfer.bench.report import fmt_seconds as f

    return [
        [r["blocks"], f"{r['descriptors']:,}", f(r["median_s"]["without"]),
         f(r["median_s"]["with"]), f(r["extra_median_s"]), fmt_ratio(r["ratio_median"]),
         f(r["p90_s"]["without"]), f(r["p90_s"]["with"]), r["verified"]]
        for r in doc["results"]
    ]  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvxfer bench hold-check``; returns the exit code."""
    from kvxfer.bench.report import default_console, make_table, save_loglog_png, write_json

    sizes = tuple(args.blocks) if args.blocks else ((1, 16) if args.quick else DEFAULT_SIZES)
    repeat = args.repeat if args.repeat is not None else (20 if args.quick else 200)
    if repeat < 1 or any(not 1 <= n <= NUM_BLOCKS // 2 for n in sizes):
        print(f"kvxfer bench hold-check: error: --blocks must be in [1, {NUM_BLOCKS // 2}] "
              "and --repeat >= 1", file=sys.stderr)  # fmt: skip
        return 2
    doc = run_bench(sizes, repeat, seed=args.seed)
    con = default_console()
    title = f"pull request latency without / with the hold check ({repeat} each, alternating)"
    con.print(make_table(title, COLUMNS, table_rows(doc)))
    con.print(f"all bytes verified: {all(r['verified'] for r in doc['results'])}; "
              f"wall {doc['wall_seconds']:.1f} s")  # fmt: skip
    if args.json:
        print(f"wrote {write_json(args.json, doc)}", file=sys.stderr)
    if args.png:
        xs = [r["descriptors"] for r in doc["results"]]
        series = {f"{k} check (median)": (xs, [r["median_s"][k] for r in doc["results"]])
                  for k in ("without", "with")}  # fmt: skip
        path = save_loglog_png(args.png, series, title="pull request, read() to DONE",
                               xlabel="descriptors in the request", ylabel="seconds")  # fmt: skip
        print(f"wrote {path}", file=sys.stderr)
    return 0
