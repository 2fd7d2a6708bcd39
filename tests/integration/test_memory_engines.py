"""The engines over the in-memory backend (a test seam users can put under their own
tests): the same producer/consumer code moves verified bytes without NIXL agents."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, allocate_cache
from kvxfer.layout.presets import spec_for
from kvxfer.testing import MemoryBackend, fill, mismatches

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("consumer_tp", [1, 2])
def test_engines_move_verified_bytes_over_the_memory_backend(consumer_tp: int) -> None:
    p_spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    p_bufs = allocate_cache(p_spec)
    fill(p_spec, p_bufs)
    d = [(s, allocate_cache(s)) for s in
         (spec_for("tiny-gqa", tp_rank=r, tp_size=consumer_tp, num_blocks=16) for r in range(consumer_tp))]  # fmt: skip
    with (
        Producer(EngineConfig("mp", model_name="tiny-gqa"), [(p_spec, p_bufs)], backend_factory=MemoryBackend) as prod,
        Consumer(EngineConfig("md", model_name="tiny-gqa"), d, backend_factory=MemoryBackend) as cons,
    ):  # fmt: skip
        assert all(
            isinstance(r.backend, MemoryBackend) for r in [*prod.ranks, *cons.ranks.values()]
        )
        prod.hold("r", block_ids=[9, 2, 5])
        lids, rids = np.array([1, 3, 4]), np.array([9, 2, 5])
        t = cons.read("r", prod.address, local_block_ids=lids, remote_block_ids=rids)
        assert t.wait(10) is RequestState.DONE
        for spec, bufs in d:
            assert mismatches(spec, bufs, p_spec, lids, rids) == 0
