"""``kvxfer bench first-contact``: from a producer's address to the first verified bytes.

A real :class:`~kvxfer.engine.producer.Producer` runs in a spawned process per cache size; the
benchmark process hosts :class:`~kvxfer.engine.consumer.Consumer` engines, created before the
clock starts (as a decode engine exists before it meets a producer). The clock runs from
``Consumer.read(address=...)`` (the consumer learns the address) to the first request's
bytes compared with the producer's pattern. Phases: side-channel ``fetch``,
``add_agent``, ``build`` (pairing, strided rows), ``prepare`` (NIXL lists, both sides),
``xfer`` (first post to completion), ``verify``; ``other`` is the rest (thread hand-off,
polling). A second (warm) request of the same size follows for comparison.

Layout: 128 views (64 layers split K/V, TP 1 -> 1), blocks of 1 token x 1 head x 8 x 2 B
= 16 B, so that 51,000 blocks per region fit in RAM (~100 MB a side); the point is the
descriptor count (6.5 M at 51k blocks). Modes: ``strided`` prepares one ``(N, 5)`` row per
view (``max_run_blocks=1``); ``runs`` adds the planner's run rows (``max_run_blocks=256``, off by default) of up to
256 blocks); ``dense`` is the fallback (``EngineConfig(strided=False)``), ``(M, 3)`` rows.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.engine.config import U8, EngineConfig, RequestState, allocate_cache
from kvxfer.layout.spec import AttnKind, LayoutSpec

__all__ = ["DEFAULT_BLOCKS", "MODES", "bench_spec", "region_pattern", "run", "run_bench"]

DEFAULT_BLOCKS = (1000, 5000, 10000, 25000, 51000)
DEFAULT_VIEWS = 128
QUICK_BLOCKS = (1000, 5000)
QUICK_VIEWS = 16
MODES = ("strided", "runs", "dense")  # runs: strided plus the planner's run rows
PHASES = ("fetch", "add_agent", "build", "prepare", "xfer", "verify", "other")
REQUEST_BLOCKS = 64  # blocks per request: 64 x 128 views = 8,192 descriptors
TARGET_SPEEDUP = 1000.0  # dense / strided build+prepare at >= 6 M descriptors
TARGET_FLAT = 2.0  # strided build+prepare, largest / smallest size
TARGET_MIN_DESCRIPTORS = 6_000_000
MODEL = "first-contact-bench"
# strided without run rows, strided with the engine's default run rows, dense fallback
_MODE_CONFIG: dict[str, dict[str, Any]] = {
    "strided": {"strided": True, "max_run_blocks": 1},
    "runs": {"strided": True, "max_run_blocks": 256},
    "dense": {"strided": False},
}


def bench_spec(num_blocks: int, num_views: int) -> LayoutSpec:
    """SPLIT_KV, ``num_views // 2`` layers, 16 B blocks (1 token, 1 head, head_dim 8, 2 B)."""
    return LayoutSpec(AttnKind.SPLIT_KV, num_views // 2, num_blocks, 1, 1, 8, 2)


def region_pattern(region: int, offsets: npt.NDArray[np.int64]) -> U8:
    """The producer's byte at each byte offset of region ``region`` (cheap, deterministic)."""
    x = offsets.astype(np.uint32) * np.uint32(2654435761) + np.uint32(40503 * (region + 1))
    return (x >> np.uint32(13)).astype(np.uint8)


def _producer_main(num_blocks: int, num_views: int, conn: Connection) -> None:
    from kvxfer.engine.producer import Producer

    spec = bench_spec(num_blocks, num_views)
    bufs = allocate_cache(spec)
    for r, b in enumerate(bufs):
        b[:] = region_pattern(r, np.arange(b.size, dtype=np.int64))
    with Producer(EngineConfig("fc-p", model_name=MODEL), [(spec, bufs)]) as prod:
        conn.send(prod.address)
        conn.recv()  # "stop"


def _recv_from(proc: Any, conn: Connection, timeout_s: float) -> Any:
    """The child's next message; raise at once if it died, or after ``timeout_s``."""
    until = time.monotonic() + timeout_s
    while not conn.poll(0.05):
        if not proc.is_alive():
            raise RuntimeError(f"benchmark child exited with code {proc.exitcode}")
        if time.monotonic() > until:
            raise TimeoutError(f"benchmark child sent nothing in {timeout_s} s")
    return conn.recv()


def _verify(spec: LayoutSpec, bufs: Sequence[U8], lids: np.ndarray, rids: np.ndarray) -> bool:
    """Local blocks ``lids`` of every region hold the producer's blocks ``rids``."""
    blk = spec.kernel_block_bytes
    offs = (rids[:, None] * blk + np.arange(blk)[None, :]).astype(np.int64)  # (n, blk)
    return all(
        np.array_equal(b.reshape(-1, blk)[lids], region_pattern(r, offs))
        for r, b in enumerate(bufs)
    )


def _contact(
    address: str, spec: LayoutSpec, mode: str, tag: str, rng: np.random.Generator
) -> dict[str, Any]:
    """One consumer: first request (timed by phase), then a warm one; both verified."""
    from kvxfer.engine.consumer import Consumer

    bufs = allocate_cache(spec)
    cfg = EngineConfig(f"fc-d-{tag}", model_name=MODEL, deadline_s=120.0,
                       handshake_timeout_s=60.0, **_MODE_CONFIG[mode])  # fmt: skip
    nb = spec.num_blocks
    with Consumer(cfg, [(spec, bufs)]) as cons:
        lids, rids = (rng.choice(nb, REQUEST_BLOCKS, replace=False) for _ in range(2))
        t0 = time.perf_counter()
        t = cons.read("first", address, local_block_ids=lids, remote_block_ids=rids)
        state = t.wait(120.0)
        t1 = time.perf_counter()
        ok = state is RequestState.DONE and _verify(spec, bufs, lids, rids)
        t2 = time.perf_counter()
        peer = cons.connect(address)
        phases = dict(peer.timings_s)
        phases["xfer"] = t.finished_at - t.posted_at
        phases["verify"] = t2 - t1
        phases["other"] = (t2 - t0) - sum(phases.values())
        lids2, rids2 = (rng.choice(nb, REQUEST_BLOCKS, replace=False) for _ in range(2))
        w = cons.read("warm", address, local_block_ids=lids2, remote_block_ids=rids2)
        warm_ok = w.wait(120.0) is RequestState.DONE and _verify(spec, bufs, lids2, rids2)
        return {
            "total_s": t2 - t0,
            "phases_s": phases,
            "build_prepare_s": phases["build"] + phases["prepare"],
            "warm_s": w.latency_s,
            "verified": bool(ok and warm_ok),
            "error": str(t.error or w.error or ""),
            "num_rows": peer.num_rows,
            "num_descriptors": peer.num_descriptors,
            "request_descriptors": t.num_descriptors,
        }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of every timing over runs; flags and counts from all / the first."""
    med: dict[str, Any] = {k: float(np.median([r[k] for r in runs])) for k in ("total_s", "build_prepare_s", "warm_s")}  # fmt: skip
    med["phases_s"] = {p: float(np.median([r["phases_s"][p] for r in runs])) for p in PHASES}
    med["verified"] = all(r["verified"] for r in runs)
    med["errors"] = [r["error"] for r in runs if r["error"]]
    for k in ("num_rows", "num_descriptors", "request_descriptors"):
        med[k] = runs[0][k]
    med["runs_total_s"] = [r["total_s"] for r in runs]
    return med


def bench_size(num_blocks: int, num_views: int, repeat: int, seed: int, advance: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Spawn a producer of this size; ``repeat`` first contacts per mode (alternating)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer_main, args=(num_blocks, num_views, child), daemon=True)
    proc.start()
    spec = bench_spec(num_blocks, num_views)
    rng = np.random.default_rng(seed + num_blocks)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    try:
        address = _recv_from(proc, conn, 120.0)
        for i in range(repeat):
            for mode in MODES:
                runs[mode].append(_contact(address, spec, mode, f"{mode}{i}", rng))
                if advance:
                    advance(f"{num_blocks} blocks, {mode} #{i + 1}")
        conn.send("stop")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    res = {m: _median(r) for m, r in runs.items()}
    s, d, u = res["strided"], res["dense"], res["runs"]
    return {
        "num_blocks": num_blocks,
        "num_views": num_views,
        "num_descriptors": num_blocks * num_views,
        "verified": s["verified"] and d["verified"],
        **res,
        "ratios": {
            "dense_over_strided_build_prepare": d["build_prepare_s"] / s["build_prepare_s"],
            "dense_over_strided_total": d["total_s"] / s["total_s"],
            "dense_over_runs_build_prepare": d["build_prepare_s"] / u["build_prepare_s"],
            "strided_total_over_warm": s["total_s"] / s["warm_s"],
            "dense_total_over_warm": d["total_s"] / d["warm_s"],
        },
    }


def _targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    big = max(results, key=lambda r: r["num_descriptors"])
    small = min(results, key=lambda r: r["num_descriptors"])
    speedup = big["ratios"]["dense_over_strided_build_prepare"]
    flat = big["strided"]["build_prepare_s"] / small["strided"]["build_prepare_s"]
    return {
        "evaluated": big["num_descriptors"] >= TARGET_MIN_DESCRIPTORS,
        "at_num_descriptors": big["num_descriptors"],
        "dense_over_strided_build_prepare": speedup,
        "dense_over_strided_min": TARGET_SPEEDUP,
        "speedup_met": speedup >= TARGET_SPEEDUP,
        "strided_largest_over_smallest": flat,
        "strided_flat_max": TARGET_FLAT,
        "flat_met": flat <= TARGET_FLAT,
        "dense_over_runs_build_prepare": big["ratios"]["dense_over_runs_build_prepare"],
        "runs_largest_over_smallest": big["runs"]["build_prepare_s"]
        / small["runs"]["build_prepare_s"],
    }


def run_bench(
    blocks: Sequence[int],
    num_views: int,
    repeat: int,
    *,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every size; return the result document (without machine info)."""
    t0 = time.perf_counter()
    results = [bench_size(nb, num_views, repeat, seed, progress) for nb in blocks]
    return {
        "benchmark": "first_contact",
        "format": 1,
        "config": {"blocks": list(blocks), "num_views": num_views, "repeat": repeat,
                   "seed": seed, "request_blocks": REQUEST_BLOCKS, "tp": "1->1",
                   "layout": "split_kv, 1 token x 1 head x 8 x 2 B = 16 B blocks; real NIXL, "
                             "producer in a spawned process"},
        "results": results,
        "targets": _targets(results),
        "wall_seconds": time.perf_counter() - t0,
    }  # fmt: skip


COLUMNS = ["blocks", "descriptors", "mode", "fetch", "add agent", "build", "prepare", "xfer",
           "verify", "other", "total", "warm", "dense/this (build+prep)", "verified"]  # fmt: skip


def table_rows(doc: dict[str, Any]) -> list[list[object]]:
    from kvxfer.bench.report import fmt_ratio
    from kvxfer.bench.report import fmt_seconds as f

    out: list[list[object]] = []
    for r in doc["results"]:
        for mode in MODES:
            m = r[mode]
            ratio = (fmt_ratio(r["ratios"]["dense_over_strided_build_prepare"]) if mode == "strided"
                     else fmt_ratio(r["ratios"]["dense_over_runs_build_prepare"]) if mode == "runs"
                     else "")  # fmt: skip
            out.append([r["num_blocks"], f"{r['num_descriptors']:,}", mode]
                       + [f(m["phases_s"][p]) for p in PHASES]
                       + [f(m["total_s"]), f(m["warm_s"]), ratio, m["verified"]])  # fmt: skip
    return out


def print_report(doc: dict[str, Any]) -> None:
    from kvxfer.bench.report import default_console, fmt_ratio, make_table

    con = default_console()
    views = doc["config"]["num_views"]
    con.print(make_table(f"first contact, {views} views, TP 1->1 (median of {doc['config']['repeat']})",
                         COLUMNS, table_rows(doc), left=(0, 2)))  # fmt: skip
    t = doc["targets"]
    ok = {True: "[green]OK[/]", False: "[red]MISS[/]"}
    if not t["evaluated"]:
        ok = {True: "(n/a)", False: "(n/a: judged at >= 6 M descriptors)"}
    con.print(f"at {t['at_num_descriptors']:,} descriptors: build+prepare dense/strided "
              f"{fmt_ratio(t['dense_over_strided_build_prepare'])} (target >= 1000x) "
              f"{ok[t['speedup_met']]}; strided largest/smallest "
              f"{fmt_ratio(t['strided_largest_over_smallest'])} (target <= 2x) {ok[t['flat_met']]}")  # fmt: skip
    ok_all = all(r["verified"] for r in doc["results"])
    con.print(f"all bytes verified: {ok_all}; wall {doc['wall_seconds']:.1f} s")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvxfer bench first-contact``; returns the exit code."""
    from kvxfer.bench.report import progress_bar, save_loglog_png, write_json

    blocks = tuple(args.blocks) if args.blocks else (QUICK_BLOCKS if args.quick else DEFAULT_BLOCKS)
    views = QUICK_VIEWS if args.quick else DEFAULT_VIEWS
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    if any(b < REQUEST_BLOCKS * 2 for b in blocks) or repeat < 1:
        print(f"kvxfer bench first-contact: error: --blocks must be >= {REQUEST_BLOCKS * 2} "
              "and --repeat >= 1", file=sys.stderr)  # fmt: skip
        return 2
    with progress_bar(len(blocks) * repeat * len(MODES), "first-contact") as advance:
        doc = run_bench(blocks, views, repeat, seed=args.seed, progress=advance)
    print_report(doc)
    if args.json:
        print(f"wrote {write_json(args.json, doc)}", file=sys.stderr)
    if args.png:
        xs = [r["num_descriptors"] for r in doc["results"]]
        series = {}
        for mode in MODES:
            series[f"{mode} build+prepare"] = (xs, [r[mode]["build_prepare_s"] for r in doc["results"]])  # fmt: skip
            series[f"{mode} total"] = (xs, [r[mode]["total_s"] for r in doc["results"]])
        series["strided warm request"] = (xs, [r["strided"]["warm_s"] for r in doc["results"]])
        path = save_loglog_png(args.png, series, title=f"first contact, {views} views",
                               xlabel="descriptors in the cache", ylabel="seconds (median)")  # fmt: skip
        print(f"wrote {path}", file=sys.stderr)
    return 0
