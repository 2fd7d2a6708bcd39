"""The ``kvxfer`` command: a thin layer over the library.

Each subcommand registers its parser in one small ``add_*_parser`` function and sets
``handler`` to a function that imports the heavy modules only when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

Handler = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse's _SubParsersAction is private


def _run_plan(args: argparse.Namespace) -> int:
    from kvxfer.cli.plan_cmd import run

    return run(args)


def add_plan_parser(subparsers: Subparsers) -> None:
    """``kvxfer plan FILE [--json] [--request-only]``."""
    p = subparsers.add_parser(
        "plan",
        help="dry-run the transfer planner on a JSON/TOML file of two layouts and a request",
        description="Pair a local rank with a remote engine and show views, rows and request "
        "descriptors (format: docs/plan-input.md). Exit code 2 on bad input.",
    )
    p.add_argument("file", help="plan input (.json, or .toml on Python >= 3.11)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument(
        "--request-only", action="store_true", help="show only the request plan (needs a request)"
    )
    p.set_defaults(handler=_run_plan)


def _run_bench_descriptors(args: argparse.Namespace) -> int:
    from kvxfer.bench.descriptors import run

    return run(args)


def add_bench_descriptors_parser(subparsers: Subparsers) -> None:
    """``kvxfer bench descriptors``: loop vs dense vs strided vs memory floor."""
    p = subparsers.add_parser(
        "descriptors",
        help="descriptor list builders: Python loop, dense Nx3, strided Nx5, memory floor",
    )
    p.add_argument("--quick", action="store_true", help="small sizes only (1000, 2000 blocks)")
    p.add_argument("--json", metavar="PATH", help="write results and machine info as JSON")
    p.add_argument("--png", metavar="PATH", help="write a log-log chart (needs matplotlib)")
    p.add_argument(
        "--blocks", metavar="N", type=int, nargs="+", help="num_blocks values (overrides defaults)"
    )
    p.add_argument(
        "--views", type=int, default=None, help="views (K and V per layer; even; default 128)"
    )
    p.add_argument("--repeat", type=int, default=3, help="best of R runs (default 3)")
    p.set_defaults(handler=_run_bench_descriptors)


def _bench_handler(module: str) -> Handler:
    def handler(args: argparse.Namespace) -> int:
        from importlib import import_module

        run: Handler = import_module(f"kvxfer.bench.{module}").run
        return run(args)

    return handler


def _add_bench_common(p: argparse.ArgumentParser, quick_help: str) -> None:
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--json", metavar="PATH", help="write results and machine info as JSON")
    p.add_argument("--png", metavar="PATH", help="write a chart (needs matplotlib)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")


def add_bench_first_contact_parser(subparsers: Subparsers) -> None:
    """``kvxfer bench first-contact``: address -> first verified bytes, strided vs dense."""
    p = subparsers.add_parser(
        "first-contact",
        help="producer address -> first request verified (real NIXL, producer process), "
        "strided vs dense lists",
    )
    _add_bench_common(p, "16 views, 1000 and 5000 blocks, one consumer per mode")
    p.add_argument("--blocks", metavar="N", type=int, nargs="+", help="num_blocks per region")
    p.add_argument("--repeat", type=int, default=None, help="consumers per mode (default 3)")
    p.set_defaults(handler=_bench_handler("first_contact"))


def add_bench_per_request_parser(subparsers: Subparsers) -> None:
    """``kvxfer bench per-request``: CPU to plan, make and post one request."""
    p = subparsers.add_parser(
        "per-request",
        help="CPU per request (plan ids, make_xfer, post, completion) by size, contiguity, TP",
    )
    _add_bench_common(p, "8 layers, 256 and 1024 tokens")
    p.add_argument("--tokens", metavar="N", type=int, nargs="+", help="tokens per request")
    p.add_argument("--repeat", type=int, default=5, help="median of R runs (default 5)")
    p.set_defaults(handler=_bench_handler("per_request"))


def add_bench_bandwidth_parser(subparsers: Subparsers) -> None:
    """``kvxfer bench bandwidth``: cross-process READ/WRITE GB/s vs memcpy."""
    p = subparsers.add_parser(
        "bandwidth",
        help="cross-process READ/WRITE GB/s vs descriptor size and run length, and memcpy",
    )
    _add_bench_common(p, "8 MiB per transfer, 2 runs per point")
    p.add_argument("--repeat", type=int, default=None, help="median of R re-posts (default 5)")
    p.set_defaults(handler=_bench_handler("bandwidth"))


def add_bench_hold_check_parser(subparsers: Subparsers) -> None:
    """``kvxfer bench hold-check``: a pull request's latency without / with the hold check."""
    p = subparsers.add_parser(
        "hold-check",
        help="pull request latency without / with the hold check (real NIXL, producer process)",
    )
    _add_bench_common(p, "1 and 16 blocks, 20 requests each way")
    p.add_argument("--blocks", metavar="N", type=int, nargs="+", help="blocks per request")
    p.add_argument("--repeat", type=int, default=None, help="requests each way (default 200)")
    p.set_defaults(handler=_bench_handler("hold_check"))


def add_bench_all_parser(subparsers: Subparsers) -> None:
    """``kvxfer bench all``: every benchmark, JSON + PNG per benchmark, docs/benchmarks.md."""
    p = subparsers.add_parser("all", help="run every benchmark; write JSON, PNG and markdown")
    p.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    p.add_argument("--out-dir", default="docs/bench", help="JSON and PNG folder (docs/bench)")
    p.add_argument("--md", default="docs/benchmarks.md", help="markdown page to regenerate")
    p.add_argument("--no-md", action="store_true", help="do not write the markdown page")
    p.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    p.set_defaults(handler=_bench_handler("all"))


def add_bench_parser(subparsers: Subparsers) -> None:
    """``kvxfer bench <name>``: reproducible benchmarks, one table each."""
    p = subparsers.add_parser("bench", help="run a benchmark")
    bench = p.add_subparsers(dest="bench_command", metavar="BENCH")
    add_bench_descriptors_parser(bench)
    add_bench_first_contact_parser(bench)
    add_bench_per_request_parser(bench)
    add_bench_bandwidth_parser(bench)
    add_bench_hold_check_parser(bench)
    add_bench_all_parser(bench)
    __import__("kvxfer.bench.vllm", fromlist=["add_parser"]).add_parser(bench)  # bench vllm
    p.set_defaults(usage_parser=p)  # `kvxfer bench` alone prints this parser's help


def _run_demo(args: argparse.Namespace) -> int:
    from kvxfer.cli.demo_cmd import run

    return run(args)


def add_demo_parser(subparsers: Subparsers) -> None:
    """``kvxfer demo``: the main job (producer and consumer processes, verified bytes)."""
    from kvxfer.cli.demo_cmd import add_demo_parser as add

    add(subparsers, _run_demo)


def _version() -> str:
    from kvxfer import __version__

    return __version__


def configure_logging(level: str) -> None:
    """The command's logging: ``LEVEL name: message`` on stderr (the library adds none).

    NIXL and UCX log on their own, to stderr, set by environment variables read when
    NIXL loads: ``NIXL_LOG_LEVEL`` (TRACE, DEBUG, INFO, WARNING, ERROR, FATAL) and
    ``UCX_LOG_LEVEL`` (e.g. warn, info, debug). ``KVXFER_LOG_LEVEL`` sets this command's
    default level.
    """
    logging.basicConfig(
        level=level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvxfer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvxfer {_version()}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("KVXFER_LOG_LEVEL", "WARNING"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="kvxfer log level (default WARNING, or $KVXFER_LOG_LEVEL); NIXL and UCX use "
        "$NIXL_LOG_LEVEL and $UCX_LOG_LEVEL",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_demo_parser(subparsers)
    add_plan_parser(subparsers)
    add_bench_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        getattr(args, "usage_parser", parser).print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except BrokenPipeError:  # the reader went away (``kvxfer plan ... | head``)
        # stdout's buffer still holds bytes: point it at /dev/null so the flush at exit
        # does not raise again; exit 1, as rich's tables do on a closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
