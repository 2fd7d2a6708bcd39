"""Test seam: allocate caches in NumPy and move bytes by memmove along the planned descriptors.

This is a fake transport for unit tests of the pure planner only; real transfers are
tested with NIXL between processes in tests/integration.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxfer.engine.relayout import relayout_bsr
from kvxfer.layout.model import CacheLayout
from kvxfer.layout.spec import LayoutSpec
from kvxfer.planning.descriptors import dense_rows
from kvxfer.planning.pairing import PeerPlan, pair_layouts
from kvxfer.planning.request import RequestPlan, plan_request
from kvxfer.testing.pattern import fill, mismatches


@dataclass
class Cache:
    spec: LayoutSpec
    bufs: list[np.ndarray]
    layout: CacheLayout


def alloc(spec: LayoutSpec, pattern: bool = False, state_ids: object = None) -> Cache:
    bufs = [np.zeros(n, dtype=np.uint8) for n in spec.region_bytes()]
    if pattern:
        fill(spec, bufs, state_ids)  # type: ignore[arg-type]
    return Cache(spec, bufs, spec.build([b.ctypes.data for b in bufs]))


def inside(rows3: np.ndarray, layout: CacheLayout) -> bool:
    """Every (addr, len) row lies inside one region of ``layout``."""
    base = np.array([r.base_addr for r in layout.regions], dtype=np.uint64)
    end = base + np.array([r.num_bytes for r in layout.regions], dtype=np.uint64)
    a, n = rows3[:, 0][:, None], rows3[:, 1][:, None]
    return bool(((a >= base) & (a + n <= end)).any(axis=1).all())


def transfer(peer: PeerPlan, req: RequestPlan, local: Cache, remotes: dict[int, Cache]) -> int:
    """memmove every planned descriptor; returns bytes moved."""
    moved = 0
    for src, ids in zip(peer.sources, req.sources, strict=True):
        lrows, rrows = dense_rows(src.local_rows), dense_rows(src.remote_rows)
        assert inside(lrows, local.layout) and inside(rrows, remotes[src.rank].layout)
        lsel, rsel = lrows[ids.local_ids], rrows[ids.remote_ids]
        assert np.array_equal(lsel[:, 1], rsel[:, 1]), "local/remote lengths differ"
        for (la, n, _), (ra, _, _) in zip(lsel.tolist(), rsel.tolist(), strict=True):
            ctypes.memmove(la, ra, n)
            moved += n
    return moved


def run_case(
    local_spec: LayoutSpec,
    remote_spec: LayoutSpec,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    **kw: object,
) -> tuple[int, RequestPlan, PeerPlan]:
    """Move one request from a pattern-filled remote engine; return (bad bytes, plan, peer)."""
    local = alloc(local_spec)
    state_ids = kw.get("remote_state_ids")
    remotes = {
        r: alloc(remote_spec.with_rank(r), True, state_ids) for r in range(remote_spec.tp_size)
    }
    runs = int(kw.pop("max_run_blocks", 1))  # type: ignore[call-overload]
    peer = pair_layouts(
        local.layout, {r: c.layout for r, c in remotes.items()}, max_run_blocks=runs
    )
    req = plan_request(peer, local_ids, remote_ids, **kw)  # type: ignore[arg-type]
    transfer(peer, req, local, remotes)
    relayout_bsr(local_spec, local.bufs, local_ids, peer.kernel_bsr)
    bad = mismatches(local_spec, local.bufs, remote_spec, local_ids, remote_ids, **kw)  # type: ignore[arg-type]
    return bad, req, peer
