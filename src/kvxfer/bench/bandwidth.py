"""``kvxfer bench bandwidth``: cross-process READ / WRITE GB/s next to memcpy.

A spawned target process registers one buffer with a :class:`~kvxfer.transport.nixl.NixlBackend`
(progress thread on, 1 ms delay) and fills it with seeded bytes; the initiator in this
process (progress thread off: it polls) registers its own buffer of the same size.

- ``size`` sweep: descriptors of 4 KiB .. 4 MiB, ``total_bytes`` per transfer, laid out
  ``2 * size`` apart on both sides so NIXL cannot merge neighbours (one descriptor each).
- ``runs`` sweep: 32 KiB blocks (a qwen-32b / llama K block) in a dense list, a request
  of ``run_blocks`` blocks made of runs of R blocks contiguous on both sides at seeded
  random places; NIXL merges each run into one descriptor.
- baseline: single-thread memcpy (``np.copyto`` of a large buffer), same process, same run.

Each point: one untimed, verified transfer (READ: the initiator compares the bytes;
WRITE: the target does and answers over the pipe), then ``repeat`` timed re-posts of the
same transfer handle; GB/s = bytes moved / median seconds (post to completion).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.transport.nixl import NixlBackend, PreparedList, XferOp, XferState

__all__ = ["DEFAULT_SIZES", "RUN_LENGTHS", "memcpy_gbps", "run", "run_bench"]

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_SIZES = tuple(4 * KIB << (2 * i) for i in range(6))  # 4 KiB .. 4 MiB
RUN_LENGTHS = (1, 2, 4, 16, 64, 256, 1024)
BLOCK = 32 * KIB
TARGET_FRACTION = 0.70  # READ GB/s / memcpy GB/s at >= 1 MiB descriptors
TARGET_MIN_SIZE = MIB
U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


def _pattern(seed: int, nbytes: int) -> U8:
    """Seeded bytes both processes can regenerate."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8).copy()


def _aligned(nbytes: int) -> U8:
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096
    return raw[start : start + nbytes]


def _gather(buf: U8, size: int, stride: int, ids: I64) -> U8:
    """``(len(ids), size)`` bytes of descriptors ``ids`` of a ``(size, stride)`` row."""
    return np.lib.stride_tricks.as_strided(buf, (buf.size // stride, size), (stride, 1))[ids]


def _target_main(nbytes: int, seed: int, conn: Connection) -> None:
    buf = _aligned(nbytes)
    buf[:] = _pattern(seed, nbytes)
    with NixlBackend("bw-target", progress_delay_us=1000) as backend:
        backend.register([(buf.ctypes.data, nbytes, 0)])
        conn.send((backend.metadata(), buf.ctypes.data))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                return
            _, wseed, size, stride, lids, rids = msg  # WRITE check: mine[rids] == theirs[lids]
            want = _gather(_pattern(wseed, nbytes), size, stride, lids)
            conn.send(bool(np.array_equal(_gather(buf, size, stride, rids), want)))


def memcpy_gbps(nbytes: int, repeat: int) -> float:
    """Single-thread memcpy GB/s (``np.copyto`` of ``nbytes``), best of ``repeat``."""
    src, dst = _pattern(7, nbytes), np.empty(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # fault the pages in
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeat))
    return nbytes / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class _Initiator:
    def __init__(self, nbytes: int, seed: int, conn: Connection, blob: bytes, addr: int) -> None:
        self.nbytes, self.seed, self.conn, self.remote_addr = nbytes, seed, conn, addr
        self.buf = _aligned(nbytes)
        self.buf[:] = 0
        self.backend = NixlBackend("bw-initiator", progress_thread=False)
        self.backend.register([(self.buf.ctypes.data, nbytes, 0)])
        self.remote = self.backend.add_remote(blob)

    def lists(self, size: int, stride: int) -> tuple[PreparedList, PreparedList]:
        """One ``(addr, size, 0, stride, nbytes // stride)`` row on each side."""
        n = self.nbytes // stride
        rows = [np.array([[a, size, 0, stride, n]], dtype=np.uint64)
                for a in (self.buf.ctypes.data, self.remote_addr)]  # fmt: skip
        return self.backend.prepare(rows[0]), self.backend.prepare(rows[1], self.remote)

    def point(self, op: XferOp, size: int, stride: int, lids: I64, rids: I64, repeat: int) -> dict[str, Any]:  # fmt: skip
        """Verify one transfer, then time ``repeat`` re-posts."""
        loc, rem = self.lists(size, stride)
        x = self.backend.make_xfer(op, loc, lids, rem, rids)
        try:
            if op is XferOp.WRITE:
                self.buf[:] = _pattern(self.seed + 1, self.nbytes)
            secs = [self._post(x) for _ in range(repeat + 1)]  # the first one is verified
            if op is XferOp.READ:
                want = _gather(_pattern(self.seed, self.nbytes), size, stride, rids)
                ok = bool(np.array_equal(_gather(self.buf, size, stride, lids), want))
            else:
                self.conn.send(("check", self.seed + 1, size, stride, lids, rids))
                ok = bool(self.conn.recv())
        finally:
            x.release()
            loc.release()
            rem.release()
        moved = lids.size * size
        med = float(np.median(secs[1:]))
        return {"op": op.value, "bytes": moved, "seconds": med, "gbps": moved / med / 1e9,
                "best_gbps": moved / min(secs[1:]) / 1e9, "verified": ok}  # fmt: skip

    def _post(self, x: Any) -> float:
        t = time.perf_counter()
        state = self.backend.post(x)
        while state is XferState.IN_PROGRESS:
            state = self.backend.poll(x)
        return time.perf_counter() - t

    def close(self) -> None:
        self.backend.close()


def _run_ids(run: int, num_blocks: int, pool: int, rng: np.random.Generator) -> tuple[I64, I64]:
    """Block ids of ``num_blocks`` blocks in runs of ``run``, at random run slots."""
    slots = pool // run
    out = []
    for _ in range(2):
        starts = rng.choice(slots, num_blocks // run, replace=False) * run
        out.append((starts[:, None] + np.arange(run)[None, :]).ravel().astype(np.int64))
    return out[0], out[1]


def run_bench(
    sizes: Sequence[int],
    total_bytes: int,
    repeat: int,
    *,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Size and run-length sweeps, READ then WRITE, plus the memcpy baseline."""
    import multiprocessing as mp

    from kvxfer.bench.first_contact import _recv_from

    t0 = time.perf_counter()
    nbytes = 2 * total_bytes  # size sweep: descriptors 2 * size apart
    memcpy = memcpy_gbps(nbytes, max(3, repeat))
    if progress:
        progress("memcpy")
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target_main, args=(nbytes, seed, child), daemon=True)
    proc.start()
    rng = np.random.default_rng(seed)
    size_pts: list[dict[str, Any]] = []
    run_pts: list[dict[str, Any]] = []
    init: _Initiator | None = None
    try:
        blob, addr = _recv_from(proc, conn, 120.0)
        init = _Initiator(nbytes, seed, conn, blob, addr)
        pool = nbytes // BLOCK
        run_blocks = min(1024, pool // 2)
        runs = [r for r in RUN_LENGTHS if r <= run_blocks]
        plan = [(XferOp.READ, "size", s) for s in sizes] + [(XferOp.READ, "run", r) for r in runs]
        for op, kind, v in [
            (op, k, v) for op in XferOp for _, k, v in plan
        ]:  # READs first: WRITEs change the target's bytes
            if kind == "size":
                ids = np.arange(total_bytes // v, dtype=np.int64)
                pt = init.point(op, v, 2 * v, ids, ids, repeat)
                size_pts.append({"size": v, **pt, "fraction_of_memcpy": pt["gbps"] / memcpy})
            else:
                lids, rids = _run_ids(v, run_blocks, pool, rng)
                pt = init.point(op, BLOCK, BLOCK, lids, rids, repeat)
                run_pts.append({"run_blocks": v, "descriptor_bytes": v * BLOCK, **pt,
                                "fraction_of_memcpy": pt["gbps"] / memcpy})  # fmt: skip
            if progress:
                progress(f"{op.value} {kind} {v}")
        conn.send(("stop",))
        proc.join(30)
    finally:
        if init is not None:
            init.close()
        if proc.is_alive():
            proc.kill()
            proc.join()
    return {
        "benchmark": "bandwidth",
        "format": 1,
        "config": {"sizes": list(sizes), "total_bytes": total_bytes, "repeat": repeat,
                   "seed": seed, "block_bytes": BLOCK, "run_lengths": [p["run_blocks"] for p in run_pts[: len(run_pts) // 2]],
                   "target": "progress thread on, 1 ms delay, spawned process",
                   "initiator": "progress thread off, polls"},
        "memcpy_gbps": memcpy,
        "sizes": size_pts,
        "runs": run_pts,
        "targets": _targets(size_pts, memcpy),
        "wall_seconds": time.perf_counter() - t0,
    }  # fmt: skip


def _targets(size_pts: list[dict[str, Any]], memcpy: float) -> dict[str, Any]:
    big = [p for p in size_pts if p["op"] == "READ" and p["size"] >= TARGET_MIN_SIZE]
    worst = min((p["fraction_of_memcpy"] for p in big), default=None)
    return {
        "evaluated": bool(big),
        "memcpy_gbps": memcpy,
        "read_fraction_min": worst,
        "read_fraction_target": TARGET_FRACTION,
        "met": worst is not None and worst >= TARGET_FRACTION,
    }


SIZE_COLUMNS = ["descriptor", "descriptors", "READ GB/s", "READ/memcpy", "WRITE GB/s",
                "WRITE/memcpy", "verified"]  # fmt: skip
RUN_COLUMNS = ["run (blocks)", "bytes per run", "READ GB/s", "READ/memcpy", "WRITE GB/s",
               "WRITE/memcpy", "verified"]  # fmt: skip


def _fmt_bytes(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def _pair(pts: list[dict[str, Any]], key: str) -> list[tuple[Any, dict[str, Any], dict[str, Any]]]:
    reads = {p[key]: p for p in pts if p["op"] == "READ"}
    writes = {p[key]: p for p in pts if p["op"] == "WRITE"}
    return [(k, reads[k], writes[k]) for k in reads if k in writes]


def size_rows(doc: dict[str, Any]) -> list[list[object]]:
    tot = doc["config"]["total_bytes"]
    return [[_fmt_bytes(k), f"{tot // k:,}", f"{r['gbps']:.2f}", f"{r['fraction_of_memcpy']:.0%}",
             f"{w['gbps']:.2f}", f"{w['fraction_of_memcpy']:.0%}", r["verified"] and w["verified"]]
            for k, r, w in _pair(doc["sizes"], "size")]  # fmt: skip


def run_rows(doc: dict[str, Any]) -> list[list[object]]:
    return [[k, _fmt_bytes(k * BLOCK), f"{r['gbps']:.2f}", f"{r['fraction_of_memcpy']:.0%}",
             f"{w['gbps']:.2f}", f"{w['fraction_of_memcpy']:.0%}", r["verified"] and w["verified"]]
            for k, r, w in _pair(doc["runs"], "run_blocks")]  # fmt: skip


def print_report(doc: dict[str, Any]) -> None:
    from kvxfer.bench.report import default_console, make_table

    con = default_console()
    mc = doc["memcpy_gbps"]
    total = _fmt_bytes(doc["config"]["total_bytes"])
    con.print(make_table(f"cross-process bandwidth vs descriptor size ({total} per transfer; "
                         f"memcpy {mc:.2f} GB/s)", SIZE_COLUMNS, size_rows(doc)))  # fmt: skip
    if doc["runs"]:
        con.print(make_table("vs contiguity: 32 KiB blocks, runs contiguous on both sides",
                             RUN_COLUMNS, run_rows(doc)))  # fmt: skip
    t = doc["targets"]
    if t["evaluated"]:
        ok = "[green]OK[/]" if t["met"] else "[red]MISS[/]"
        con.print(f"READ at >= 1 MiB descriptors: worst {t['read_fraction_min']:.0%} of memcpy "
                  f"(target >= 70%) {ok}")  # fmt: skip
    ok_all = all(p["verified"] for p in doc["sizes"] + doc["runs"])
    con.print(f"all bytes verified: {ok_all}; wall {doc['wall_seconds']:.1f} s")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvxfer bench bandwidth``; returns the exit code."""
    from kvxfer.bench.report import progress_bar, save_loglog_png, write_json

    sizes = DEFAULT_SIZES
    total = (8 if args.quick else 64) * MIB
    repeat = args.repeat if args.repeat is not None else (2 if args.quick else 5)
    if repeat < 1:
        print("kvxfer bench bandwidth: error: --repeat must be >= 1", file=sys.stderr)
        return 2
    pool = 2 * total // BLOCK
    steps = 1 + 2 * (len(sizes) + len([r for r in RUN_LENGTHS if r <= min(1024, pool // 2)]))
    with progress_bar(steps, "bandwidth") as advance:
        doc = run_bench(sizes, total, repeat, seed=args.seed, progress=advance)
    print_report(doc)
    if args.json:
        print(f"wrote {write_json(args.json, doc)}", file=sys.stderr)
    if args.png:
        series: dict[str, tuple[list[float], list[float]]] = {}
        for op in ("READ", "WRITE"):
            pts = [p for p in doc["sizes"] if p["op"] == op]
            series[f"{op}, one descriptor each"] = ([p["size"] for p in pts], [p["gbps"] for p in pts])  # fmt: skip
            pts = [p for p in doc["runs"] if p["op"] == op]
            series[f"{op}, 32 KiB blocks in runs"] = ([p["descriptor_bytes"] for p in pts],
                                                     [p["gbps"] for p in pts])  # fmt: skip
        xs = [float(s) for s in sizes]
        series["memcpy (1 thread)"] = (xs, [doc["memcpy_gbps"]] * len(xs))
        path = save_loglog_png(args.png, series, title="cross-process GB/s (NIXL UCX, one host)",
                               xlabel="bytes per (merged) descriptor", ylabel="GB/s (median)")  # fmt: skip
        print(f"wrote {path}", file=sys.stderr)
    return 0
