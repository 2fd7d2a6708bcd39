"""``kvxfer demo``: the main job, with a progress bar and a summary table."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvxfer.cli.demo_run import DemoOptions, run_demo
from kvxfer.errors import KvxferError


def add_demo_parser(subparsers: Any, handler: Any) -> None:
    """Register ``kvxfer demo``."""
    d = DemoOptions()
    p = subparsers.add_parser(
        "demo",
        help="move KV blocks between a producer and a consumer process over NIXL; verify every byte",
        description="Starts a producer engine and a consumer engine as separate processes, "
        "fills the producer cache with a pattern, moves a stream of requests with random block "
        "ids and checks every received byte.",
    )
    p.add_argument("--preset", default=d.preset, help=f"model preset (default {d.preset})")
    p.add_argument("--producer-tp", type=int, default=d.producer_tp)
    p.add_argument("--consumer-tp", type=int, default=d.consumer_tp)
    p.add_argument(
        "--producer-block-size", type=int, default=None, help="tokens per producer block"
    )
    p.add_argument(
        "--consumer-block-size", type=int, default=None, help="tokens per consumer block"
    )
    p.add_argument(
        "--num-blocks", type=int, default=d.num_blocks, help="producer pool blocks per rank"
    )
    p.add_argument("--requests", type=int, default=d.num_requests)
    p.add_argument("--blocks-per-request", type=int, default=d.blocks_per_request)
    p.add_argument("--inflight", type=int, default=d.inflight, help="requests in flight at once")
    p.add_argument(
        "--dense", action="store_true", help="dense (N, 3) lists instead of strided (N, 5)"
    )
    p.add_argument(
        "--write",
        action="store_true",
        help="push mode: the producer WRITEs (default: consumer READs)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    p.set_defaults(handler=handler)


def run(args: argparse.Namespace) -> int:
    opts = DemoOptions(
        preset=args.preset,
        producer_tp=args.producer_tp,
        consumer_tp=args.consumer_tp,
        producer_block_size=args.producer_block_size,
        consumer_block_size=args.consumer_block_size,
        num_blocks=args.num_blocks,
        num_requests=args.requests,
        blocks_per_request=args.blocks_per_request,
        inflight=args.inflight,
        seed=args.seed,
        strided=not args.dense,
        write=args.write,
    )
    console = Console()
    try:
        opts.check()  # validate the options and shapes before starting processes
        opts.spec("d")
        with Progress(
            TextColumn("[bold]moving requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task("requests", total=opts.num_requests)
            summary = run_demo(opts, progress=lambda done, total: bar.update(task, completed=done))
    except (KvxferError, TimeoutError) as e:
        print(f"kvxfer demo: error: {e}", file=sys.stderr)
        return 2
    console.print(_table(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    if not summary["verify_ok"]:
        console.print(
            f"[red]verify FAILED[/red]: {summary['bad_bytes']} bad bytes, failed: {summary['failed'][:5]}"
        )
        return 1
    return 0


def _table(s: dict[str, Any]) -> Table:
    o = s["options"]
    fc = s["first_contact_ms"]
    mode = "WRITE (push)" if o["write"] else "READ (pull)"
    t = Table(
        title=f"kvxfer demo: {o['preset']}  TP {o['producer_tp']} -> {o['consumer_tp']}  {mode}"
    )
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("requests done / total", f"{s['done']} / {s['requests']}"),
        ("  by end state (engine stats)",
         ", ".join(f"{k} {v}" for k, v in sorted(s["requests_by_state"].items()) if v)),
        ("first contact (fetch+add agent+build+prepare)", f"{fc['total']:.1f} ms"),
        ("  fetch / add agent / build / prepare",
         f"{fc.get('fetch', 0):.2f} / {fc.get('add_agent', 0):.2f} / {fc.get('build', 0):.2f} / {fc.get('prepare', 0):.2f} ms"),
        ("first request (incl. first contact)", f"{s['first_request_ms']:.1f} ms"),
        ("descriptor lists: strided rows -> descriptors", f"{s['strided_rows']} -> {s['dense_descriptors']}"),
        ("descriptors per request", f"{s['descriptors_per_request']:.0f}"),
        ("bytes moved", f"{s['bytes'] / 2**20:.1f} MiB"),
        ("throughput", f"{s['gb_per_s']:.3f} GB/s"),
        ("latency p50 / p99", f"{s['latency_ms_p50']:.2f} / {s['latency_ms_p99']:.2f} ms"),
        ("producer: requests freed / blocks still held",
         f"{s['producer'].get('freed', '?')} / {s['producer'].get('held_blocks', '?')}"),
        ("verify", "[green]OK[/green]" if s["verify_ok"] else f"[red]FAILED ({s['bad_bytes']} bad bytes)[/red]"),
    ]  # fmt: skip
    for k, v in rows:
        t.add_row(k, v)
    return t
