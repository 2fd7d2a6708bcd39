"""A request that passes its deadline says where it stood: in which phase of first contact
with which producer, or how long its READ had been in flight. The vLLM connector logs this
error, and a TIMEOUT that names no phase cannot be diagnosed afterwards."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zmq

from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, allocate_cache
from kvxfer.errors import DeadlineError
from kvxfer.layout.presets import spec_for
from kvxfer.testing import MemoryBackend
from kvxfer.transport.backend import XferState

pytestmark = pytest.mark.timeout(60)


def _consumer(name: str, factory: Any = MemoryBackend, **kw: Any) -> Consumer:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    cfg = EngineConfig(name, model_name="tiny-gqa", **kw)
    return Consumer(cfg, [(spec, allocate_cache(spec))], backend_factory=factory)


def test_a_producer_that_never_answers_the_handshake_names_the_fetch_phase() -> None:
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts the connection, never replies
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    try:
        with _consumer("dw1", handshake_timeout_s=20.0) as cons:
            t = cons.read("r", address, local_block_ids=np.array([1]),
                          remote_block_ids=np.array([2]), deadline_s=0.5)  # fmt: skip
            assert t.wait(10) is RequestState.TIMEOUT
            assert isinstance(t.error, DeadlineError)
            msg = str(t.error)
            assert "first contact" in msg and address in msg and "fetch" in msg, msg
            assert "READ" not in msg, msg
    finally:
        silent.close(0)


class _StuckReads(MemoryBackend):
    """Posts that never complete: the READ stays in flight until it is released."""

    def post(self, xfer: Any) -> XferState:
        return XferState.IN_PROGRESS

    def poll(self, xfer: Any) -> XferState:
        xfer._check_live()
        return XferState.IN_PROGRESS


def test_a_read_that_never_completes_says_how_long_it_was_in_flight() -> None:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    cfg = EngineConfig("dwp", model_name="tiny-gqa")
    with (
        Producer(cfg, [(spec, allocate_cache(spec))], backend_factory=MemoryBackend) as prod,
        _consumer("dw2", _StuckReads) as cons,
    ):
        prod.hold("r", block_ids=[2, 3])
        t = cons.read("r", prod.address, local_block_ids=np.array([1, 4]),
                      remote_block_ids=np.array([2, 3]), deadline_s=0.8)  # fmt: skip
        assert t.wait(10) is RequestState.TIMEOUT
        msg = str(t.error)
        assert "READ" in msg and prod.address in msg and "in flight" in msg, msg
        assert "first contact" not in msg, msg
        # "posted 0.7x s before": a number, and not more than the deadline
        seconds = float(msg.split("posted ")[1].split(" s")[0])
        assert 0.0 < seconds <= 0.8, msg
