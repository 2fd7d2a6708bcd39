"""``kvxfer bench per-request``: CPU cost of one request before (and on) the wire.

A qwen-32b-shaped cache (64 layers x K/V = 128 views, 8 KV heads, 16-token blocks) with
``head_dim`` shrunk to 1 and 1-byte elements, so that pools of thousands of blocks fit in
RAM on both sides; descriptor counts and merging are those of the real preset (checked
against :func:`kvxfer.layout.presets.spec_for` in every case). Two or three
:class:`~kvxfer.transport.nixl.NixlBackend` agents live in this process: the initiator
(progress thread off, it polls) and one target per producer rank (progress thread on,
1 ms delay); UCX moves the bytes across agents (loopback).

For 1K / 8K / 32K-token requests, contiguous vs scattered block ids, TP 1->1, fan-in
1->2 and fan-out 2->1, each piece is timed separately (``perf_counter`` wall and
``process_time`` CPU, median of ``repeat`` runs after one verified warm-up):
``ids`` (:func:`kvxfer.planning.request.plan_request`), ``make`` (``make_xfer`` per source),
``post`` and ``done`` (polling to completion). The bytes of the warm-up are verified
with :func:`kvxfer.testing.pattern.mismatches`.

The experiment :func:`coalesced_ids` prepares extra strided rows of run-width
descriptors (``2^k`` blocks) so that a contiguous run of ``n`` blocks is sent as
``popcount(n)`` descriptors per view instead of ``n``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.bench.coalescing import _coalescible, coalesced_ids, coalesced_rows
from kvxfer.engine.config import U8, allocate_cache
from kvxfer.layout.presets import spec_for
from kvxfer.layout.spec import AttnKind, LayoutSpec
from kvxfer.planning.pairing import pair_layouts
from kvxfer.planning.plans import PeerPlan
from kvxfer.planning.request import plan_request
from kvxfer.testing.pattern import fill, mismatches
from kvxfer.transport.nixl import NixlBackend, PreparedList, XferHandle, XferOp, XferState

__all__ = ["TP_CASES", "coalesced_ids", "coalesced_rows", "run", "run_bench"]

I64 = npt.NDArray[np.int64]
TP_CASES = (("1->1", 1, 1), ("1->2 fan-in", 1, 2), ("2->1 fan-out", 2, 1))  # (name, P, D)
DEFAULT_TOKENS = (1024, 8192, 32768)
QUICK_TOKENS = (256, 1024)
TARGET_CPU_S = 1e-3  # ids + make_xfer, 8K tokens, contiguous, 1->1
TARGET_TOKENS = 8192
MAX_WIDTH_LOG2 = 9  # coalescing rows up to 512 blocks (8K tokens) wide
_PIECES = ("ids", "make", "post", "done")


@dataclass(frozen=True, slots=True)
class Setup:
    """Sizes of one run: layers, pool blocks, tokens per block."""

    num_layers: int
    num_blocks: int
    block_size: int = 16


def shrunk_spec(s: Setup, rank: int, tp: int) -> LayoutSpec:
    """qwen-32b-like SPLIT_KV shape, 1-element heads of 1 byte (128 B blocks at TP 1)."""
    return LayoutSpec(
        AttnKind.SPLIT_KV, s.num_layers, s.num_blocks, s.block_size, 8, 1, 1, rank, tp
    )


def _preset_plan(s: Setup, p_tp: int, d_tp: int) -> PeerPlan:
    """The real qwen-32b preset paired on fake addresses (pure): for descriptor counts."""

    def lay(rank: int, tp: int, base: int) -> Any:
        spec = spec_for("qwen-32b", tp_rank=rank, tp_size=tp, num_blocks=s.num_blocks)
        if s.num_layers != spec.num_layers:  # quick mode: fewer layers
            spec = LayoutSpec(spec.kind, s.num_layers, s.num_blocks, 16, 8, 128, 2, rank, tp)
        sizes = spec.region_bytes()
        return spec.build([base + (i << 34) for i in range(len(sizes))])

    return pair_layouts(lay(0, d_tp, 1 << 44), {p: lay(p, p_tp, 2 << 44) for p in range(p_tp)})


class Rig:
    """Target agents (one per producer rank) and an initiator for one consumer rank."""

    def __init__(self, s: Setup, p_tp: int, d_tp: int, tag: str) -> None:
        self.p_specs = [shrunk_spec(s, p, p_tp) for p in range(p_tp)]
        self.d_spec = shrunk_spec(s, 0, d_tp)
        self.p_bufs = [allocate_cache(sp) for sp in self.p_specs]
        for sp, bufs in zip(self.p_specs, self.p_bufs, strict=True):
            fill(sp, bufs)
        self.d_bufs: list[U8] = allocate_cache(self.d_spec)
        self.targets = [NixlBackend(f"pr-{tag}-p{p}", progress_delay_us=1000) for p in range(p_tp)]
        self.init = NixlBackend(f"pr-{tag}-d0", progress_thread=False)
        p_layouts = {}
        for p, (sp, bufs, t) in enumerate(
            zip(self.p_specs, self.p_bufs, self.targets, strict=True)
        ):
            lay = sp.build([b.ctypes.data for b in bufs])
            t.register([(r.base_addr, r.num_bytes, 0) for r in lay.regions])
            p_layouts[p] = lay
        d_lay = self.d_spec.build([b.ctypes.data for b in self.d_bufs])
        self.init.register([(r.base_addr, r.num_bytes, 0) for r in d_lay.regions])
        self.names = {p: self.init.add_remote(t.metadata()) for p, t in enumerate(self.targets)}
        self.plan = pair_layouts(d_lay, p_layouts)
        self.d_lay, self.p_layouts = d_lay, p_layouts
        self.lists: dict[int, tuple[PreparedList, PreparedList]] = {}
        for src in self.plan.sources:
            loc = self.init.prepare(src.local_rows)
            self.lists[src.rank] = (loc, self.init.prepare(src.remote_rows, self.names[src.rank]))

    def close(self) -> None:
        self.init.close()
        for t in self.targets:
            t.close()


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(t: tuple[float, float]) -> tuple[float, float]:
    return time.perf_counter() - t[0], time.process_time() - t[1]


IdsFn = Callable[[], list[tuple[int, np.ndarray, np.ndarray]]]  # -> (rank, local, remote ids)


def _once(rig: Rig, ids_fn: IdsFn, lists: dict[int, tuple[PreparedList, PreparedList]]) -> dict[str, tuple[float, float]]:  # fmt: skip
    """One request: ids, make, post, done; (wall, cpu) seconds per piece."""
    out: dict[str, tuple[float, float]] = {}
    t = _clock()
    ids = ids_fn()
    out["ids"] = _since(t)
    t = _clock()
    xfers: list[XferHandle] = []
    for rank, lids, rids in ids:
        loc, rem = lists[rank]
        xfers.append(rig.init.make_xfer(XferOp.READ, loc, lids, rem, rids))
    out["make"] = _since(t)
    t = _clock()
    pending = [x for x in xfers if rig.init.post(x) is XferState.IN_PROGRESS]
    out["post"] = _since(t)
    t = _clock()
    while pending:
        pending = [x for x in pending if rig.init.poll(x) is XferState.IN_PROGRESS]
    out["done"] = _since(t)
    for x in xfers:
        x.release()
    return out


def _block_ids(n: int, pool: int, contiguous: bool, rng: np.random.Generator) -> tuple[I64, I64]:
    if contiguous:
        a, b = (int(x) for x in rng.integers(0, pool - n + 1, 2))
        return np.arange(a, a + n, dtype=np.int64), np.arange(b, b + n, dtype=np.int64)
    return (rng.choice(pool, n, replace=False).astype(np.int64),
            rng.choice(pool, n, replace=False).astype(np.int64))  # fmt: skip


def _measure(rig: Rig, ids_fn: IdsFn, lists: Any, lids: I64, rids: I64, repeat: int) -> dict[str, Any]:  # fmt: skip
    """Warm-up + verify, then ``repeat`` timed runs; medians per piece."""
    for b in rig.d_bufs:
        b[:] = 0
    _once(rig, ids_fn, lists)
    bad = mismatches(rig.d_spec, rig.d_bufs, rig.p_specs[0], lids, rids)
    runs = [_once(rig, ids_fn, lists) for _ in range(repeat)]
    wall = {k: float(np.median([r[k][0] for r in runs])) for k in _PIECES}
    cpu = {k: float(np.median([r[k][1] for r in runs])) for k in _PIECES}
    return {"verified": bad == 0, "mismatched_bytes": bad, "wall_s": wall, "cpu_s": cpu,
            "cpu_before_wire_s": cpu["ids"] + cpu["make"],
            "cpu_total_s": sum(cpu.values())}  # fmt: skip


# -- the coalescing experiment (rows and ids in kvxfer.bench.coalescing) ------------


def _coalesced_case(rig: Rig, lids: I64, rids: I64, repeat: int) -> dict[str, Any]:
    src = rig.plan.sources[0]
    t = time.perf_counter()
    l_rows, l_st = coalesced_rows(src.local_rows, MAX_WIDTH_LOG2)
    r_rows, r_st = coalesced_rows(src.remote_rows, MAX_WIDTH_LOG2)
    loc = rig.init.prepare(l_rows)
    rem = rig.init.prepare(r_rows, rig.names[src.rank])
    prep_s = time.perf_counter() - t
    try:
        ids_fn: IdsFn = lambda: [(src.rank, *coalesced_ids(l_st, r_st, lids, rids))]  # noqa: E731
        m = _measure(rig, ids_fn, {src.rank: (loc, rem)}, lids, rids, repeat)
        m["num_descriptors"] = int(ids_fn()[0][1].size)
        m["num_rows_prepared"] = int(l_rows.shape[0] + r_rows.shape[0])
        m["prepare_s"] = prep_s
        return m
    finally:
        loc.release()
        rem.release()


LIB_RUN_BLOCKS = 256  # EngineConfig.max_run_blocks default


def _library_case(rig: Rig, lids: I64, rids: I64, repeat: int) -> dict[str, Any] | None:
    """The planner's own run rows (``pair_layouts(max_run_blocks=...)``), where it has them."""
    try:
        t = time.perf_counter()
        plan = pair_layouts(rig.d_lay, rig.p_layouts, max_run_blocks=LIB_RUN_BLOCKS)
    except TypeError:  # a planner without run rows
        return None
    src = plan.sources[0]
    loc = rig.init.prepare(src.local_rows)
    rem = rig.init.prepare(src.remote_rows, rig.names[src.rank])
    prep_s = time.perf_counter() - t
    try:

        def ids_fn() -> list[tuple[int, np.ndarray, np.ndarray]]:
            r = plan_request(plan, lids, rids)
            return [(s.rank, s.local_ids, s.remote_ids) for s in r.sources]

        m = _measure(rig, ids_fn, {src.rank: (loc, rem)}, lids, rids, repeat)
        m["num_descriptors"] = int(ids_fn()[0][1].size)
        m["num_rows_prepared"] = int(src.local_rows.shape[0] + src.remote_rows.shape[0])
        m["prepare_s"] = prep_s
        return m
    finally:
        loc.release()
        rem.release()


def _profile(rig: Rig, lids: I64, rids: I64, top: int = 10) -> list[str]:
    """cProfile of plan + make_xfer (x50) for one request: the top lines by own time."""
    prof = cProfile.Profile()
    loc, rem = rig.lists[rig.plan.sources[0].rank]
    prof.enable()
    for _ in range(50):
        req = plan_request(rig.plan, lids, rids)
        x = rig.init.make_xfer(XferOp.READ, loc, req.sources[0].local_ids, rem, req.sources[0].remote_ids)  # fmt: skip
        x.release()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = [ln.rstrip() for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return lines[start : start + top + 1]


# -- driver ----------------------------------------------------------------------------


def run_bench(
    tokens: Sequence[int],
    setup: Setup,
    repeat: int,
    *,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every (TP case, tokens, contiguity); plus the coalescing experiment on 1->1."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    results: list[dict[str, Any]] = []
    coalesced: list[dict[str, Any]] = []
    profile: list[str] = []
    for name, p_tp, d_tp in TP_CASES:
        rig = Rig(setup, p_tp, d_tp, name.split()[0].replace("->", "to"))
        preset = _preset_plan(setup, p_tp, d_tp)
        try:
            for tok in tokens:
                n = tok // setup.block_size
                for contiguous in (True, False):
                    lids, rids = _block_ids(n, setup.num_blocks, contiguous, rng)
                    req = plan_request(rig.plan, lids, rids)
                    ref = plan_request(preset, lids, rids)

                    def ids_fn(
                        lids: I64 = lids, rids: I64 = rids, plan: PeerPlan = rig.plan
                    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
                        r = plan_request(plan, lids, rids)
                        return [(s.rank, s.local_ids, s.remote_ids) for s in r.sources]

                    m = _measure(rig, ids_fn, rig.lists, lids, rids, repeat)
                    results.append({
                        "tp": name, "tokens": tok, "num_blocks": n, "contiguous": contiguous,
                        "num_sources": len(req.sources), "num_descriptors": req.num_descriptors,
                        "num_runs": req.num_runs,
                        "preset_counts_match": (ref.num_descriptors, ref.num_runs)
                        == (req.num_descriptors, req.num_runs), **m,
                    })  # fmt: skip
                    if name == "1->1" and _coalescible(rig.plan.sources[0]):
                        c = _coalesced_case(rig, lids, rids, repeat)
                        coalesced.append({"variant": "prototype", "tokens": tok,
                                          "contiguous": contiguous, **c})  # fmt: skip
                        lib = _library_case(rig, lids, rids, repeat)
                        if lib is not None:
                            coalesced.append({"variant": f"library ({LIB_RUN_BLOCKS})",
                                              "tokens": tok, "contiguous": contiguous, **lib})  # fmt: skip
                    if name == "1->1" and contiguous and tok == _profiled(tokens):
                        profile = _profile(rig, lids, rids)
                    if progress:
                        progress(f"{name} {tok} tokens {'contig' if contiguous else 'scattered'}")
        finally:
            rig.close()
    return {
        "benchmark": "per_request",
        "format": 1,
        "config": {"tokens": list(tokens), "num_layers": setup.num_layers,
                   "num_blocks": setup.num_blocks, "block_size": setup.block_size,
                   "repeat": repeat, "seed": seed,
                   "layout": "qwen-32b-like split_kv, 8 KV heads, head_dim 1, 1 B elements"},
        "results": results,
        "coalesced": coalesced,
        "profile_plan_make": profile,
        "profile_tokens": _profiled(tokens),
        "targets": _targets(results, coalesced),
        "wall_seconds": time.perf_counter() - t0,
    }  # fmt: skip


def _profiled(tokens: Sequence[int]) -> int:
    """The request size profiled: the target's 8K tokens when measured, else the largest."""
    return TARGET_TOKENS if TARGET_TOKENS in tokens else max(tokens)


def _targets(results: list[dict[str, Any]], coalesced: list[dict[str, Any]]) -> dict[str, Any]:
    pick = [r for r in results if r["tp"] == "1->1" and r["contiguous"]
            and r["tokens"] == TARGET_TOKENS]  # fmt: skip
    cpick = [c for c in coalesced if c["contiguous"] and c["tokens"] == TARGET_TOKENS
             and c["variant"] == "prototype"]  # fmt: skip
    lpick = [c for c in coalesced if c["contiguous"] and c["tokens"] == TARGET_TOKENS
             and c["variant"] != "prototype"]  # fmt: skip
    lcpu = lpick[0]["cpu_before_wire_s"] if lpick else None
    cpu = pick[0]["cpu_before_wire_s"] if pick else None
    ccpu = cpick[0]["cpu_before_wire_s"] if cpick else None
    return {
        "evaluated": bool(pick),
        "cpu_before_wire_s": cpu,
        "cpu_before_wire_max_s": TARGET_CPU_S,
        "met": cpu is not None and cpu <= TARGET_CPU_S,
        "over_target": cpu / TARGET_CPU_S if cpu else None,
        "coalesced_cpu_before_wire_s": ccpu,
        "coalesced_met": ccpu is not None and ccpu <= TARGET_CPU_S,
        "coalesced_speedup": cpu / ccpu if cpu and ccpu else None,
        "library_runs_cpu_before_wire_s": lcpu,
        "library_runs_met": lcpu is not None and lcpu <= TARGET_CPU_S,
    }


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvxfer bench per-request``; returns the exit code."""
    from kvxfer.bench.per_request_report import print_report
    from kvxfer.bench.report import progress_bar, save_loglog_png, write_json

    tokens = tuple(args.tokens) if args.tokens else (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    setup = Setup(8, 256) if args.quick else Setup(64, 4096)
    if any(t <= 0 or t % setup.block_size or t // setup.block_size > setup.num_blocks for t in tokens) or args.repeat < 1:  # fmt: skip
        print(f"kvxfer bench per-request: error: --tokens must be positive multiples of "
              f"{setup.block_size} up to {setup.num_blocks * setup.block_size}, --repeat >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    with progress_bar(len(TP_CASES) * len(tokens) * 2, "per-request") as advance:
        doc = run_bench(tokens, setup, args.repeat, seed=args.seed, progress=advance)
    print_report(doc)
    if args.json:
        print(f"wrote {write_json(args.json, doc)}", file=sys.stderr)
    if args.png:
        series = {}
        for name, _, _ in TP_CASES:
            for contig in (True, False):
                rs = [r for r in doc["results"] if r["tp"] == name and r["contiguous"] == contig]
                label = f"{name} {'contig' if contig else 'scattered'}"
                series[label] = ([r["tokens"] for r in rs], [r["cpu_before_wire_s"] for r in rs])
        cs = [c for c in doc["coalesced"] if c["contiguous"]]
        cs = [c for c in cs if c["variant"] == "prototype"]
        series["1->1 contig, coalesced"] = ([c["tokens"] for c in cs],
                                            [c["cpu_before_wire_s"] for c in cs])  # fmt: skip
        path = save_loglog_png(args.png, series, title="CPU before the wire (ids + make_xfer)",
                               xlabel="tokens per request", ylabel="CPU seconds (median)")  # fmt: skip
        print(f"wrote {path}", file=sys.stderr)
    return 0
