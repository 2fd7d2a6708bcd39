"""A request's transfer plan: block ids -> descriptor indices per source rank (pure).

Given a :class:`~kvxfer.planning.pairing.PeerPlan` and one request's logical block ids on both
sides, :func:`plan_request` returns, per source rank, equal-length ``int64`` arrays of
local and remote descriptor indices into the prepared lists built from the
source's rows. No Python work per descriptor.

Id expansion rules:

- ATTN rows count kernel blocks: logical id ``L`` expands to ``L*ppl .. L*ppl+ppl-1``
  with the *owning side's* ppl.
- block size ratio ``kbsr``: local kernel block ``i`` (of the request) receives remote
  kernel blocks ``i*kbsr + k`` in its sub-block ``k``; the remote list may end inside
  the last local block (clipped).
- prefix hit: the first ``num_cached_blocks`` local logical blocks (and the remote
  kernel blocks that would fill them) are skipped.
- STATE rows map logical ids one to one (``local_state_ids[i] <-> remote_state_ids[i]``).

:class:`RequestIds` carries one request's ids (the arguments of :func:`plan_request`
after the peer) as one value; ``RequestIds.of(...).plan(peer)`` is ``plan_request(peer, ...)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import LayoutError
from kvxfer.planning.descriptors import LEN, STRIDE
from kvxfer.planning.plans import PeerPlan, SourcePlan

__all__ = ["RequestIds", "RequestPlan", "SourceIds", "expand_ids", "plan_request"]

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]  # descriptor indices, as NIXL takes them
INT32_LIMIT = 1 << 31  # NIXL's descriptor indices are int32: every index must be below this


@dataclass(frozen=True, slots=True, eq=False)
class SourceIds:
    """Descriptor indices of one request for one source rank (equal lengths, view-major).

    ``local_ids`` and ``remote_ids`` are ``(M,) int32`` (NIXL's index type).
    """

    rank: int
    local_ids: I32
    remote_ids: I32
    count_runs: int | Callable[[], int] = 0  # an int, or a (cached) function computing it
    num_block_descriptors: int = -1  # one per block before run rows were used

    def __post_init__(self) -> None:
        if self.num_block_descriptors < 0:
            object.__setattr__(self, "num_block_descriptors", int(self.local_ids.size))

    @property
    def num_runs(self) -> int:
        """Descriptors left if every run contiguous on both sides merged into one.

        Computed on first use (it is reporting, not on the transfer path).
        """
        c = self.count_runs
        return c if isinstance(c, int) else c()

    @property
    def num_descriptors(self) -> int:
        return int(self.local_ids.size)


@dataclass(frozen=True, slots=True, eq=False)
class RequestPlan:
    """Per-source descriptor ids of one request, plus the ranks only to be notified."""

    sources: tuple[SourceIds, ...]
    notify_only: tuple[int, ...]

    @property
    def num_descriptors(self) -> int:
        return sum(s.num_descriptors for s in self.sources)

    @property
    def num_runs(self) -> int:
        return sum(s.num_runs for s in self.sources)

    @property
    def num_block_descriptors(self) -> int:
        return sum(s.num_block_descriptors for s in self.sources)


def _int64(ids: npt.ArrayLike) -> I64:
    """``ids`` as an int64 array where that loses nothing (signed integers, or empty);
    anything else is kept as given, so that :func:`plan_request` refuses it (floats,
    bools, strings) or converts it (unsigned) exactly as it does for a caller's ids."""
    arr = np.asarray(ids)
    if arr.dtype.kind == "i" or arr.size == 0:
        return arr.astype(np.int64, copy=False)
    return arr


@dataclass(frozen=True, slots=True, eq=False)
class RequestIds:
    """One request's logical block ids, as one value (what an engine keeps per request).

    ``local`` and ``remote`` are the attention block ids of each side in token order;
    ``local_state`` and ``remote_state`` the state block ids of hybrid / state models
    (None: none named; :func:`plan_request` says when that is allowed);
    ``num_cached_blocks`` the leading local blocks already
    present (prefix hit). Nothing is validated here: :meth:`plan` hands the ids to
    :func:`plan_request`, the one place that validates them (against a peer's pools).
    """

    local: I64
    remote: I64
    local_state: I64 | None = None
    remote_state: I64 | None = None
    num_cached_blocks: int = 0

    @classmethod
    def of(
        cls,
        local: npt.ArrayLike,
        remote: npt.ArrayLike,
        *,
        local_state: npt.ArrayLike | None = None,
        remote_state: npt.ArrayLike | None = None,
        num_cached_blocks: int = 0,
    ) -> RequestIds:
        """Arrays from a caller's ids (lists, tuples, arrays): int64 where lossless.

        Ids that are not signed integers (floats, bools, strings, unsigned) are kept
        as given, so that :meth:`plan` refuses or converts them as :func:`plan_request`
        does; a silent int64 cast would truncate ``1.5`` to block 1.
        """
        return cls(
            _int64(local),
            _int64(remote),
            None if local_state is None else _int64(local_state),
            None if remote_state is None else _int64(remote_state),
            num_cached_blocks,
        )

    def plan(self, peer: PeerPlan) -> RequestPlan:
        """``plan_request(peer, ...)`` with these ids (raises what it raises)."""
        return plan_request(
            peer,
            self.local,
            self.remote,
            local_state_ids=self.local_state,
            remote_state_ids=self.remote_state,
            num_cached_blocks=self.num_cached_blocks,
        )


def _as_ids(ids: npt.ArrayLike, num_blocks: int, what: str) -> I64:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise LayoutError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise LayoutError(f"{what} must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise LayoutError(f"{what}: block id {bad} out of range [0, {num_blocks})")
    return arr


def _check_unique(ids: I64, what: str) -> None:
    """Refuse a block given twice: two sources would write the same local bytes."""
    if ids.size < 2:
        return
    s = np.sort(ids)
    dup = np.flatnonzero(s[1:] == s[:-1])
    if dup.size:
        raise LayoutError(
            f"{what}: block {int(s[dup[0]])} given twice (each local block receives one source)"
        )


def _check_int32(src: SourcePlan, lk: I64, rk: I64, ls: I64, rs: I64) -> None:
    """Refuse indices past NIXL's int32 range instead of letting the cast wrap them."""
    for side, starts, k, s in (
        ("local", src.local_starts, lk, ls),
        ("remote", src.remote_starts, rk, rs),
    ):
        if int(starts[-1]) <= INT32_LIMIT:
            continue  # the whole prepared list fits: no index can wrap
        n = src.num_base_rows
        attn = starts[:n][~src.row_is_state[:n]]
        state = starts[:n][src.row_is_state[:n]]
        hi = max(
            int(attn.max()) + int(k.max()) if attn.size and k.size else -1,
            int(state.max()) + int(s.max()) if state.size and s.size else -1,
        )
        if hi >= INT32_LIMIT:
            raise LayoutError(
                f"source rank {src.rank}: {side} descriptor index {hi} does not fit NIXL's int32 "
                f"indices (prepared list of {int(starts[-1])} descriptors; at most 2**31)"
            )


def expand_ids(logical_ids: I64, ppl: int) -> I64:
    """Kernel block ids of ``logical_ids``: ``(N,) -> (N * ppl,)``, ``L*ppl + j``."""
    return (logical_ids[:, None] * ppl + np.arange(ppl, dtype=np.int64)[None, :]).ravel()


def _count_runs(
    src: SourcePlan, rows: I64, local: npt.NDArray[Any], remote: npt.NDArray[Any]
) -> int:
    """Descriptors after merging neighbours contiguous in memory on both sides."""
    if local.size == 0:
        return 0
    dense = (src.local_rows[:, STRIDE] == src.local_rows[:, LEN]) & (
        src.remote_rows[:, STRIDE] == src.remote_rows[:, LEN]
    )
    joins = (
        (rows[1:] == rows[:-1]) & (np.diff(local) == 1) & (np.diff(remote) == 1) & dense[rows[1:]]
    )
    return int(local.size - np.count_nonzero(joins))


def _coalesce(
    src: SourcePlan, rows: I64, local: npt.NDArray[Any], remote: npt.NDArray[Any]
) -> tuple[I32, I32]:
    """Replace runs of blocks contiguous on both sides by run-row descriptors.

    A run of ``n`` blocks of base row ``j`` becomes ``n >> L`` descriptors of ``2**L``
    blocks (``L`` = the row's top run level) plus one per set bit of the remainder,
    largest first. Order stays view-major. ``(N,) -> (M,)`` with ``M <= N``.
    """
    top = (src.run_rows[:, :, 0] >= 0).sum(axis=1) - 1  # (B,) top run level of each base row
    if local.size < 2 or not top.any():
        return local.astype(np.int32), remote.astype(np.int32)
    local, remote = local.astype(np.int64), remote.astype(np.int64)
    joins = (
        (rows[1:] == rows[:-1])
        & (np.diff(local) == 1)
        & (np.diff(remote) == 1)
        & (top[rows[1:]] > 0)
    )
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))  # first element of each run
    lengths = np.diff(np.append(starts, local.size))
    lvl_top = top[rows[starts]]
    width = np.int64(1) << lvl_top
    q, rem = lengths >> lvl_top, lengths & (width - 1)
    # q full-width pieces per run, at start + i * width
    first = np.cumsum(q) - q
    i = np.arange(int(q.sum()), dtype=np.int64) - np.repeat(first, q)
    pos = [np.repeat(starts, q) + i * np.repeat(width, q)]
    lvl = [np.repeat(lvl_top, q)]
    for k in range(int(top.max()), -1, -1):  # remainder bits, largest piece first
        has = ((rem >> k) & 1).astype(bool)
        pos.append((starts + q * width + ((rem >> (k + 1)) << (k + 1)))[has])
        lvl.append(np.full(int(has.sum()), k, dtype=np.int64))
    p, lv = np.concatenate(pos), np.concatenate(lvl)
    order = np.argsort(p, kind="stable")
    p, lv = p[order], lv[order]
    base, w = rows[p], np.int64(1) << lv
    bl = local[p] - src.local_starts[base]  # block index within the base row, each side
    br = remote[p] - src.remote_starts[base]
    # phase rows: block b at level k sits in row (k, b % w) at index b // w
    new_local = src.local_starts[src.run_rows[base, lv, bl % w]] + bl // w
    new_remote = src.remote_starts[src.run_rows[base, lv, br % w]] + br // w
    for side, idx in (("local", new_local), ("remote", new_remote)):
        if idx.size and int(idx.max()) >= INT32_LIMIT:  # run rows sit past the base rows
            raise LayoutError(
                f"source rank {src.rank}: {side} run descriptor index {int(idx.max())} does "
                "not fit NIXL's int32 indices"
            )
    return new_local.astype(np.int32), new_remote.astype(np.int32)


def _source_ids(src: SourcePlan, lk: I64, rk: I64, ls: I64, rs: I64, kbsr: int) -> SourceIds:
    base_rows = np.arange(src.num_rows) < src.num_base_rows
    attn = np.flatnonzero(~src.row_is_state & base_rows)
    state = np.flatnonzero(src.row_is_state & base_rows)
    parts_l, parts_r, parts_row = [], [], []
    if attn.size and lk.size and kbsr == 1 and rk.size == lk.size:  # common case: no clip
        # int32: what NIXL takes (prepared lists never exceed 2**31 - 1 descriptors)
        i32 = np.int32
        parts_l.append((src.local_starts[attn].astype(i32)[:, None] + lk.astype(i32)).ravel())
        parts_r.append((src.remote_starts[attn].astype(i32)[:, None] + rk.astype(i32)).ravel())
        parts_row.append(np.broadcast_to(attn[:, None], (attn.size, lk.size)))  # raveled lazily
    elif attn.size and lk.size:
        # (Ra, N): row j, local kernel position i -> remote position i*kbsr + sub[j]
        pos = np.arange(lk.size, dtype=np.int64)[None, :] * kbsr + src.row_sub[attn][:, None]
        keep = pos < rk.size
        loc = src.local_starts[attn][:, None] + lk[None, :]
        rem = src.remote_starts[attn][:, None] + rk[np.minimum(pos, rk.size - 1)]
        parts_l.append(loc[keep])
        parts_r.append(rem[keep])
        parts_row.append(np.broadcast_to(attn[:, None], keep.shape)[keep])
    if state.size and ls.size:
        parts_l.append((src.local_starts[state][:, None] + ls[None, :]).ravel())
        parts_r.append((src.remote_starts[state][:, None] + rs[None, :]).ravel())
        parts_row.append(np.repeat(state, ls.size))
    if not parts_l:
        empty = np.zeros(0, dtype=np.int32)
        return SourceIds(src.rank, empty, empty, 0)
    local, remote = (
        (p[0] if len(p) == 1 else np.concatenate(p)).astype(np.int32, copy=False)
        for p in (parts_l, parts_r)
    )

    @functools.cache
    def rows() -> I64:  # base row of each descriptor; only for run merging and reporting
        return np.concatenate([r.ravel() for r in parts_row])

    block_local, block_remote = local, remote  # one descriptor per block
    runs = functools.cache(lambda: _count_runs(src, rows(), block_local, block_remote))
    if src.run_rows.shape[1] > 1 and (src.run_rows[:, 1:, 0] >= 0).any():
        merged_local, merged_remote = _coalesce(src, rows(), local, remote)
        return SourceIds(src.rank, merged_local, merged_remote, runs, int(local.size))
    return SourceIds(src.rank, local, remote, runs, int(local.size))


MAX_REQUEST_DESCRIPTORS = 1 << 24  # per source rank: ~16.8 M, 200+ MB of ids to build


def _check_size(src: SourcePlan, num_kernel_ids: int, num_state_ids: int) -> None:
    """Refuse a request whose descriptors (rows x ids) would pass the limit, before any
    array is built: a small plan file or a peer's record can name billions."""
    is_state = src.row_is_state[: src.num_base_rows]  # base rows first, run rows after
    num_state = int(np.count_nonzero(is_state))
    num_attn = is_state.size - num_state
    total = num_attn * num_kernel_ids + num_state * num_state_ids
    if total > MAX_REQUEST_DESCRIPTORS:
        raise LayoutError(
            f"source rank {src.rank}: a request of {total} descriptors ({num_attn} rows x "
            f"{num_kernel_ids} kernel blocks, {num_state} state rows x {num_state_ids}) is "
            f"past the limit of {MAX_REQUEST_DESCRIPTORS}"
        )


def _check_hybrid_ids(
    lids: np.ndarray,
    rids: np.ndarray,
    ls: np.ndarray,
    rs: np.ndarray,
    local_state_ids: object,
    remote_state_ids: object,
) -> None:
    """A hybrid pool (attention and state layers in one region) holds an attention page
    or a state page in a logical block, never both, in the same bytes: a request names
    its state blocks, apart from its attention blocks, on both sides."""  # fmt: skip
    if local_state_ids is None or remote_state_ids is None:
        raise LayoutError(
            "a hybrid layout (attention and state pages in one pool) needs local_state_ids "
            "and remote_state_ids: a block holds an attention page or a state page, never both"
        )
    for side, attn, state in (("local", lids, ls), ("remote", rids, rs)):
        both = np.intersect1d(attn, state)
        if both.size:
            raise LayoutError(
                f"{side} block {int(both[0])} is given as an attention block and as a state "
                "block: in a hybrid pool both pages would share its bytes"
            )


def plan_request(
    peer: PeerPlan,
    local_block_ids: npt.ArrayLike,
    remote_block_ids: npt.ArrayLike,
    *,
    local_state_ids: npt.ArrayLike | None = None,
    remote_state_ids: npt.ArrayLike | None = None,
    num_cached_blocks: int = 0,
) -> RequestPlan:
    """Map one request's logical block ids to descriptor indices for every source rank.

    Args:
        peer: the pairing of this rank with the remote engine.
        local_block_ids, remote_block_ids: logical attention block ids on each side.
        local_state_ids, remote_state_ids: logical state block ids: required, and apart
            from the attention ids, where attention and state share the pool (hybrid
            models); in a pool of state pages only they default to the block ids.
        num_cached_blocks: leading local logical blocks already present (prefix hit).

    Raises:
        LayoutError: ids out of range, not 1-D, or lengths that do not pair; a local
            block (or local state block) given twice (remote ids may repeat: reading one
            remote block into two local blocks writes every local byte once); a hybrid
            request without state ids, or with a block that is both an attention and a
            state block on one side; a descriptor index past NIXL's int32 range.
    """
    lids = _as_ids(local_block_ids, peer.local_num_blocks, "local_block_ids")
    _check_unique(lids, "local_block_ids")
    rids = _as_ids(remote_block_ids, peer.remote_num_blocks, "remote_block_ids")
    if not 0 <= num_cached_blocks <= lids.size:
        raise LayoutError(f"num_cached_blocks {num_cached_blocks} not in [0, {lids.size}]")
    for side, ids, ppl in (("local", lids, peer.local_ppl), ("remote", rids, peer.remote_ppl)):
        if ids.size * ppl > MAX_REQUEST_DESCRIPTORS:  # before expanding them
            raise LayoutError(
                f"{side}_block_ids: {ids.size} blocks of {ppl} kernel blocks are "
                f"{ids.size * ppl} kernel blocks, past the limit of {MAX_REQUEST_DESCRIPTORS}"
            )
    lk = expand_ids(lids[num_cached_blocks:], peer.local_ppl)
    rk = expand_ids(rids, peer.remote_ppl)[num_cached_blocks * peer.local_ppl * peer.kernel_bsr :]
    kbsr = peer.kernel_bsr
    # the remote request may end inside the last local logical block
    if not (lk.size - peer.local_ppl) * kbsr < rk.size <= lk.size * kbsr and (lk.size or rk.size):
        raise LayoutError(
            f"{lk.size} local kernel blocks (after {num_cached_blocks} cached) cannot hold "
            f"{rk.size} remote kernel blocks at block size ratio {kbsr}"
        )
    ls = (
        lids
        if local_state_ids is None
        else _as_ids(local_state_ids, peer.local_num_blocks, "local_state_ids")
    )
    rs = (
        rids
        if remote_state_ids is None
        else _as_ids(remote_state_ids, peer.remote_num_blocks, "remote_state_ids")
    )
    if local_state_ids is not None:
        _check_unique(ls, "local_state_ids")
    has_state = any(bool(s.row_is_state.any()) for s in peer.sources)
    if has_state and any(not bool(s.row_is_state.all()) for s in peer.sources):
        _check_hybrid_ids(lids, rids, ls, rs, local_state_ids, remote_state_ids)
    if has_state and ls.size != rs.size:
        raise LayoutError(f"state ids differ in length: local {ls.size}, remote {rs.size}")
    for s in peer.sources:
        _check_size(s, lk.size, ls.size if has_state else 0)
        _check_int32(s, lk, rk, ls, rs)
    return RequestPlan(
        tuple(_source_ids(s, lk, rk, ls, rs, kbsr) for s in peer.sources), peer.notify_only
    )
