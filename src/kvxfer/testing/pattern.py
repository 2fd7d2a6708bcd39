"""Byte patterns that encode what every cache byte means, and their verification (pure).

The producer's cache is filled so that each byte is a hash of its meaning:
attention bytes of ``(layer, K|V, kernel block, global head, token, byte)`` and
state bytes of ``(state layer, part, block, global column, byte)``. A consumer that
received a request computes, from the request's block ids alone, which producer
byte should sit at each of its positions, and compares every byte.

The views below interpret raw region buffers (``uint8`` arrays) with NumPy strides
according to a :class:`~kvxfer.layout.spec.LayoutSpec`; they are independent of the
descriptor planner so that they can check it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.layout.buffers import AttnPart, StatePart, attn_parts, state_parts
from kvxfer.layout.spec import AttnKind, LayoutSpec

__all__ = [
    "AttnPart",
    "StatePart",
    "attn_parts",
    "fill",
    "mismatches",
    "state_parts",
]

U8 = npt.NDArray[np.uint8]


def _mix(*coords: npt.ArrayLike) -> U8:
    """A byte hash of broadcast coordinate arrays (splitmix-style, low byte)."""
    x: npt.NDArray[np.uint64] = np.full(1, 0x9E3779B97F4A7C15, dtype=np.uint64)
    for i, c in enumerate(coords):
        x = (x ^ (np.asarray(c, dtype=np.uint64) + np.uint64(i + 1))) * np.uint64(
            0xBF58476D1CE4E5B9
        )
        x = x ^ (x >> np.uint64(29))
    x = x * np.uint64(0x94D049BB133111EB)
    return ((x >> np.uint64(32)) & np.uint64(0xFF)).astype(np.uint8)


def _attn_value(
    spec: LayoutSpec, p: AttnPart, blocks: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64]
) -> U8:
    """Pattern of part ``p`` at kernel ``blocks`` (N,) and ``tokens`` (N,): ``(N, h, d)``."""
    n, h, d = blocks.size, p.array.shape[1], p.array.shape[3]
    first_head = (
        0 if spec.kind is AttnKind.MLA else spec.tp_rank * spec.num_kv_heads // spec.tp_size
    )
    u = np.uint64
    head = (first_head + np.arange(h, dtype=u)).reshape(1, h, 1)  # global head index
    byte = np.arange(d, dtype=u).reshape(1, 1, d)
    b, t = blocks.astype(u).reshape(n, 1, 1), tokens.astype(u).reshape(n, 1, 1)
    return _mix(u(p.layer), u(p.kv), b, head, t, byte)


def _state_value(spec: LayoutSpec, p: StatePart, blocks: npt.NDArray[np.int64]) -> U8:
    """Pattern of state part ``p`` at logical ``blocks`` (N,): ``(N, rows, row_bytes)``."""
    n, rows, rb = blocks.size, p.array.shape[1], p.array.shape[2]
    u = np.uint64
    row = (spec.tp_rank * rows + np.arange(rows, dtype=u)).reshape(1, rows, 1)  # global row
    b = blocks.astype(u).reshape(n, 1, 1)
    return _mix(u(1000 + p.layer), u(p.part), b, row, np.arange(rb, dtype=u).reshape(1, 1, rb))


def fill(
    spec: LayoutSpec, bufs: Sequence[U8], state_block_ids: npt.ArrayLike | None = None
) -> None:
    """Write the pattern into every attention byte of ``bufs``, then into state pages.

    In a hybrid pool attention blocks and state pages share memory; a block is used by
    one or the other. ``state_block_ids`` (default: all) says which pages get the state
    pattern; it overwrites the attention pattern there.
    """
    for p in attn_parts(spec, bufs):
        nk, h, kt, d = p.array.shape
        blocks, tokens = np.repeat(np.arange(nk), kt), np.tile(np.arange(kt), nk)
        val = _attn_value(spec, p, blocks, tokens)  # (nk*kt, h, d)
        p.array[...] = val.reshape(nk, kt, h, d).transpose(0, 2, 1, 3)
    for s in state_parts(spec, bufs):
        ids = (
            np.arange(s.array.shape[0])
            if state_block_ids is None
            else np.asarray(state_block_ids, np.int64)
        )
        s.array[ids] = _state_value(spec, s, ids)


def mismatches(
    local: LayoutSpec,
    local_bufs: Sequence[U8],
    remote: LayoutSpec,
    local_ids: npt.ArrayLike,
    remote_ids: npt.ArrayLike,
    *,
    local_state_ids: npt.ArrayLike | None = None,
    remote_state_ids: npt.ArrayLike | None = None,
    num_cached_blocks: int = 0,
) -> int:
    """Count local bytes of a received request that differ from the producer's pattern.

    ``remote`` is the spec of any producer rank (its rank is irrelevant: heads and
    state rows are checked by global index). Tokens past the remote request's end in
    the last local block are not checked.
    """
    lids, rids = np.asarray(local_ids, np.int64), np.asarray(remote_ids, np.int64)
    bad = 0
    kt_l, kt_r = local.block_size // local.ppl, remote.block_size // remote.ppl
    n_tok = rids.size * remote.block_size
    skip = num_cached_blocks * local.block_size
    # every local kernel token position of the request -> request token g -> remote kernel coords
    g = (
        np.arange(lids.size)[:, None] * local.block_size + np.arange(local.block_size)[None, :]
    ).ravel()
    lkb = (lids[:, None] * local.ppl + np.arange(local.block_size)[None, :] // kt_l).ravel()
    ltok = np.tile(np.arange(local.block_size) % kt_l, lids.size)
    ok = (g < n_tok) & (g >= skip)
    g, lkb, ltok = g[ok], lkb[ok], ltok[ok]
    rkb = rids[g // remote.block_size] * remote.ppl + (g % remote.block_size) // kt_r
    rtok = (g % remote.block_size) % kt_r
    for p in attn_parts(local, local_bufs):
        got = p.array[lkb, :, ltok, :]  # (G, h, d)
        want = _attn_value(local, p, rkb, rtok)  # local rank's global heads at remote coords
        bad += int(np.count_nonzero(got != want))
    ls = lids if local_state_ids is None else np.asarray(local_state_ids, np.int64)
    rs = rids if remote_state_ids is None else np.asarray(remote_state_ids, np.int64)
    for s in state_parts(local, local_bufs):
        bad += int(np.count_nonzero(s.array[ls] != _state_value(local, s, rs)))
    return bad
