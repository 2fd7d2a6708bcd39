"""``kvxfer plan FILE``: dry-run the planner on two layouts and an optional request.

Reads a JSON (or TOML) plan file (see ``docs/plan-input.md``), pairs the local rank with
the remote engine (:func:`kvxfer.planning.pairing.pair_layouts`), maps the request's block ids
(:func:`kvxfer.planning.request.plan_request`) and prints tables, or with ``--json`` one document
whose format is versioned by ``"format"``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.cli.plan_bounds import MAX_PLAN_FILE_BYTES, loads_json
from kvxfer.cli.records import PlanInput, load_plan_input
from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout
from kvxfer.planning.descriptors import LEN
from kvxfer.planning.pairing import pair_layouts
from kvxfer.planning.plans import PeerPlan, SourcePlan
from kvxfer.planning.request import RequestPlan, SourceIds, plan_request

__all__ = ["FORMAT", "plan_document", "read_plan_file", "run"]

FORMAT = "kvxfer.planning.request/1"  # bump when a key of the --json document changes meaning


def read_plan_file(path: str | Path) -> PlanInput:
    """Read and parse a plan file: ``.toml`` as TOML, anything else as JSON.

    Raises:
        LayoutError: unreadable file, bad JSON/TOML, or a bad field (named by path).
    """
    p = Path(path)
    try:
        with p.open("rb") as f:  # bounded read: never more than the limit + 1 bytes
            raw = f.read(MAX_PLAN_FILE_BYTES + 1)
        if len(raw) > MAX_PLAN_FILE_BYTES:
            raise LayoutError(f"{p}: file exceeds the limit of {MAX_PLAN_FILE_BYTES} bytes")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LayoutError(f"cannot read {p}: {getattr(exc, 'strerror', None) or exc}") from None
    if p.suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise LayoutError("TOML plan files need Python >= 3.11; use JSON") from None
        try:
            data: Any = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:
            raise LayoutError(f"{p}: invalid TOML: {str(exc)[:200]}") from None
    else:
        data = loads_json(text, str(p))
    return load_plan_input(data)


def _plan_request(inp: PlanInput, peer: PeerPlan) -> RequestPlan | None:
    req = inp.request
    if req is None:
        return None
    try:
        return plan_request(
            peer,
            np.array(req.local_block_ids, dtype=np.int64),
            np.array(req.remote_block_ids, dtype=np.int64),
            local_state_ids=None
            if req.local_state_ids is None
            else np.array(req.local_state_ids, dtype=np.int64),
            remote_state_ids=None
            if req.remote_state_ids is None
            else np.array(req.remote_state_ids, dtype=np.int64),
            num_cached_blocks=req.num_cached_blocks,
        )
    except LayoutError as exc:
        raise LayoutError(f"request: {exc}") from None


# --- the document: one source of truth for --json and the tables ------------------------


def _ints(a: npt.NDArray[Any]) -> list[Any]:
    return [[int(x) for x in row] for row in a] if a.ndim == 2 else [int(x) for x in a]


def _views_doc(lay: CacheLayout) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "name": v.name,
            "kind": v.kind.value,
            "shard": v.shard.value,
            "region": v.region,
            "addr": lay.view_addr(i),
            "offset": v.offset,
            "length": v.length,
            "stride": v.stride,
            "count": v.count,
        }
        for i, v in enumerate(lay.views)
    ]


def _bytes_per_block(src: SourcePlan, local_ppl: int) -> int:
    """Bytes read from ``src`` per local logical block: attention rows x ppl + state rows."""
    lens = src.local_rows[:, LEN].astype(np.int64)
    return int(lens[~src.row_is_state].sum()) * local_ppl + int(lens[src.row_is_state].sum())


def _source_doc(src: SourcePlan, local_ppl: int) -> dict[str, Any]:
    return {
        "rank": src.rank,
        "num_rows": src.num_rows,
        "num_local_descriptors": int(src.local_starts[-1]),
        "num_remote_descriptors": int(src.remote_starts[-1]),
        "bytes_per_block": _bytes_per_block(src, local_ppl),
        "row_view": _ints(src.row_view),
        "row_sub": _ints(src.row_sub),
        "row_is_state": [bool(x) for x in src.row_is_state],
        "local_rows": _ints(src.local_rows),
        "remote_rows": _ints(src.remote_rows),
    }


def _ids_bytes(src: SourcePlan, ids: SourceIds) -> int:
    """Bytes moved by ``ids``: the ``len`` of the local row each id falls in."""
    if ids.num_descriptors == 0:
        return 0
    rows = np.searchsorted(src.local_starts, ids.local_ids, side="right") - 1  # (n,) row of id
    return int(src.local_rows[rows, LEN].astype(np.int64).sum())


def _request_doc(peer: PeerPlan, req: RequestPlan) -> dict[str, Any]:
    sources = [
        {
            "rank": ids.rank,
            "num_descriptors": ids.num_descriptors,
            "num_runs": ids.num_runs,
            "num_bytes": _ids_bytes(src, ids),
            "local_ids": _ints(ids.local_ids),
            "remote_ids": _ints(ids.remote_ids),
        }
        for src, ids in zip(peer.sources, req.sources, strict=True)
    ]
    return {
        "num_descriptors": req.num_descriptors,
        "num_runs": req.num_runs,
        "num_bytes": sum(s["num_bytes"] for s in sources),
        "notify_only": list(req.notify_only),
        "sources": sources,
    }


def plan_document(
    inp: PlanInput, peer: PeerPlan, req: RequestPlan | None, *, request_only: bool = False
) -> dict[str, Any]:
    """The ``--json`` document (see ``docs/plan-input.md``); plain ints, lists and dicts."""
    request = None if req is None else _request_doc(peer, req)
    if request_only:
        return {"format": FORMAT, "request": request}
    local, tp = inp.local, peer.tp
    remote0 = next(iter(inp.remotes.values()))
    mode = "fan-out" if tp.is_fan_out else ("equal" if tp.ratio == 1 else "fan-in")
    return {
        "format": FORMAT,
        "local": {
            "tp_rank": local.tp_rank,
            "tp_size": local.tp_size,
            "block_size": local.block_size,
            "ppl": local.ppl,
            "num_logical_blocks": local.num_logical_blocks,
            "num_descriptors": local.num_descriptors,
            "views": _views_doc(local),
        },
        "remote": {
            "tp_size": remote0.tp_size,
            "ranks": list(inp.remotes),
            "block_size": remote0.block_size,
            "ppl": remote0.ppl,
            "num_logical_blocks": remote0.num_logical_blocks,
        },
        "pairing": {
            "mode": mode,
            "ratio": tp.ratio,
            "source_ranks": list(tp.source_ranks),
            "notify_only": list(tp.notify_only),
            "consumers_per_producer": tp.consumers_per_producer,
            "kernel_bsr": peer.kernel_bsr,
            "sources": [_source_doc(s, peer.local_ppl) for s in peer.sources],
        },
        "request": request,
    }


# --- tables ------------------------------------------------------------------------------


MAX_TABLE_VIEWS = 128  # views listed in the tables (--json lists every one)


def _print_tables(doc: dict[str, Any]) -> None:
    from kvxfer.bench.report import default_console, make_table

    con = default_console()
    if "local" in doc:
        loc, rem, pair = doc["local"], doc["remote"], doc["pairing"]
        con.print(
            make_table(
                f"local rank {loc['tp_rank']}/{loc['tp_size']}: {len(loc['views'])} views, "
                f"{loc['num_logical_blocks']} logical blocks, ppl {loc['ppl']}",
                ["#", "name", "kind", "shard", "region", "offset", "length", "stride", "count"],
                [
                    [
                        v["index"],
                        v["name"],
                        v["kind"],
                        v["shard"],
                        v["region"],
                        v["offset"],
                        v["length"],
                        v["stride"],
                        v["count"],
                    ]
                    for v in loc["views"][:MAX_TABLE_VIEWS]
                ],
                left=(1, 2, 3),
                markup=False,
            )
        )
        if len(loc["views"]) > MAX_TABLE_VIEWS:
            more = len(loc["views"]) - MAX_TABLE_VIEWS
            con.print(f"... {more} more views (--json lists every view)", markup=False)
        con.print(
            make_table(
                "pairing",
                ["field", "value"],
                [
                    ["mode", f"{pair['mode']} (ratio {pair['ratio']})"],
                    ["remote tp_size", rem["tp_size"]],
                    ["source ranks", ", ".join(map(str, pair["source_ranks"])) or "-"],
                    ["notify-only ranks", ", ".join(map(str, pair["notify_only"])) or "-"],
                    ["consumers per producer", pair["consumers_per_producer"]],
                    ["kernel block size ratio", pair["kernel_bsr"]],
                    ["ppl local / remote", f"{loc['ppl']} / {rem['ppl']}"],
                ],
                left=(0, 1),
                markup=False,
            )
        )
        con.print(
            make_table(
                "per source rank (whole pool)",
                ["rank", "strided rows", "local descs", "remote descs", "bytes/block"],
                [
                    [
                        s["rank"],
                        s["num_rows"],
                        s["num_local_descriptors"],
                        s["num_remote_descriptors"],
                        s["bytes_per_block"],
                    ]
                    for s in pair["sources"]
                ],
                markup=False,
            )
        )
    req = doc["request"]
    if req is not None:
        rows: list[list[object]] = [
            [s["rank"], s["num_descriptors"], s["num_bytes"], s["num_runs"]] for s in req["sources"]
        ]
        rows.append(["total", req["num_descriptors"], req["num_bytes"], req["num_runs"]])
        notify = ", ".join(map(str, req["notify_only"])) or "-"
        con.print(
            make_table(
                f"request (notify-only ranks: {notify})",
                ["rank", "descriptors", "bytes", "after merging runs"],
                rows,
                markup=False,
            )
        )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvxfer plan``; returns the exit code (2 on bad input)."""
    try:
        inp = read_plan_file(args.file)
        peer = pair_layouts(inp.local, inp.remotes)
        req = _plan_request(inp, peer)
        if args.request_only and req is None:
            raise LayoutError("request: missing field (--request-only needs a request)")
    except LayoutError as exc:  # IncompatibleError included
        print(f"kvxfer plan: error: {exc}", file=sys.stderr)
        return 2
    doc = plan_document(inp, peer, req, request_only=args.request_only)
    if args.json:
        from kvxfer.bench.report import dumps_json

        sys.stdout.write(dumps_json(doc) + "\n")
    else:
        _print_tables(doc)
    return 0
