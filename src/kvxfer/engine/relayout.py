"""Re-lay-out of blocks received at a block-size ratio (consumer side, in place)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.layout.buffers import U8, attn_parts
from kvxfer.layout.model import TokenLayout
from kvxfer.layout.spec import LayoutSpec

__all__ = ["relayout_bsr"]


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
