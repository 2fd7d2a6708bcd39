"""``kvxfer bench vllm``: kvxfer's connector vs vLLM's NixlConnector inside real vLLM.

Runs from the main environment: launches :mod:`kvxfer.bench.vllm_driver` under the vLLM
environment's Python (env ``KVXFER_VLLM_PYTHON``, default ``<repo>/.venv-vllm/bin/python``)
holding ``/tmp/kvxfer-vllm.lock`` (one vLLM job on the machine at a time), then prints
the table and writes JSON and PNG. Per connector and KV pool size: decode-side TTFT of
the first request to a new prefill peer, warm TTFT (median of the rest), first/warm,
and greedy tokens equal to a colocated run. Same model, prompts and machine; a fresh
prefill and decode per (connector, size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.bench.report import fmt_ratio, fmt_seconds, print_table, write_json

__all__ = ["COLUMNS", "DEFAULT_SIZES", "QUICK_SIZES", "analyse", "run", "table_rows"]

# GiB per instance (vLLM takes whole GiB); 8: 1 M Nixl descriptors per list, ~22 of 23.5 GB
DEFAULT_SIZES = (1, 2, 4, 8)
QUICK_SIZES = (1,)
LOCK = "/tmp/kvxfer-vllm.lock"
TARGET_FIRST_OVER_WARM = 1.2
_ORDER = {"nixl": 0, "kvxfer": 1, "kvxfer-pre": 2, "kvxfer-push": 3, "kvxfer-push-pre": 4}
# targets key -> the variant judged there (beside "kvxfer", judged at the top level)
_VARIANT_TARGETS = {"preconnected": "kvxfer-pre", "push": "kvxfer-push",
                    "push_preconnected": "kvxfer-push-pre"}  # fmt: skip
COLUMNS = ["connector", "KV GiB", "blocks", "Nixl descs/list", "first TTFT", "first range",
           "warm TTFT", "first/warm", "paired first/warm", "vs Nixl first", "tokens equal"]  # fmt: skip


def vllm_python() -> str:
    """The vLLM environment's interpreter: ``$KVXFER_VLLM_PYTHON`` or the repo's venv."""
    env = os.environ.get("KVXFER_VLLM_PYTHON")
    if env:
        return env
    return str(Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python")


def analyse(raw: dict[str, Any]) -> dict[str, Any]:
    """Per (connector, size) figures and the issue's targets from the driver's output."""
    from kvxfer.bench.vllm_driver import MODEL_SHAPE, nixl_descriptors, pool_blocks

    shape = {k: raw["config"][k] for k in MODEL_SHAPE}
    rows = []
    failed = [{"connector": p["connector"], "kv_gib": p["kv_gib"], "error": p["error"]}
              for p in raw["pairs"] if "error" in p]  # fmt: skip
    for pair in raw["pairs"]:
        if "error" in pair:
            continue
        reqs = pair["requests"]
        # the global warm baseline: the first incarnation's warm requests (sample 0)
        warm = [r["ttft_s"] for r in reqs if not r["first"] and r.get("sample", 0) == 0]
        firsts = [r for r in reqs if r["first"]]  # one per prefill incarnation
        mid = sorted(firsts, key=lambda r: r["ttft_s"])[(len(firsts) - 1) // 2]
        blocks = pool_blocks(pair["kv_gib"], shape)
        rows.append({
            "connector": pair["connector"], "kv_gib": pair["kv_gib"], "num_blocks": blocks,
            "num_blocks_logged": pair.get("num_blocks_logged"),
            "nixl_descriptors_per_list": nixl_descriptors(blocks, shape),
            "first_ttft_s": mid["ttft_s"], "first_ttfts_s": [r["ttft_s"] for r in firsts],
            "warm_ttft_s": float(np.median(warm)),
            "warm_ttfts_s": warm, "first_over_warm": mid["ttft_s"] / float(np.median(warm)),
            "tokens_equal": sum(r["tokens_equal"] for r in reqs), "requests": len(reqs),
            "init_s": pair["init_s"], "first_timeline_s": mid.get("timeline_s"),
            "warm_timeline_s": _median_timeline([r.get("timeline_s") for r in reqs if not r["first"]]),
            "peer_rows": pair.get("peer_rows"), "peer_descriptors": pair.get("peer_descriptors"),
            **_paired(reqs),
        })  # fmt: skip
    nixl = {r["kv_gib"]: r for r in rows if r["connector"] == "nixl"}
    for r in rows:
        base = nixl.get(r["kv_gib"])
        r["first_over_nixl_first"] = r["first_ttft_s"] / base["first_ttft_s"] if base else None
        r["gap_s"] = base["first_ttft_s"] - r["first_ttft_s"] if base else None
    targets = _targets(rows, "kvxfer")
    targets["all_tokens_equal"] = (
        all(r["tokens_equal"] == r["requests"] for r in rows) and not failed
    )
    for key, label in _VARIANT_TARGETS.items():
        if any(r["connector"] == label for r in rows):
            targets[key] = _targets(rows, label)
    return {"config": raw["config"], "rows": rows, "targets": targets, "failed": failed}


def _targets(rows: list[dict[str, Any]], connector: str) -> dict[str, Any]:
    """The issue's targets for one kvxfer variant against NixlConnector."""
    kx = sorted((r for r in rows if r["connector"] == connector), key=lambda r: r["kv_gib"])
    gaps = [r["gap_s"] for r in kx if r["gap_s"] is not None]
    largest = kx[-1] if kx else None
    return {
        "evaluated": len(gaps) >= 2,
        "kvxfer_first_below_nixl_every_size": bool(gaps) and all(g > 0 for g in gaps),
        # every step up in size widens the gap (first TTFTs are medians over samples)
        "gap_grows_with_size": len(gaps) >= 2 and all(b > a for a, b in pairwise(gaps)),
        "gap_largest_over_smallest": gaps[-1] / gaps[0] if len(gaps) >= 2 and gaps[0] else None,
        "gaps_s": gaps,
        "largest_kv_gib": largest["kv_gib"] if largest else None,
        "kvxfer_first_over_warm_largest": largest["first_over_warm"] if largest else None,
        "first_over_warm_met": (
            largest is not None and largest["first_over_warm"] <= TARGET_FIRST_OVER_WARM
        ),
        "kvxfer_paired_first_over_warm_largest": (
            largest.get("paired_first_over_warm") if largest else None
        ),
        "paired_first_over_warm_met": (
            largest is not None
            and largest.get("paired_first_over_warm") is not None
            and largest["paired_first_over_warm"] <= TARGET_FIRST_OVER_WARM
        ),
    }


def _paired(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """First/warm within each prefill incarnation: its first request over the median of
    the warm requests to that same incarnation (same new process, same moment on the
    shared cores), and by phase what the first spent beyond them. Medians over the
    incarnations that had warm requests; empty when none had."""
    ratios, excess = [], []
    for n in sorted({r.get("sample", 0) for r in reqs}):
        first = [r for r in reqs if r["first"] and r.get("sample", 0) == n]
        warm = [r for r in reqs if not r["first"] and r.get("sample", 0) == n]
        if not first or not warm:
            continue
        ratios.append(first[0]["ttft_s"] / float(np.median([r["ttft_s"] for r in warm])))
        ftl, wtl = first[0].get("timeline_s"), _median_timeline([r.get("timeline_s") for r in warm])
        if ftl and wtl:
            excess.append({k: v - wtl.get(k, 0.0) for k, v in ftl.items()})
    if not ratios:
        return {}
    keys = list(dict.fromkeys(k for e in excess for k in e))
    return {
        "paired_first_over_warm": float(np.median(ratios)),
        "paired_ratios": ratios,
        "paired_excess_s": {k: float(np.median([e.get(k, 0.0) for e in excess])) for k in keys},
    }


def _median_timeline(tls: list[dict[str, float] | None]) -> dict[str, float] | None:
    good = [t for t in tls if t]
    if not good:
        return None
    return {k: float(np.median([t[k] for t in good])) for k in good[0]}


def table_rows(doc: dict[str, Any]) -> list[list[str]]:
    """One row per (size, connector), for the console and the markdown page."""
    return [
        [r["connector"], f"{r['kv_gib']:g}", f"{r['num_blocks']:,}",
         f"{r['nixl_descriptors_per_list']:,}", fmt_seconds(r["first_ttft_s"]),
         _range(r.get("first_ttfts_s") or [r["first_ttft_s"]]), fmt_seconds(r["warm_ttft_s"]), fmt_ratio(r["first_over_warm"]),
         fmt_ratio(r.get("paired_first_over_warm")),
         fmt_ratio(r["first_over_nixl_first"]), f"{r['tokens_equal']}/{r['requests']}"]
        for r in sorted(doc["rows"], key=lambda r: (r["kv_gib"], _ORDER.get(r["connector"], 9)))
    ]  # fmt: skip


def _range(values: list[float]) -> str:
    return f"{fmt_seconds(min(values))}-{fmt_seconds(max(values))} (n={len(values)})"


def timeline_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """kvxfer's first request, phase by phase (s), per variant and size (a phase the
    request did not pay, such as first contact done at start, shows as -)."""
    kx = [r for r in doc["rows"] if r["connector"] in _ORDER and r["connector"] != "nixl"
          and r["first_timeline_s"]]  # fmt: skip
    if not kx:
        return [], []
    keys: list[str] = []
    for r in kx:
        keys += [k for k in r["first_timeline_s"] if k not in keys]
    kx.sort(key=lambda r: (_ORDER[r["connector"]], r["kv_gib"]))
    cols = ["connector", "KV GiB", *keys, "TTFT"]
    rows = [[r["connector"], f"{r['kv_gib']:g}",
             *(fmt_seconds(max(0.0, r["first_timeline_s"][k])) if k in r["first_timeline_s"]
               else "-" for k in keys),
             fmt_seconds(r["first_ttft_s"])] for r in kx]  # fmt: skip
    return cols, rows


def markdown_section(doc: dict[str, Any]) -> list[str]:
    """The tables and targets of ``docs/benchmarks.md``'s vLLM section (analysis added by hand)."""
    from kvxfer.bench.report import markdown_table

    c, t = doc["config"], doc["targets"]

    def met(ok: bool) -> str:
        return "**met**" if ok else "**MISSED**"

    def target_lines(label: str, t: dict[str, Any]) -> list[str]:
        return [
            f"- {label} first TTFT below NixlConnector's at every size: "
            f"{met(t['kvxfer_first_below_nixl_every_size'])}; gap (Nixl - {label}) by size: "
            f"{', '.join(fmt_seconds(g) for g in t['gaps_s'])}, growing: "
            f"{met(t['gap_grows_with_size'])}",
            f"- {label} first/warm at {t['largest_kv_gib']} GiB: "
            f"{fmt_ratio(t['kvxfer_first_over_warm_largest'])} (target <= 1.2x): "
            f"{met(t['first_over_warm_met'])}",
            *(
                [
                    f"- {label} paired first/warm at {t['largest_kv_gib']} GiB (each first over "
                    f"the warm requests to its own prefill incarnation): "
                    f"{fmt_ratio(t['kvxfer_paired_first_over_warm_largest'])}: "
                    f"{met(t['paired_first_over_warm_met'])}"
                ]
                if t.get("kvxfer_paired_first_over_warm_largest") is not None
                else []
            ),
        ]

    lines = [
        f"Model: random Llama, {c['layers']} layers, {c['kv_heads']} KV head, head_dim "
        f"{c['head_dim']}, float32, block_size {c['block_size']}: "
        f"{c['page_bytes_per_layer'] // 1024} KiB per (layer, block). vLLM {c['vllm']} (CPU). "
        f"Prompts of {min(c['prompt_lengths'])}-{max(c['prompt_lengths'])} tokens, "
        f"{c['max_tokens']} greedy tokens. First TTFT: median over "
        f"{c.get('first_samples', 1)} first requests per pair, each to a new prefill "
        f"incarnation (the decode kept; range in the next column); warm = median of the "
        f"{len(c['prompt_lengths']) - 1} requests after the first. Paired first/warm: "
        f"after each first request, {c.get('paired_warm', 0)} warm requests to the same "
        "prefill incarnation (the first incarnation: its warm requests); the median over "
        "incarnations of first over their median. The gap grows when every "
        "step up in size widens it.",
        "",
        markdown_table(COLUMNS, table_rows(doc)),
        "",
        *target_lines("kvxfer", t),
        *(ln for k, lab in _VARIANT_TARGETS.items() if k in t for ln in target_lines(lab, t[k])),
        f"- decode tokens equal to the colocated run: "
        f"{'all' if t['all_tokens_equal'] else '**NOT all**'}",
    ]
    for f in doc.get("failed", []):
        lines.append(f"- **{f['connector']} at {f['kv_gib']} GiB failed**: {f['error']}")
    cols, trows = timeline_rows(doc)
    if trows:
        lines += ["", "kvxfer's first request, decode side, by phase:", "",
                  markdown_table(cols, trows)]  # fmt: skip
    cols, trows = excess_rows(doc)
    if trows:
        lines += ["", "What kvxfer's first request spent beyond the warm requests to the same "
                  "prefill incarnation, by phase (median over incarnations; negative: less):",
                  "", markdown_table(cols, trows)]  # fmt: skip
    return lines


def excess_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per kvxfer variant and size: the first request's time beyond its paired warm
    requests, phase by phase (contact phases are the first's alone)."""
    kx = [r for r in doc["rows"] if r.get("paired_excess_s")]
    if not kx:
        return [], []
    keys: list[str] = []
    for r in kx:
        keys += [k for k in r["paired_excess_s"] if k not in keys]
    kx.sort(key=lambda r: (_ORDER.get(r["connector"], 9), r["kv_gib"]))
    cols = ["connector", "KV GiB", *keys]
    rows = [[r["connector"], f"{r['kv_gib']:g}",
             *(_signed_ms(r["paired_excess_s"][k]) if k in r["paired_excess_s"] else "-"
               for k in keys)] for r in kx]  # fmt: skip
    return cols, rows


def _signed_ms(seconds: float) -> str:
    return f"{seconds * 1e3:+.1f} ms"


def chart_series(doc: dict[str, Any]) -> list[tuple[str, str, list[int], list[float]]]:
    """``(label, style, KV GiB, TTFT s)`` per connector that ran and per kind (first,
    warm), in the table's order: connectors not run get no legend entry."""
    out = []
    for c in _ORDER:
        rows = sorted((r for r in doc["rows"] if r["connector"] == c), key=lambda r: r["kv_gib"])
        if not rows:
            continue
        for k, style in (("first", "-o"), ("warm", "--s")):
            xs, ys = [r["kv_gib"] for r in rows], [r[f"{k}_ttft_s"] for r in rows]
            out.append((f"{c} {k}", style, xs, ys))
    return out


def save_png(path: str | Path, doc: dict[str, Any]) -> Path:
    """First and warm decode TTFT (log) vs KV pool size, both connectors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, style, xs, ys in chart_series(doc):
        ax.semilogy(xs, ys, style, label=label)
    sizes = {r["kv_gib"]: r["nixl_descriptors_per_list"] for r in doc["rows"]}
    ax.set_xticks(sorted(sizes))
    ax.set_xticklabels([f"{g} GiB\n{sizes[g] / 1e3:.0f}k" for g in sorted(sizes)])
    ax.set_title("vLLM P/D decode TTFT: first request to a new prefill vs warm")
    ax.set_xlabel("KV pool per instance / NixlConnector (layer, block) descriptors per list")
    ax.set_ylabel("decode TTFT (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvxfer bench vllm``; 0 when every decode matched the colocated tokens."""
    sizes = list(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    py = vllm_python()
    if not os.path.exists(py):
        print(f"kvxfer bench vllm: no vLLM python at {py} (set KVXFER_VLLM_PYTHON or run "
              "scripts/_vllm_venv.sh)", file=sys.stderr)  # fmt: skip
        return 2
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvxfer-vllm-bench-") as tmp:
        out = Path(tmp) / "raw.json"
        lock = ["flock", args.lock] if args.lock else []  # "": the caller holds the lock
        cmd = [*lock, "timeout", str(args.timeout), py, "-m", "kvxfer.bench.vllm_driver",
               "--sizes", *map(str, sizes), "--prompts", str(3 if args.quick else args.prompts),
               "--first-samples", str(1 if args.quick else args.first_samples),
               "--paired-warm", str(0 if args.quick else args.paired_warm),
               "--out", str(out), "--log-dir", args.log_dir]  # fmt: skip
        if args.connectors:
            cmd[-4:-4] = ["--connectors", *args.connectors]
        rc = subprocess.call(cmd, env=env)
        if rc != 0 or not out.exists():
            print(f"kvxfer bench vllm: driver failed (exit {rc}); logs in {args.log_dir}",
                  file=sys.stderr)  # fmt: skip
            return rc or 1
        raw = json.loads(out.read_text())
    if args.raw_out:
        Path(args.raw_out).write_text(json.dumps(raw))
    doc = analyse(raw)
    print_table(
        "vLLM P/D: decode TTFT, kvxfer connector vs NixlConnector", COLUMNS, table_rows(doc)
    )
    cols, trows = timeline_rows(doc)
    if trows:
        print_table("kvxfer: first request's decode TTFT by phase", cols, trows)
    cols, trows = excess_rows(doc)
    if trows:
        print_table("kvxfer: first request beyond the warm ones to the same prefill, by phase",
                    cols, trows)  # fmt: skip
    if args.json:
        write_json(args.json, {"benchmark": "vllm", **doc})
        Path(args.json).with_suffix(".md").write_text("\n".join(markdown_section(doc)) + "\n")
    if args.png:
        save_png(args.png, doc)
    return 0 if doc["targets"]["all_tokens_equal"] else 1


def add_parser(subparsers: Any) -> None:
    """``kvxfer bench vllm`` (registered by ``kvxfer.cli.main``)."""
    p = subparsers.add_parser(
        "vllm",
        help="kvxfer connector vs vLLM's NixlConnector: first/warm decode TTFT by KV pool size",
    )
    p.add_argument("--quick", action="store_true", help="smallest pool, 3 prompts (smoke test)")
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        metavar="GIB",
        help=f"KV pool GiB per instance (default {' '.join(map(str, DEFAULT_SIZES))})",
    )
    p.add_argument(
        "--prompts", type=int, default=9, help="requests per pair: 1 first + warm (default 9)"
    )
    p.add_argument(
        "--first-samples", type=int, default=3,
        help="first requests per pair, each to a new prefill incarnation (default 3)",
    )  # fmt: skip
    p.add_argument(
        "--paired-warm", type=int, default=2,
        help="warm requests to each replacement prefill after its first, for the paired "
        "first/warm (default 2)",
    )  # fmt: skip
    p.add_argument(
        "--connectors", nargs="+", choices=list(_ORDER),
        help="which to run (default nixl kvxfer kvxfer-pre; kvxfer-push(-pre): the decode "
        "in push mode)",
    )  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write results and machine info as JSON")
    p.add_argument("--png", metavar="PATH", help="write a chart (needs matplotlib)")
    p.add_argument("--log-dir", default="/tmp/kvxfer-vllm-bench-logs", help="vLLM instance logs")
    p.add_argument("--timeout", type=int, default=3600, help="driver time limit (s)")
    p.add_argument("--lock", default=LOCK, help=f"flock file ({LOCK}; '' if already held)")
    p.add_argument("--raw-out", metavar="PATH", help="also keep the driver's raw output")
    p.set_defaults(handler=run)  # fmt: skip
