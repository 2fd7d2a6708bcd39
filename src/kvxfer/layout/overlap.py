"""Do two views of one region share a byte? Exact checks for strided views (pure).

A view is ``count`` blocks ``[offset + b*stride, offset + b*stride + length)``. Views of
the same kind in the same region must never share a byte, or one request writes the
same local bytes twice (a V view lying over its K view, a state page larger than its
page). Views of different kinds may share bytes by design: in a hybrid pool a block is
either an attention block or a state page.

Views of one stride are checked exactly in ``O(n log n)``: each view's block
(wrapped modulo the stride) is an arc ``[r, r + length)`` over a range of block
indices, and two views collide iff both their arcs and their block ranges intersect.
Views of different strides are checked pairwise where their spans meet (a bounded
number of pairs); two interleaved views of different strides are refused.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

from kvxfer.errors import LayoutError

__all__ = ["MAX_PAIR_CHECKS", "check_views_disjoint", "views_overlap"]

MAX_PAIR_CHECKS = 1 << 16  # pairs of views of different strides whose spans meet


class _ViewLike(Protocol):
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def stride(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def name(self) -> str: ...


def views_overlap(a: _ViewLike, b: _ViewLike) -> bool:
    """True if some block of ``a`` and some block of ``b`` share a byte (same region).

    Exact when the strides are equal or one view has a single block; otherwise a view
    pair whose spans meet counts as overlapping (refused as unverifiable).
    """
    if a.count == 1 and b.count == 1:
        return a.offset < b.offset + b.length and b.offset < a.offset + a.length
    s = b.stride if a.count == 1 else a.stride
    if a.count > 1 and b.count > 1 and a.stride != b.stride:
        return _span(a)[0] < _span(b)[1] and _span(b)[0] < _span(a)[1]
    # block i of a meets block j of b iff -len_b < d + k*s < len_a, k = j - i
    d = b.offset - a.offset
    k_lo = max((-b.length - d) // s + 1, -(a.count - 1))
    k_hi = min(-((d - a.length) // s) - 1, b.count - 1)
    return k_lo <= k_hi


def _span(v: _ViewLike) -> tuple[int, int]:
    return v.offset, v.offset + (v.count - 1) * v.stride + v.length


def _arcs(i: int, v: _ViewLike) -> list[tuple[int, int, int, int, int]]:
    """``(arc_start, arc_end, first_block, end_block, view)`` pieces within ``[0, stride)``."""
    s = v.stride
    q, r = divmod(v.offset, s)
    if r + v.length <= s:
        return [(r, r + v.length, q, q + v.count, i)]
    return [(r, s, q, q + v.count, i), (0, r + v.length - s, q + 1, q + v.count + 1, i)]


def _check_same_stride(region: int, views: Sequence[_ViewLike], idx: list[int]) -> None:
    arcs = sorted(a for i in idx for a in _arcs(i, views[i]))
    # active arcs (their arc still covers the sweep point), keyed by block range start;
    # their block ranges are pairwise disjoint, or a collision was already raised
    starts: list[tuple[int, int, int]] = []  # (first_block, end_block, view), sorted
    ends: list[tuple[int, tuple[int, int, int]]] = []  # heap of (arc_end, entry)
    for a0, a1, b0, b1, i in arcs:
        while ends and ends[0][0] <= a0:
            _, entry = heapq.heappop(ends)
            del starts[bisect.bisect_left(starts, entry)]
        entry = (b0, b1, i)
        pos = bisect.bisect_left(starts, entry)
        for other in starts[max(pos - 1, 0) : pos + 1]:
            if other[0] < b1 and b0 < other[1] and other[2] != i:
                _raise(region, views, other[2], i)
        starts.insert(pos, entry)
        heapq.heappush(ends, (a1, entry))


def _raise(region: int, views: Sequence[_ViewLike], i: int, j: int) -> None:
    i, j = min(i, j), max(i, j)
    a, b = views[i], views[j]
    raise LayoutError(
        f"views {i} ({a.name}) and {j} ({b.name}) of region {region} overlap: offset/length/"
        f"stride/count {a.offset}/{a.length}/{a.stride}/{a.count} and "
        f"{b.offset}/{b.length}/{b.stride}/{b.count} share bytes"
    )


def check_views_disjoint(region: int, views: Sequence[_ViewLike], idx: Sequence[int]) -> None:
    """Raise LayoutError naming two views of ``idx`` (one region, one kind) that overlap."""
    by_stride: dict[int, list[int]] = defaultdict(list)
    singles: list[int] = []
    for i in idx:
        (by_stride[views[i].stride] if views[i].count > 1 else singles).append(i)
    for group in by_stride.values():
        _check_same_stride(region, views, group)
    # across stride groups and single blocks: pairs whose spans meet, bounded
    groups = [*by_stride.values(), *([i] for i in singles)]
    bounds = [
        (min(_span(views[i])[0] for i in g), max(_span(views[i])[1] for i in g)) for g in groups
    ]
    order = sorted(range(len(groups)), key=lambda g: bounds[g][0])
    checks = 0
    active: list[int] = []
    for g in order:
        active = [h for h in active if bounds[h][1] > bounds[g][0]]
        for h in active:
            for i in groups[g]:
                for j in groups[h]:
                    checks += 1
                    if checks > MAX_PAIR_CHECKS:
                        raise LayoutError(
                            f"region {region}: more than {MAX_PAIR_CHECKS} pairs of views of "
                            "different strides interleave; cannot verify they are disjoint"
                        )
                    if views_overlap(views[i], views[j]):
                        _raise(region, views, i, j)
        active.append(g)
