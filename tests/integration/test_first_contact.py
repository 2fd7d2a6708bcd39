"""First contact is lazy and never blocks requests to producers already known."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer.engine.config import EngineConfig, RequestState, allocate_cache
from kvxfer.engine.consumer import Consumer
from kvxfer.engine.producer import Producer
from kvxfer.layout.presets import spec_for
from kvxfer.testing.pattern import fill, mismatches

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def test_slow_first_contact_does_not_block_known_peer() -> None:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=32)
    bufs = allocate_cache(spec)
    fill(spec, bufs)
    local = allocate_cache(spec)
    with (
        Producer(EngineConfig("p", model_name="tiny-gqa"), [(spec, bufs)]) as prod,
        Consumer(
            EngineConfig("d", model_name="tiny-gqa", handshake_timeout_s=3.0), [(spec, local)]
        ) as cons,
    ):
        cons.connect(prod.address)
        # nobody listens here: its first contact runs in the background until its timeout
        stuck = cons.read("x", "tcp://127.0.0.1:9", local_block_ids=[0], remote_block_ids=[0])
        t0 = time.monotonic()
        lids, rids = np.array([5, 6, 7]), np.array([9, 1, 4])
        ok = cons.read("r", prod.address, local_block_ids=lids, remote_block_ids=rids)
        assert ok.wait(10) is RequestState.DONE
        took = time.monotonic() - t0
        assert stuck.poll() is RequestState.PENDING  # still waiting for its handshake
        assert took < 1.0, f"a known peer's request waited {took:.2f} s behind a first contact"
        assert mismatches(spec, local, spec, lids, rids) == 0
        assert stuck.wait(10) is RequestState.PEER_LOST  # side channel never answered
        assert "no reply within timeout" in str(stuck.error)


def test_refused_pairing_leaves_no_agent_behind() -> None:
    """Block size ratio with fan-out TP is refused before any NIXL state is created."""
    from kvxfer.errors import IncompatibleError

    p_specs = [
        spec_for("tiny-gqa", tp_rank=r, tp_size=2, num_blocks=16, block_size=8) for r in range(2)
    ]
    d_spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16, block_size=16)
    with (
        Producer(
            EngineConfig("p", model_name="tiny-gqa"), [(s, allocate_cache(s)) for s in p_specs]
        ) as prod,
        Consumer(
            EngineConfig("d", model_name="tiny-gqa"), [(d_spec, allocate_cache(d_spec))]
        ) as cons,
    ):
        t = cons.read("r", prod.address, local_block_ids=[1], remote_block_ids=[2, 3])
        assert t.wait(10) is RequestState.FAILED
        assert isinstance(t.error, IncompatibleError)
        assert "block size ratio 2 with fan-out TP" in str(t.error)
        assert cons.ranks[0].backend._remotes == set()  # no remote agent was added
        assert prod.held_blocks == 0
