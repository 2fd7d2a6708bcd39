"""``kvxfer bench all``: every benchmark, their JSON and PNG, and ``docs/benchmarks.md``.

Runs ``descriptors``, ``first-contact``, ``per-request``, ``bandwidth`` and ``hold-check`` in turn (each
prints its table), writes ``<out>/<name>.json`` and ``<out>/<name>.png``, then renders one
markdown page from the JSON documents: machine, tables, targets, chart links.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["BENCHES", "machine_description", "render_markdown", "run", "run_all"]

BENCHES = ("descriptors", "first_contact", "per_request", "bandwidth", "hold_check")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_description() -> dict[str, Any]:
    """CPU model, cores, RAM, OS and library versions of this machine."""
    cpu = platform.processor() or platform.machine()
    mem_kib = 0
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu = next(ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name"))  # fmt: skip
        mem = Path("/proc/meminfo").read_text().splitlines()
        mem_kib = int(next(ln.split()[1] for ln in mem if ln.startswith("MemTotal")))
    except (OSError, StopIteration, ValueError):
        pass
    import numpy as np

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(mem_kib / (1 << 20), 1),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "nixl": _version("nixl-cu12"),
    }


def _args(name: str, quick: bool, seed: int, out: Path) -> argparse.Namespace:
    common = {"quick": quick, "seed": seed, "json": str(out / f"{name}.json"),
              "png": str(out / f"{name}.png")}  # fmt: skip
    if name == "descriptors":
        return argparse.Namespace(**common, blocks=None, views=None, repeat=1 if quick else 3)
    if name == "first_contact":
        return argparse.Namespace(**common, blocks=None, repeat=None)
    if name == "per_request":
        return argparse.Namespace(**common, tokens=None, repeat=2 if quick else 5)
    if name == "hold_check":
        return argparse.Namespace(**common, blocks=None, repeat=None)
    return argparse.Namespace(**common, repeat=None)


def run_all(quick: bool, out_dir: str | Path, md_path: str | Path | None, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Run every benchmark into ``out_dir``; render ``md_path`` unless None.

    Returns:
        ``{"docs": name -> JSON document, "wall_seconds": ..., "exit_codes": ...}``.
    """
    import json
    from importlib import import_module

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    codes, docs, walls = {}, {}, {}
    for name in BENCHES:
        mod = import_module(f"kvxfer.bench.{name}")
        t = time.perf_counter()
        codes[name] = int(mod.run(_args(name, quick, seed, out)))
        walls[name] = time.perf_counter() - t
        docs[name] = json.loads((out / f"{name}.json").read_text())
    wall = time.perf_counter() - t0
    if md_path is not None:
        md = Path(md_path)
        md.parent.mkdir(parents=True, exist_ok=True)
        text = render_markdown(docs, out, md.parent, quick=quick, walls=walls, wall_s=wall)
        md.write_text(text + _kept_sections(md))
        print(f"wrote {md}", file=sys.stderr)
    return {"docs": docs, "wall_seconds": wall, "exit_codes": codes}


def _ok(flag: bool, evaluated: bool = True) -> str:
    if not evaluated:
        return "n/a (quick sizes)"
    return "**met**" if flag else "**MISSED**"


def _section_descriptors(doc: dict[str, Any]) -> list[str]:
    from kvxfer.bench.descriptors import BUILDERS, _table_rows
    from kvxfer.bench.report import fmt_ratio, markdown_table

    cols = ["blocks", "descriptors", *BUILDERS, "dense/floor", "dense/strided", "loop/dense",
            "loop MB", "dense MB", "strided MB", "floor MB"]  # fmt: skip
    t = doc["targets"]
    return [
        "Descriptor list builders over a 128-view SPLIT_KV layout (fake addresses, no NIXL):",
        "the per-block Python loop, dense `(M, 3)`, strided `(N, 5)`, and the memory floor.",
        "",
        markdown_table(cols, _table_rows(doc)),
        "",
        f"- dense build / fill floor: {fmt_ratio(t['dense_over_floor'])} (target <= 1.5x): "
        f"{_ok(t['dense_within_floor'], t['evaluated'])}",
        f"- dense / strided build: {fmt_ratio(t['dense_over_strided'])} (target >= 1000x): "
        f"{_ok(t['strided_fast_enough'], t['evaluated'])}",
    ]


def _section_first_contact(doc: dict[str, Any]) -> list[str]:
    from kvxfer.bench.first_contact import COLUMNS, table_rows
    from kvxfer.bench.report import fmt_ratio, markdown_table

    t, c = doc["targets"], doc["config"]
    return [
        f"A real producer process per cache size; {c['num_views']} views (64 layers x K/V, "
        f"TP 1->1), 16 B blocks so that 51k blocks fit in RAM; the first request reads "
        f"{c['request_blocks']} random blocks ({c['request_blocks'] * c['num_views']:,} "
        f"descriptors) and is byte-verified; median of {c['repeat']} consumers per mode. "
        "Modes: `strided` = one `(N, 5)` row per view (the engine default), `runs` = strided "
        "plus run rows up to 256 blocks (`max_run_blocks=256`, off by default), "
        "`dense` = the `(M, 3)` fallback. "
        "`prepare` covers both lists (local and remote); `xfer` is the first post to "
        "completion; `warm` is a second request of the same size on the same peer.",
        "",
        markdown_table(COLUMNS, table_rows(doc)),
        "",
        f"- build+prepare, dense / strided at {t['at_num_descriptors']:,} descriptors: "
        f"{fmt_ratio(t['dense_over_strided_build_prepare'])} (target >= 1000x): "
        f"{_ok(t['speedup_met'], t['evaluated'])}",
        f"- strided build+prepare, largest / smallest cache: "
        f"{fmt_ratio(t['strided_largest_over_smallest'])} (target <= 2x): "
        f"{_ok(t['flat_met'], t['evaluated'])}",
        f"- with run rows (max_run_blocks=256): dense / runs build+prepare "
        f"{fmt_ratio(t['dense_over_runs_build_prepare'])}, largest / smallest "
        f"{fmt_ratio(t['runs_largest_over_smallest'])}",
    ]


def _section_per_request(doc: dict[str, Any]) -> list[str]:
    from kvxfer.bench.per_request_report import (
        C_COLUMNS,
        COLUMNS,
        coalesced_table_rows,
        table_rows,
    )
    from kvxfer.bench.report import fmt_ratio, fmt_seconds, markdown_table

    t, c = doc["targets"], doc["config"]
    lines = [
        f"One request on a {c['num_layers']}-layer qwen-32b-shaped cache (block "
        f"{c['block_size']}, pool {c['num_blocks']} blocks; head_dim shrunk to 1 so both "
        "pools fit in RAM: descriptor counts equal the real preset's, checked per case). "
        "Agents in one process (initiator polls; targets run a 1 ms progress thread). "
        "CPU = `process_time`, medians of "
        f"{c['repeat']} runs; `ids` = `plan_request`, `make` = `make_xfer` (all sources); "
        "`post`/`done` are wall times (UCX copies inside `post` here).",
        "",
        markdown_table(COLUMNS, table_rows(doc)),
        "",
    ]
    if t["evaluated"]:
        lines.append(
            f"- CPU before the wire, 8K tokens, contiguous, 1->1: "
            f"{fmt_seconds(t['cpu_before_wire_s'])} (target <= 1 ms): {_ok(t['met'])}"
            + ("" if t["met"] else f", {fmt_ratio(t['over_target'])} the target")
        )
    if doc["coalesced"]:
        lines += [
            "",
            "Run-width rows: `prototype` is the experiment in `bench/per_request.py`; "
            "`library` is the planner's version (`pair_layouts(max_run_blocks=256)`, same idea). "
            "NIXL 1.5.1 refuses strided rows "
            "with `len > stride` (prepare fails with NIXL_ERR_NOT_FOUND), so a width of 2^w "
            "blocks is prepared as 2^w phase rows `(addr + j*len, len*2^w, dev, len*2^w, "
            "(count-j) >> w)`; a run of n blocks (contiguous on both sides) becomes "
            "popcount(n) descriptors per view (plus n >> 9 for runs over 512 blocks). "
            "`prepare` = building and preparing both coalesced lists once per peer.",
            "",
            markdown_table(C_COLUMNS, coalesced_table_rows(doc)),
            "",
            f"- coalesced, 8K tokens contiguous: {fmt_seconds(t['coalesced_cpu_before_wire_s'])} "
            f"({fmt_ratio(t['coalesced_speedup'])} less CPU): {_ok(t['coalesced_met'], t['evaluated'])}",
            f"- the planner's own run rows (`pair_layouts(max_run_blocks=256)`), 8K tokens "
            f"contiguous: {fmt_seconds(t.get('library_runs_cpu_before_wire_s'))}: "
            f"{_ok(bool(t.get('library_runs_met')), t['evaluated'])}",
        ]
    if doc["profile_plan_make"]:
        lines += ["", f"cProfile of plan + make_xfer, {doc['profile_tokens']} tokens contiguous "
                  "1->1, 50 calls, by own time:", "", "```",
                  *doc["profile_plan_make"], "```"]  # fmt: skip
    return lines


def _section_bandwidth(doc: dict[str, Any]) -> list[str]:
    from kvxfer.bench.bandwidth import RUN_COLUMNS, SIZE_COLUMNS, run_rows, size_rows
    from kvxfer.bench.report import markdown_table

    t, c = doc["targets"], doc["config"]
    return [
        f"A spawned target process (progress thread, 1 ms delay) and an initiator here; "
        f"{c['total_bytes'] >> 20} MiB per transfer, median of {c['repeat']} re-posts, "
        f"every point byte-verified. Single-thread memcpy (`np.copyto`) in the same run: "
        f"**{doc['memcpy_gbps']:.2f} GB/s**.",
        "",
        markdown_table(SIZE_COLUMNS, size_rows(doc)),
        "",
        "Contiguity: 32 KiB blocks in a dense list; runs contiguous on both sides merge "
        "into one descriptor inside NIXL.",
        "",
        markdown_table(RUN_COLUMNS, run_rows(doc)),
        "",
        f"- READ at >= 1 MiB descriptors: worst {t['read_fraction_min']:.0%} of memcpy "
        f"(target >= 70%): {_ok(t['met'], t['evaluated'])}",
    ]


def _section_hold_check(doc: dict[str, Any]) -> list[str]:
    from kvxfer.bench.hold_check import COLUMNS, table_rows
    from kvxfer.bench.report import fmt_ratio, fmt_seconds, markdown_table

    res = doc["results"]
    worst = max(res, key=lambda r: r["ratio_median"])
    return [
        "A pull request from `read()` to DONE without and with the hold check (the extra",
        "8-byte READ of the producer rank's slot word after the data READ, then ReadDone;",
        "docs/architecture.md, hold tickets): a producer in a spawned process, real NIXL,",
        f"{doc['config']['repeat']} requests each way, alternating, every byte verified.",
        "",
        markdown_table(COLUMNS, table_rows(doc)),
        "",
        f"- the check adds {fmt_seconds(min(r['extra_median_s'] for r in res))} to "
        f"{fmt_seconds(max(r['extra_median_s'] for r in res))} at the median; worst ratio "
        f"{fmt_ratio(worst['ratio_median'])} ({worst['blocks']}-block requests)",
    ]


_SECTIONS: dict[str, tuple[str, Callable[[dict[str, Any]], list[str]]]] = {
    "descriptors": ("Descriptor list build (`kvxfer bench descriptors`)", _section_descriptors),
    "first_contact": ("First contact (`kvxfer bench first-contact`)", _section_first_contact),
    "per_request": ("Per-request CPU (`kvxfer bench per-request`)", _section_per_request),
    "bandwidth": ("Bandwidth (`kvxfer bench bandwidth`)", _section_bandwidth),
    "hold_check": ("Hold check (`kvxfer bench hold-check`)", _section_hold_check),
}


# sections of docs/benchmarks.md that other commands write (kept when this one rewrites it)
KEPT_SECTIONS = ("## vLLM: kvxfer connector vs NixlConnector",)


def _kept_sections(md: Path) -> str:
    """The kept sections of the page at ``md`` (each up to the next ``## ``), or ""."""
    try:
        old = md.read_text()
    except OSError:
        return ""
    out = []
    for head in KEPT_SECTIONS:
        start = old.find(head + "\n")
        if start >= 0:
            end = old.find("\n## ", start + len(head))
            out.append("\n" + old[start : end if end >= 0 else len(old)].rstrip() + "\n")
    return "".join(out)


def render_markdown(
    docs: dict[str, dict[str, Any]],
    out_dir: Path,
    md_dir: Path,
    *,
    quick: bool,
    walls: dict[str, float],
    wall_s: float,
) -> str:
    """The benchmarks page: machine, then one section per benchmark (table, targets, chart)."""
    m = machine_description()
    rel = Path(os.path.relpath(out_dir, md_dir))
    lines = [
        "# Benchmarks",
        "",
        "Generated by `scripts/bench.sh` (`kvxfer bench all"
        + (" --quick" if quick else "")
        + "`); do not edit by hand. JSON and charts: `"
        + str(rel)
        + "/`. Every benchmark is seeded, runs its baseline in the same process and "
        "verifies the bytes it moves.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, {m['os']}; "
        f"Python {m['python']}, NumPy {m['numpy']}, nixl-cu12 {m['nixl']} (UCX, DRAM, "
        f"no GPU). Total run: {wall_s:.0f} s"
        + " (" + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()) + ").",
    ]  # fmt: skip
    for name, doc in docs.items():
        title, section = _SECTIONS[name]
        lines += ["", f"## {title}", "", *section(doc), "", f"![{name}]({rel / (name + '.png')})"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvxfer bench all``; returns the worst exit code."""
    res = run_all(args.quick, args.out_dir, None if args.no_md else args.md, seed=args.seed)
    print(f"kvxfer bench all: {res['wall_seconds']:.1f} s", file=sys.stderr)
    return int(max(res["exit_codes"].values()))
