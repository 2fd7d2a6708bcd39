"""Pair a local layout with a remote engine's layouts: which bytes go where (pure).

:func:`pair_layouts` validates two sides, computes the TP plan and returns a
:class:`~kvxfer.planning.plans.PeerPlan`: per source rank, matched strided rows: local row ``j`` and remote row ``j`` describe the
same bytes (equal lengths), block by block. Request ids are mapped onto these rows by
:mod:`kvxfer.planning.request`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from kvxfer._intmath import exact_div
from kvxfer.errors import IncompatibleError, LayoutError
from kvxfer.layout.model import CacheLayout, Shard, TokenLayout, View
from kvxfer.planning.descriptors import ADDR, COUNT, LEN, STRIDE, U64, strided_rows
from kvxfer.planning.plans import PeerPlan, SourcePlan
from kvxfer.planning.tp import Source, TpPlan, plan_tp

__all__ = ["MAX_ROWS", "PeerPlan", "SourcePlan", "pair_layouts", "tp_plan_of", "with_run_rows"]

MAX_ROWS = 1 << 20  # strided rows per source: the wire's MAX_VIEWS (planning cannot import wire)


def _check_same(local: CacheLayout, remote: CacheLayout) -> None:
    for name in (
        "num_kv_heads",
        "head_dim",
        "dtype_bytes",
        "is_mla",
        "is_cross_layer",
        "token_layout",
    ):
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise IncompatibleError(f"{name} differs: local {a}, remote {b}")
    if len(local.views) != len(remote.views):
        raise IncompatibleError(
            f"view count differs: local {len(local.views)}, remote {len(remote.views)}"
        )
    diff = np.flatnonzero(local.view_classes != remote.view_classes)
    if diff.size:
        i = int(diff[0])
        a, b = local.views[i], remote.views[i]
        raise IncompatibleError(
            f"view {i} differs: local {a.kind.value}/{a.shard.value}, remote {b.kind.value}/{b.shard.value}"
        )


def _piece(
    src: Source,
    lv: View,
    rv: View,
    local: CacheLayout,
    remote: CacheLayout,
    plan: TpPlan,
    kbsr: int,
) -> tuple[int, int, int] | None:
    """``(local_offset, remote_offset, length)`` of one sub-block piece, or None if not read."""
    where = f"view {lv.name or '?'}"
    if lv.shard is Shard.SPLIT:
        if plan.is_fan_out:  # local page holds one slice per source
            n = exact_div(
                lv.length, src.num_split_slots, f"{where}: local state bytes over TP ratio"
            )
            if rv.length != n:
                raise IncompatibleError(f"{where}: remote state {rv.length} B != local slice {n} B")
            return src.split_slot * n, 0, n
        if rv.length != lv.length * max(1, src.num_split_slots):
            raise IncompatibleError(
                f"{where}: remote state {rv.length} B != local {lv.length} B x TP ratio {src.num_split_slots}"
            )
        return 0, src.split_slot * lv.length, lv.length
    sub = exact_div(lv.length, kbsr, f"{where}: local block bytes over block size ratio {kbsr}")
    if lv.shard is Shard.REPLICATED:
        if not src.reads_replicated:
            return None
        if rv.length != sub:
            raise IncompatibleError(
                f"{where}: remote block {rv.length} B != local sub-block {sub} B"
            )
        return 0, 0, sub
    if not src.reads_heads:
        return None
    if plan.is_fan_out:
        n = exact_div(
            sub, src.num_head_slots, f"{where}: local block bytes over {src.num_head_slots} sources"
        )
        if rv.length != n:
            raise IncompatibleError(f"{where}: remote block {rv.length} B != local piece {n} B")
        return src.head_slot * n, 0, n
    unit = exact_div(rv.length, remote.heads_per_rank, f"{where}: remote block bytes over heads")
    if sub != unit * local.heads_per_rank:
        raise IncompatibleError(
            f"{where}: local sub-block {sub} B != {local.heads_per_rank} heads x {unit} B per remote head"
        )
    off = src.head_offset * unit
    if off + sub > rv.length:
        raise LayoutError(
            f"{where}: head slice [{off}, {off + sub}) past remote block of {rv.length} B"
        )
    return 0, off, sub


def _check_sliceable(
    local: CacheLayout,
    remote: CacheLayout,
    lv: View,
    rv: View,
    piece: tuple[int, int, int],
    kbsr: int,
) -> None:
    """Head-sliced pieces are contiguous only with heads outermost (HND, not cross-layer)."""
    if lv.shard is not Shard.HEADS:
        return
    sliced = piece[2] * kbsr != lv.length or piece[2] != rv.length
    if not sliced:
        return
    if local.is_cross_layer:
        raise IncompatibleError(
            "heterogeneous TP needs per-layer views; cross-layer blocks cannot be head-sliced"
        )
    for side, lay in (("local", local), ("remote", remote)):
        if lay.token_layout is TokenLayout.NHD:
            raise IncompatibleError(
                f"{side} layout is NHD: heterogeneous TP head slices are not contiguous "
                "(use HND, or equal TP sizes)"
            )


def tp_plan_of(local: CacheLayout, remote_tp_size: int) -> TpPlan:
    """The TP plan of ``local`` reading an engine of ``remote_tp_size`` ranks: which remote
    ranks it reads (``source_ranks``) and which it only notifies."""
    shards = {v.shard for v in local.views}
    return plan_tp(
        local.tp_rank,
        local.tp_size,
        remote_tp_size,
        local.num_kv_heads,
        has_heads=Shard.HEADS in shards,
        has_replicated=Shard.REPLICATED in shards,
        has_split=Shard.SPLIT in shards,
    )


def pair_layouts(
    local: CacheLayout,
    remotes: Mapping[int, CacheLayout],
    *,
    max_run_blocks: int = 1,
    require_all: bool = True,
) -> PeerPlan:
    """Plan how ``local`` reads the remote engine whose rank layouts are ``remotes``.

    Args:
        local: this rank's layout.
        remotes: remote rank -> layout; must hold every source rank of the TP plan.
        max_run_blocks: longest run of blocks (contiguous on both sides) that one
            descriptor may carry; powers of two up to it get run rows (1: none). Run
            rows are free as strided rows; do not use them with dense (N, 3) lists.
        require_all: False plans only the source ranks present in ``remotes`` (a producer
            process pairing a consumer rank with the ranks it hosts, in push mode).

    Returns:
        The :class:`PeerPlan` with matched rows per source rank.

    Raises:
        LayoutError: missing or inconsistent remote records.
        IncompatibleError: the two sides cannot be paired (named numbers).
    """
    if not remotes:
        raise LayoutError("no remote records")
    first = next(iter(remotes.values()))
    for rank, lay in remotes.items():
        if lay.tp_rank != rank or lay.tp_size != first.tp_size:
            raise LayoutError(
                f"remote record for rank {rank} claims rank {lay.tp_rank}/{lay.tp_size}"
            )
        _check_same(first, lay)
        for name in ("block_size", "ppl", "num_logical_blocks", "token_layout"):
            a, b = getattr(first, name), getattr(lay, name)
            if a != b:  # ids are expanded and range-checked with one value for all ranks
                raise IncompatibleError(
                    f"remote ranks disagree on {name}: rank {first.tp_rank} {a}, rank {rank} {b}"
                )
    _check_same(local, first)
    kt_local, kt_remote = local.kernel_block_size, first.kernel_block_size
    if kt_local % kt_remote:
        raise IncompatibleError(
            f"local kernel block of {kt_local} tokens is not a multiple of remote {kt_remote} tokens"
        )
    kbsr = kt_local // kt_remote
    plan = tp_plan_of(local, first.tp_size)
    if kbsr > 1 and plan.is_fan_out:
        raise IncompatibleError(
            f"block size ratio {kbsr} with fan-out TP ({first.tp_size} -> {local.tp_size})"
        )
    if kbsr > 1 and local.is_cross_layer:
        raise IncompatibleError(
            f"block size ratio {kbsr} with cross-layer blocks (layers interleave)"
        )
    if kbsr > 1 and local.state_views:
        raise IncompatibleError(f"block size ratio {kbsr} with hybrid state views")
    num_rows = kbsr * len(local.attn_views)  # each ATTN view splits into kbsr sub-block rows
    if num_rows > MAX_ROWS:  # checked before any array of that size is made
        raise IncompatibleError(
            f"block size ratio {kbsr} x {len(local.attn_views)} attention views = {num_rows} "
            f"rows exceed the limit of {MAX_ROWS}"
        )
    sources = []
    for src in plan.sources:
        if src.rank not in remotes and not require_all:
            continue
        if src.rank not in remotes:
            raise LayoutError(f"no record for remote rank {src.rank} (have {sorted(remotes)})")
        remote = remotes[src.rank]
        same = plan.ratio == 1 and kbsr == 1 and _same_lengths(local, remote)
        base = (
            _whole_views(src, local, remote)
            if same
            else _source_plan(src, local, remote, plan, kbsr)
        )
        sources.append(with_run_rows(base, max_run_blocks))
    return PeerPlan(
        plan,
        tuple(sources),
        kbsr,
        local.ppl,
        first.ppl,
        local.num_logical_blocks,
        first.num_logical_blocks,
    )


def _same_lengths(local: CacheLayout, remote: CacheLayout) -> bool:
    """Equal TP, equal block bytes per view: every view is read whole (the common case)."""
    return bool(np.array_equal(local.view_table[:, LEN], remote.view_table[:, LEN]))


def _whole_views(src: Source, local: CacheLayout, remote: CacheLayout) -> SourcePlan:
    """Fast path of :func:`_source_plan` when nothing is sliced: rows = the view tables."""
    n = len(local.views)
    state = local.state_mask
    return SourcePlan(
        src.rank,
        local.view_table.copy(),
        remote.view_table.copy(),
        np.arange(n, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        state,
    )


def _view_columns(layout: CacheLayout) -> npt.NDArray[np.int64]:
    """``(V, 5) int64``: addr of block 0, length, device, stride, count of every view."""
    return layout.view_table.astype(np.int64)


def _source_plan(
    src: Source, local: CacheLayout, remote: CacheLayout, plan: TpPlan, kbsr: int
) -> SourcePlan:
    lcol, rcol = _view_columns(local), _view_columns(remote)  # (V, 5)
    # views of one shape pair identically: compute (and check) each distinct shape once
    keys = np.stack([lcol[:, LEN], lcol[:, STRIDE], local.view_classes, rcol[:, LEN]], axis=1)
    shapes, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    table = np.zeros((len(shapes), 4), dtype=np.int64)  # read?, local off, remote off, len
    for u, i in enumerate(first.tolist()):
        lv, rv = local.views[i], remote.views[i]
        piece = _piece(src, lv, rv, local, remote, plan, kbsr)
        if piece is not None:
            _check_sliceable(local, remote, lv, rv, piece, kbsr)
            table[u] = (1, *piece)
    per_view = table[inverse.ravel()]  # (V, 4)
    idx = np.flatnonzero(per_view[:, 0])  # views read from this source
    if not idx.size:
        raise LayoutError(f"source rank {src.rank} reads no view")
    lcol, rcol, pc = lcol[idx], rcol[idx], per_view[idx, 1:]  # (S, 5), (S, 5), (S, 3)
    is_state = local.state_mask[idx]
    nsub = np.where(is_state, 1, kbsr)  # ATTN views split into kbsr sub-block rows
    rep = np.repeat(np.arange(idx.size), nsub)  # (R,) selected view of each row
    sub = np.arange(rep.size) - np.repeat(np.cumsum(nsub) - nsub, nsub)  # (R,) k of each row
    sub_len = np.where(is_state, 0, lcol[:, 1] // kbsr)[rep]
    local_rows = strided_rows(
        lcol[rep, 0] + sub * sub_len + pc[rep, 0],
        pc[rep, 2],
        lcol[rep, 2],
        lcol[rep, 3],
        lcol[rep, 4],
    )
    remote_rows = strided_rows(
        rcol[rep, 0] + pc[rep, 1], pc[rep, 2], rcol[rep, 2], rcol[rep, 3], rcol[rep, 4]
    )
    return SourcePlan(src.rank, local_rows, remote_rows, idx[rep], sub, is_state[rep])


def with_run_rows(src: SourcePlan, max_run_blocks: int) -> SourcePlan:
    """Return ``src`` with run rows of ``2**k <= max_run_blocks`` blocks for dense rows.

    NIXL refuses strided rows whose descriptors overlap (``stride < len``), so a level
    ``k`` is ``w = 2**k`` non-overlapping rows, one per phase ``p < w``: descriptor ``i``
    of row ``(k, p)`` covers blocks ``p + i*w .. p + i*w + w - 1`` (``len * w`` bytes,
    stride ``stride * w``). A run starting at block ``b`` uses phase ``b % w``, index
    ``b // w``. Rows per dense base row: ``2 * max_run_blocks - 1``. A level is built
    only where both sides hold ``2*w - 1`` blocks, so every phase row exists on both.
    """
    if max_run_blocks < 1:
        raise LayoutError(f"max_run_blocks must be >= 1, got {max_run_blocks}")
    loc, rem = src.local_rows, src.remote_rows
    dense = (loc[:, STRIDE] == loc[:, LEN]) & (rem[:, STRIDE] == rem[:, LEN])
    counts = np.minimum(loc[:, COUNT], rem[:, COUNT]).astype(np.int64)
    max_level = max_run_blocks.bit_length() - 1
    width = 1 << max_level
    run_rows = np.full((src.num_rows, max_level + 1, width), -1, dtype=np.int64)
    run_rows[:, 0, 0] = np.arange(src.num_rows)
    extra_l: list[U64] = []
    extra_r: list[U64] = []
    extra_j: list[npt.NDArray[np.int64]] = []
    next_row = src.num_rows
    for k in range(1, max_level + 1):
        w = 1 << k
        js = np.flatnonzero(dense & (counts >= 2 * w - 1))  # every phase has >= 1 descriptor
        if not js.size:
            break
        for p in range(w):
            for rows, out in ((loc, extra_l), (rem, extra_r)):
                wide = rows[js].copy()  # (n, 5)
                wide[:, ADDR] += np.uint64(p) * wide[:, LEN]
                wide[:, COUNT] = (wide[:, COUNT] - np.uint64(p)) // np.uint64(w)
                wide[:, LEN] *= np.uint64(w)
                wide[:, STRIDE] *= np.uint64(w)
                out.append(wide)
            run_rows[js, k, p] = next_row + np.arange(js.size)
            next_row += js.size
            extra_j.append(js)
    if not extra_j:
        return src
    js = np.concatenate(extra_j)
    return SourcePlan(
        src.rank,
        np.ascontiguousarray(np.vstack([loc, *extra_l])),
        np.ascontiguousarray(np.vstack([rem, *extra_r])),
        np.concatenate([src.row_view, src.row_view[js]]),
        np.concatenate([src.row_sub, src.row_sub[js]]),
        np.concatenate([src.row_is_state, src.row_is_state[js]]),
        src.num_rows,
        run_rows,
    )
