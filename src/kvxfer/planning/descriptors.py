"""Descriptor builders: views -> strided ``(N, 5)`` rows or dense ``(M, 3)`` rows (pure).

Row formats (all ``uint64``):

- strided: ``(N, 5)`` ``addr, len, dev, stride, count`` = ``count`` descriptors of ``len``
  bytes, ``stride`` apart, starting at ``addr`` (NIXL >= 1.5 prepares these directly);
- dense: ``(M, 3)`` ``addr, len, dev`` with ``M = sum(count)``.

Both share one index contract, view-major and block-minor::

    index(row v, block b) = starts[v] + b,   starts = [0, cumsum(count)...]

:func:`reference_rows` is the plain Python loop the field started from; it exists for
tests and as the benchmark baseline only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout, View

__all__ = [
    "ADDR",
    "COUNT",
    "DEV",
    "LEN",
    "STRIDE",
    "dense_rows",
    "layout_rows",
    "reference_rows",
    "row_starts",
    "strided_rows",
    "validate_rows",
    "view_rows",
]

ADDR, LEN, DEV, STRIDE, COUNT = range(5)
U64 = npt.NDArray[np.uint64]
_MANY_ROWS = 4096  # above this, expand with one fully vectorized pass instead of per row


def strided_rows(
    addrs: npt.ArrayLike,
    lengths: npt.ArrayLike,
    devs: npt.ArrayLike,
    strides: npt.ArrayLike,
    counts: npt.ArrayLike,
) -> U64:
    """Stack per-view columns (arrays or scalars, broadcast) into ``(N, 5) uint64`` rows."""
    cols = np.broadcast_arrays(
        *(np.asarray(c, dtype=np.uint64) for c in (addrs, lengths, devs, strides, counts))
    )
    rows = np.stack([np.atleast_1d(c) for c in cols], axis=1)  # (N, 5)
    return np.ascontiguousarray(rows, dtype=np.uint64)


def view_rows(layout: CacheLayout, views: Sequence[View]) -> U64:
    """``(N, 5)`` rows of ``views`` (of ``layout``'s regions), one per view, in order."""
    if not views:
        raise LayoutError("no views to build descriptors from")
    base = np.array([layout.regions[v.region].base_addr for v in views], dtype=np.uint64)
    dev = np.array([layout.regions[v.region].device_id for v in views], dtype=np.uint64)
    off = np.array([v.offset for v in views], dtype=np.uint64)
    return strided_rows(
        base + off,
        [v.length for v in views],
        dev,
        [v.stride for v in views],
        [v.count for v in views],
    )


def layout_rows(layout: CacheLayout) -> U64:
    """``(N, 5)`` strided rows of every view of ``layout`` (local side, whole pool).

    A copy of the layout's view table, built once when the layout was constructed.
    """
    return layout.view_table.copy()


def validate_rows(rows: np.ndarray, width: int = 5) -> U64:
    """Return ``rows`` if it is a C-contiguous ``(N, width) uint64`` array with N > 0.

    Raises:
        LayoutError: naming the shape, dtype or the first zero length / count.
    """
    if not isinstance(rows, np.ndarray) or rows.ndim != 2 or rows.shape[1] != width:
        shape = getattr(rows, "shape", type(rows).__name__)
        raise LayoutError(f"descriptor rows must have shape (N, {width}), got {shape}")
    if rows.dtype != np.uint64:
        raise LayoutError(f"descriptor rows must be uint64, got {rows.dtype}")
    if rows.shape[0] == 0:
        raise LayoutError("descriptor rows are empty")
    if not rows.flags.c_contiguous:
        raise LayoutError("descriptor rows must be C-contiguous")
    bad = np.flatnonzero(rows[:, LEN] == 0)
    if bad.size:
        raise LayoutError(f"descriptor row {int(bad[0])} has length 0")
    if width == 5:
        bad = np.flatnonzero(rows[:, COUNT] == 0)
        if bad.size:
            raise LayoutError(f"descriptor row {int(bad[0])} has count 0")
    return rows


def row_starts(rows: np.ndarray) -> npt.NDArray[np.int64]:
    """``(N + 1,) int64``: flat index of each row's block 0, then the total count."""
    starts = np.zeros(rows.shape[0] + 1, dtype=np.int64)
    np.cumsum(rows[:, COUNT], out=starts[1:])
    return starts


def dense_rows(rows: np.ndarray) -> U64:
    """Expand ``(N, 5)`` strided rows into ``(sum count, 3) uint64`` dense rows.

    Vectorized: no Python work per descriptor (one NumPy pass per row, or one pass in
    all for many short rows).
    """
    validate_rows(rows)
    counts = rows[:, COUNT].astype(np.int64)
    starts = row_starts(rows)
    total = int(starts[-1])
    out = np.empty((total, 3), dtype=np.uint64)
    if rows.shape[0] > _MANY_ROWS:
        row_of = np.repeat(np.arange(rows.shape[0]), counts)  # (M,) row of each descriptor
        block = np.arange(total, dtype=np.uint64) - starts[:-1][row_of].astype(np.uint64)
        out[:, 0] = rows[row_of, ADDR] + block * rows[row_of, STRIDE]
        out[:, 1] = rows[row_of, LEN]
        out[:, 2] = rows[row_of, DEV]
        return out
    ramp = np.arange(int(counts.max()), dtype=np.uint64)  # shared 0..max_count-1
    for i in range(rows.shape[0]):  # per view, not per descriptor
        s, e = int(starts[i]), int(starts[i + 1])
        col = out[s:e, 0]
        np.multiply(ramp[: e - s], rows[i, STRIDE], out=col)
        col += rows[i, ADDR]
        out[s:e, 1] = rows[i, LEN]
        out[s:e, 2] = rows[i, DEV]
    return out


def reference_rows(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """The baseline: a plain Python loop emitting one ``(addr, len, dev)`` tuple per block."""
    out: list[tuple[int, int, int]] = []
    for addr, length, dev, stride, count in rows.tolist():
        for b in range(count):
            out.append((addr + b * stride, length, dev))
    return out
