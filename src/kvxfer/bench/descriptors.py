"""``kvxfer bench descriptors``: how fast can a worker build its descriptor list?

Four builders over one deterministic SPLIT_KV-like layout (``num_views`` regions, K and
V per layer, fake addresses, no memory allocated behind them), all in one process:

- ``loop``: :func:`kvxfer.planning.descriptors.reference_rows`, the per-block Python loop the
  field started from (the baseline);
- ``dense``: :func:`kvxfer.planning.descriptors.dense_rows`, ``(M, 3) uint64`` rows;
- ``strided``: :func:`kvxfer.planning.descriptors.layout_rows`, ``(N, 5) uint64`` rows from the
  layout (one per view);
- ``floor``: allocate an ``(M, 3) uint64`` array and fill its three columns, the memory
  bandwidth floor any dense builder pays.

Two extras go to the JSON and the footnote: ``strided_cols`` (:func:`strided_rows` from
ready columns, without walking the layout) and ``fill`` (one contiguous fill of ``M * 3``
words, the memset floor; column fills stride through memory and cost more).

Time: ``time.perf_counter``, best of ``repeat`` runs (the loop runs once above
:data:`LOOP_SINGLE_RUN` descriptors; builders under 1 ms are run in batches and
averaged). Memory: ``tracemalloc`` peak of one more run (NumPy reports its buffers to
tracemalloc), in a separate pass so tracing never slows the timed runs.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvxfer._intmath import ceil_div
from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout
from kvxfer.layout.spec import AttnKind, LayoutSpec
from kvxfer.planning.descriptors import dense_rows, layout_rows, reference_rows, strided_rows

__all__ = [
    "BUILDERS",
    "DEFAULT_BLOCKS",
    "QUICK_BLOCKS",
    "bench_layout",
    "fill_contiguous",
    "fill_floor",
    "run",
    "run_bench",
]

DEFAULT_BLOCKS = (1000, 2000, 5000, 10000, 25000, 51000)
DEFAULT_VIEWS = 128  # 64 layers x K/V: 128 x 51,000 = 6.5 M descriptors
QUICK_BLOCKS = (1000, 2000)
QUICK_VIEWS = 16
LOOP_SINGLE_RUN = 2_000_000  # descriptors above which the Python loop runs only once
BUILDERS = ("loop", "dense", "strided", "floor")
TARGET_DENSE_OVER_FLOOR = 1.5  # dense build at most this many times the fill floor
TARGET_DENSE_OVER_STRIDED = 1000.0  # strided build at least this many times faster
TARGET_MIN_DESCRIPTORS = 6_000_000  # targets are judged only at the full 6.5 M size
BASE_ADDR = 0x7F00_0000_0000  # fake, page aligned; regions packed 1 MiB apart
REGION_ALIGN = 1 << 20
_MIN_TIMED_S = 1e-3  # builders faster than this are timed in batches
_VERIFY_SAMPLES = 100_000  # dense vs loop rows compared at most this many


def bench_layout(num_blocks: int, num_views: int) -> CacheLayout:
    """A SPLIT_KV layout of ``num_views // 2`` layers (Llama-8B-like: 16 tokens x 8 heads x
    128 x 2 B = 32 KiB blocks), regions packed from :data:`BASE_ADDR`. Deterministic."""
    if num_views <= 0 or num_views % 2:
        raise LayoutError(f"--views must be a positive even number (K and V), got {num_views}")
    spec = LayoutSpec(AttnKind.SPLIT_KV, num_views // 2, num_blocks, 16, 8, 128, 2)
    addrs, addr = [], BASE_ADDR
    for size in spec.region_bytes():
        addrs.append(addr)
        addr = ceil_div(addr + size, REGION_ALIGN) * REGION_ALIGN
    return spec.build(addrs)


def fill_floor(num_descriptors: int, addr: int = BASE_ADDR, length: int = 32768) -> np.ndarray:
    """``(M, 3) uint64``: allocate and fill every column; the floor of any dense builder."""
    out = np.empty((num_descriptors, 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = length
    out[:, 2] = 0
    return out


def fill_contiguous(num_descriptors: int) -> np.ndarray:
    """``(M, 3) uint64`` filled by one contiguous pass: the memset floor."""
    out = np.empty(num_descriptors * 3, dtype=np.uint64)
    out.fill(BASE_ADDR)
    return out.reshape(num_descriptors, 3)


def _time(fn: Callable[[], object], repeat: int) -> list[float]:
    """Seconds per call of ``fn``, ``repeat`` samples; sub-ms calls are batched."""
    gc.collect()
    t0 = time.perf_counter()
    result = fn()
    first = time.perf_counter() - t0
    del result
    number = 1 if first >= _MIN_TIMED_S else max(1, int(_MIN_TIMED_S * 10 / max(first, 1e-7)))
    samples = [first] if number == 1 else []
    while len(samples) < repeat:
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(number):
            result = fn()
            del result
        samples.append((time.perf_counter() - t0) / number)
    return samples


def _peak_bytes(fn: Callable[[], object]) -> int:
    """tracemalloc peak of one call of ``fn``, its result still alive."""
    gc.collect()
    tracemalloc.start()
    try:
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
        del result
    finally:
        tracemalloc.stop()
    return int(peak)


def _verify(dense: np.ndarray, loop: list[tuple[int, int, int]]) -> bool:
    """Dense rows equal the loop's tuples (every row, or an even sample of them)."""
    if dense.shape[0] != len(loop):
        return False
    step = max(1, len(loop) // _VERIFY_SAMPLES)
    return bool(np.array_equal(dense[::step], np.array(loop[::step], dtype=np.uint64)))


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def bench_size(
    num_blocks: int, num_views: int, repeat: int, *, memory: bool = True
) -> dict[str, Any]:
    """Measure the four builders (plus ``strided_rows`` from ready columns) at one size."""
    layout = bench_layout(num_blocks, num_views)
    rows = layout_rows(layout)  # (N, 5)
    cols = [np.ascontiguousarray(rows[:, i]) for i in range(5)]
    m = layout.num_descriptors
    fns: dict[str, Callable[[], object]] = {
        "loop": lambda: reference_rows(rows),
        "dense": lambda: dense_rows(rows),
        "strided": lambda: layout_rows(layout),
        "floor": lambda: fill_floor(m),
        "strided_cols": lambda: strided_rows(*cols),
        "fill": lambda: fill_contiguous(m),
    }
    loop_out = reference_rows(rows)
    verified = _verify(dense_rows(rows), loop_out)
    del loop_out
    times = {"loop": _time(fns["loop"], 1 if m > LOOP_SINGLE_RUN else repeat)}
    for name in ("floor", "dense", "fill", "strided", "strided_cols"):
        times[name] = _time(fns[name], repeat)
    best = {k: min(v) for k, v in times.items()}
    peak = {k: _peak_bytes(fns[k]) for k in BUILDERS} if memory else {}
    return {
        "num_blocks": num_blocks,
        "num_views": num_views,
        "num_descriptors": m,
        "verified": verified,
        "seconds": best,
        "runs": times,
        "peak_bytes": peak,
        "ratios": {
            "dense_over_floor": _ratio(best["dense"], best["floor"]),
            "dense_over_strided": _ratio(best["dense"], best["strided"]),
            "loop_over_dense": _ratio(best["loop"], best["dense"]),
            "dense_over_fill": _ratio(best["dense"], best["fill"]),
        },
    }


def _targets(largest: dict[str, Any]) -> dict[str, Any]:
    r = largest["ratios"]
    return {
        "evaluated": largest["num_descriptors"] >= TARGET_MIN_DESCRIPTORS,
        "at_num_descriptors": largest["num_descriptors"],
        "dense_over_floor": r["dense_over_floor"],
        "dense_over_floor_max": TARGET_DENSE_OVER_FLOOR,
        "dense_within_floor": (r["dense_over_floor"] or 0.0) <= TARGET_DENSE_OVER_FLOOR,
        "dense_over_strided": r["dense_over_strided"],
        "dense_over_strided_min": TARGET_DENSE_OVER_STRIDED,
        "strided_fast_enough": (r["dense_over_strided"] or 0.0) >= TARGET_DENSE_OVER_STRIDED,
    }


def run_bench(
    blocks: Sequence[int],
    num_views: int,
    repeat: int,
    *,
    memory: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every size; return the result document (without machine info)."""
    t0 = time.perf_counter()
    results = []
    for nb in blocks:
        if progress:
            progress(f"{nb} blocks x {num_views} views ...")
        results.append(bench_size(nb, num_views, repeat, memory=memory))
    return {
        "benchmark": "descriptors",
        "format": 1,
        "config": {
            "blocks": list(blocks),
            "num_views": num_views,
            "repeat": repeat,
            "loop_single_run_above": LOOP_SINGLE_RUN,
            "layout": "split_kv, 16 tokens x 8 heads x 128 x 2 B blocks, fake addresses",
        },
        "results": results,
        "targets": _targets(max(results, key=lambda r: r["num_descriptors"])),
        "wall_seconds": time.perf_counter() - t0,
    }


def _table_rows(doc: dict[str, Any]) -> list[list[object]]:
    from kvxfer.bench.report import fmt_ratio, fmt_seconds

    out: list[list[object]] = []
    for r in doc["results"]:
        s, q, mb = r["seconds"], r["ratios"], r["peak_bytes"]
        out.append(
            [r["num_blocks"], f"{r['num_descriptors']:,}"]
            + [fmt_seconds(s[k]) for k in BUILDERS]
            + [
                fmt_ratio(q[k])
                for k in ("dense_over_floor", "dense_over_strided", "loop_over_dense")
            ]
            + [f"{mb[k] / 1e6:.3g}" if k in mb else "-" for k in BUILDERS]
        )
    return out


def _print_report(doc: dict[str, Any]) -> None:
    from kvxfer.bench.report import default_console, fmt_ratio, fmt_seconds, make_table

    con = default_console()
    cols = ["blocks", "descriptors", "loop", "dense", "strided", "floor", "dense/floor",
            "dense/strided", "loop/dense", "loop MB", "dense MB", "strided MB", "floor MB"]  # fmt: skip
    views = doc["config"]["num_views"]
    con.print(make_table(f"descriptor list builders, {views} views", cols, _table_rows(doc)))
    t = doc["targets"]
    big = max(doc["results"], key=lambda r: r["num_descriptors"])
    ok = {True: "[green]OK[/]", False: "[red]MISS[/]"}
    if not t["evaluated"]:
        ok = {True: "(n/a)", False: "(n/a: targets are judged at >= 6 M descriptors)"}
    con.print(
        f"at {t['at_num_descriptors']:,} descriptors: "
        f"dense/floor {fmt_ratio(t['dense_over_floor'])} (target <= 1.5x) "
        f"{ok[t['dense_within_floor']]}; "
        f"dense/strided {fmt_ratio(t['dense_over_strided'])} (target >= 1000x) "
        f"{ok[t['strided_fast_enough']]}"
    )
    con.print(
        f"strided_rows from ready columns: {fmt_seconds(big['seconds']['strided_cols'])} "
        f"(dense/that {fmt_ratio(big['seconds']['dense'] / big['seconds']['strided_cols'])}); "
        f"contiguous fill: {fmt_seconds(big['seconds']['fill'])} "
        f"(dense/fill {fmt_ratio(big['ratios']['dense_over_fill'])}); "
        f"dense first (cold) run: {fmt_seconds(big['runs']['dense'][0])}; "
        f"all rows verified against the loop: {all(r['verified'] for r in doc['results'])}; "
        f"wall {doc['wall_seconds']:.1f} s"
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvxfer bench descriptors``; returns the exit code."""
    blocks = tuple(args.blocks) if args.blocks else (QUICK_BLOCKS if args.quick else DEFAULT_BLOCKS)
    views = args.views if args.views is not None else (QUICK_VIEWS if args.quick else DEFAULT_VIEWS)
    bad = [b for b in blocks if b <= 0]
    if bad or args.repeat < 1 or views <= 0 or views % 2:
        print(
            "kvxfer bench descriptors: error: --blocks and --repeat must be positive and "
            f"--views positive and even (got blocks {list(blocks)}, views {views}, "
            f"repeat {args.repeat})",
            file=sys.stderr,
        )
        return 2
    from kvxfer.bench.report import save_loglog_png, write_json

    doc = run_bench(blocks, views, args.repeat, progress=lambda m: print(m, file=sys.stderr))
    _print_report(doc)
    if args.json:
        print(f"wrote {write_json(args.json, doc)}", file=sys.stderr)
    if args.png:
        xs = [r["num_descriptors"] for r in doc["results"]]
        series = {k: (xs, [r["seconds"][k] for r in doc["results"]]) for k in BUILDERS}
        path = save_loglog_png(
            args.png,
            series,
            title=f"descriptor list build time, {views} views",
            xlabel="descriptors",
            ylabel="seconds (best of runs)",
        )
        print(f"wrote {path}", file=sys.stderr)
    return 0
