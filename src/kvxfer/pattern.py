"""Byte patterns that encode what every cache byte means, and their verification (pure).

The producer's cache is filled so that each byte is a hash of its meaning:
attention bytes of ``(layer, K|V, kernel block, global head, token, byte)`` and
state bytes of ``(state layer, part, block, global column, byte)``. A consumer that
received a request computes, from the request's block ids alone, which producer
byte should sit at each of its positions, and compares every byte.

The views below interpret raw region buffers (``uint8`` arrays) with NumPy strides
according to a :class:`~kvxfer.spec.LayoutSpec`; they are independent of the
descriptor planner so that they can check it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .layout import TokenLayout
from .spec import AttnKind, LayoutSpec

__all__ = [
    "AttnPart",
    "StatePart",
    "attn_parts",
    "fill",
    "mismatches",
    "relayout_bsr",
    "state_parts",
]

U8 = npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class AttnPart:
    """Attention bytes of one layer's K (kv=0), V (kv=1) or MLA latent (kv=0).

    ``array``: ``(kernel_blocks, heads_local, kernel_tokens, head_bytes)`` uint8 view.
    """

    layer: int
    kv: int
    array: U8


@dataclass(frozen=True, slots=True)
class StatePart:
    """One state sub-projection (part j < n) or the SSM state (part n) of one state layer.

    ``array``: ``(logical_blocks, rows, row_bytes)`` uint8 view; rows are global-column
    sharded: global row = ``tp_rank * rows + r``.
    """

    layer: int
    part: int
    array: U8


def _view(buf: U8, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> U8:
    return np.lib.stride_tricks.as_strided(buf[offset:], shape=shape, strides=strides)


def attn_parts(spec: LayoutSpec, bufs: Sequence[U8]) -> list[AttnPart]:
    """Interpret ``bufs`` (one uint8 array per region) as attention parts of ``spec``."""
    h, d = spec.heads_per_rank, spec.head_dim * spec.dtype_bytes
    kt, nk, kb = spec.block_size // spec.ppl, spec.num_blocks * spec.ppl, spec.kernel_block_bytes
    nhd = spec.token_layout is TokenLayout.NHD
    # byte strides of (head, token) inside one K/V block: HND [h, kt, d] or NHD [kt, h, d]
    hs, ts = (d, h * d) if nhd else (kt * d, d)
    out: list[AttnPart] = []
    for layer in range(spec.num_layers):
        for kv in (0,) if spec.kind is AttnKind.MLA else (0, 1):
            if spec.kind is AttnKind.SPLIT_KV:
                buf, off, bstride, hs2, ts2 = bufs[2 * layer + kv], 0, kb, hs, ts
            elif spec.kind is AttnKind.BLOCKS_FIRST:
                buf, off, bstride, hs2, ts2 = bufs[layer], kv * kb, 2 * kb, hs, ts
            elif spec.kind is AttnKind.PACKED:  # [NB, H, T, 2D] (NHD: [NB, T, H, 2D])
                hs2, ts2 = (2 * d, 2 * h * d) if nhd else (2 * kt * d, 2 * d)
                buf, off, bstride = bufs[layer], kv * d, 2 * kb
            elif spec.kind is AttnKind.MLA:  # [NB, T, D]
                buf, off, bstride, hs2, ts2 = bufs[layer], 0, kb, 0, d
            else:  # CROSS_LAYER [NB, L, 2, H, T, D]
                buf, off = bufs[0], (2 * layer + kv) * kb
                bstride, hs2, ts2 = 2 * kb * spec.num_layers, hs, ts
            out.append(AttnPart(layer, kv, _view(buf, off, (nk, h, kt, d), (bstride, hs2, ts2, 1))))
    return out


def state_parts(spec: LayoutSpec, bufs: Sequence[U8]) -> list[StatePart]:
    """Interpret ``bufs`` as the state parts of a hybrid/state ``spec`` (empty without state)."""
    st = spec.state
    if st is None:
        return []
    e, t = spec.dtype_bytes, spec.tp_size
    page = spec.page_bytes if spec.num_layers else st.page_bytes(t, e)
    out: list[StatePart] = []
    for layer in range(st.num_layers):
        off = 0
        for j, cols in enumerate(st.conv_cols):  # dim-first conv: [cols, kernel-1] per part
            rows, row_bytes = cols // t, (st.conv_kernel - 1) * e
            out.append(
                StatePart(
                    layer,
                    j,
                    _view(
                        bufs[layer], off, (spec.num_blocks, rows, row_bytes), (page, row_bytes, 1)
                    ),
                )
            )
            off += rows * row_bytes
        ssm = st.ssm_bytes // t
        out.append(
            StatePart(
                layer,
                len(st.conv_cols),
                _view(bufs[layer], off, (spec.num_blocks, ssm, 1), (page, 1, 1)),
            )
        )
    return out


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


def relayout_bsr(spec: LayoutSpec, bufs: Sequence[U8], local_ids: npt.ArrayLike, bsr: int) -> None:
    """Re-lay-out received kernel blocks holding ``bsr`` remote blocks back to back.

    After a read at block size ratio ``bsr`` a local HND kernel block holds
    ``[bsr, h, kt/bsr, d]``; this permutes it in place to ``[h, kt, d]`` (NHD needs nothing).
    ``local_ids`` are logical ids; all their kernel blocks are re-laid-out.
    """
    if bsr == 1 or spec.token_layout is TokenLayout.NHD:
        return
    kids = (np.asarray(local_ids, dtype=np.int64)[:, None] * spec.ppl + np.arange(spec.ppl)).ravel()
    for p in attn_parts(spec, bufs):
        _, h, kt, d = p.array.shape
        blk = p.array[kids]  # (B, h, kt, d) gathered copy, read as raw [bsr, h, kt/bsr, d]
        raw = np.ascontiguousarray(blk).reshape(len(kids), bsr, h, kt // bsr, d)
        p.array[kids] = raw.transpose(0, 2, 1, 3, 4).reshape(len(kids), h, kt, d)


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
