"""NumPy views of raw region buffers by meaning (pure): which bytes are which layer's
K, V, latent or state part, according to a :class:`~kvxfer.layout.spec.LayoutSpec`.

They interpret ``uint8`` region buffers with NumPy strides, independently of the
descriptor planner, so the test oracle (:mod:`kvxfer.testing.pattern`) can check the
planner and the engine can re-lay-out received blocks (:mod:`kvxfer.engine.relayout`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxfer.layout.model import TokenLayout
from kvxfer.layout.spec import AttnKind, LayoutSpec

__all__ = ["AttnPart", "StatePart", "attn_parts", "host_view", "state_parts"]

U8 = npt.NDArray[np.uint8]


def host_view(addr: int, nbytes: int) -> U8:
    """A ``uint8`` array over ``nbytes`` of host memory at ``addr`` (no copy; the caller
    keeps the memory alive)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


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
