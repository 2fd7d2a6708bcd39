"""A RankCache built with a backend factory: a TP1 -> TP2 request planned by the real
planner moves through kvxfer.testing.MemoryBackend and every byte matches the oracle;
the same request through NIXL (the default backend) lands the same bytes."""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest

from kvxfer.engine.config import EngineConfig, allocate_cache
from kvxfer.engine.rank import RankCache
from kvxfer.layout.presets import spec_for
from kvxfer.planning.pairing import pair_layouts
from kvxfer.planning.request import plan_request
from kvxfer.testing import MemoryBackend, fill, mismatches
from kvxfer.transport.backend import BackendFactory, XferOp, XferState

_names = itertools.count()


def _move(factory: BackendFactory | None) -> tuple[int, list[np.ndarray]]:
    cfg = EngineConfig("t")
    p_spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    d_spec = spec_for("tiny-gqa", tp_rank=1, tp_size=2, num_blocks=8)
    p_bufs, d_bufs = allocate_cache(p_spec), allocate_cache(d_spec)
    fill(p_spec, p_bufs)
    n = next(_names)
    prod = RankCache(p_spec, p_bufs, f"rank-p-{n}", cfg, backend_factory=factory)
    cons = RankCache(d_spec, d_bufs, f"rank-d-{n}", cfg, backend_factory=factory)
    try:
        agent = cons.backend.add_remote(prod.backend.metadata())
        peer = pair_layouts(cons.layout, {0: prod.layout})
        (src,) = peer.sources
        loc = cons.backend.prepare(src.local_rows)
        rem = cons.backend.prepare(src.remote_rows, agent)
        lids, rids = [5, 0, 3], [2, 7, 1]
        (ids,) = plan_request(peer, lids, rids).sources
        x = cons.backend.make_xfer(XferOp.READ, loc, ids.local_ids, rem, ids.remote_ids, b"ok")
        state = cons.backend.post(x)
        while state is XferState.IN_PROGRESS:
            state = cons.backend.poll(x)
        cons.backend.release(x)
        return mismatches(d_spec, d_bufs, p_spec, lids, rids), [b.copy() for b in d_bufs]
    finally:
        cons.close()
        prod.close()


def test_memory_backend_factory_moves_a_planned_request() -> None:
    bad, bufs = _move(MemoryBackend)
    assert bad == 0
    assert sum(int(np.count_nonzero(b)) for b in bufs) > 0  # something landed


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None, reason="no NIXL")
def test_memory_and_nixl_ranks_land_the_same_bytes() -> None:
    (bad_m, mem), (bad_n, nixl) = _move(MemoryBackend), _move(None)
    assert bad_m == bad_n == 0
    for a, b in zip(mem, nixl, strict=True):
        np.testing.assert_array_equal(a, b)
