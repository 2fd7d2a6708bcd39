"""A push the producer fails before it could load the consumer's agent (the consumer's
records could not be fetched: an advertised side-channel address the producer cannot
reach, a key or layout it refuses) cannot be announced with ``Failed``, which NIXL
sends only to a loaded agent. The producer remembers it, and the consumer's heartbeat
asks for its pushes still waiting (``GetPushStatus`` over the producer's side
channel), so the request ends FAILED with the producer's reason within a heartbeat or
two instead of at its deadline (review finding of stop 29: it waited its whole
deadline and ended TIMEOUT without the reason). Real NIXL and ZMQ in one process."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, allocate_cache
from kvxfer.layout.presets import spec_for
from kvxfer.testing import fill
from kvxfer.transport.side_client import fetch_push_failures
from kvxfer.wire import PushFailure
from tests.engines import free_port, until

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32
DEADLINE_S = 30.0


def _pair(fetch_timeout_s: float, key: bytes | None):  # type: ignore[no-untyped-def]
    """A producer whose fetch of consumer records gives up after ``fetch_timeout_s``, and
    a consumer that advertises a side-channel address nobody listens on (what the
    producer dials back in push mode): its push can never be announced."""
    spec = spec_for("tiny-gqa", num_blocks=16)
    bufs = allocate_cache(spec)
    fill(spec, bufs)
    local = allocate_cache(spec)
    prod = Producer(EngineConfig("p", model_name="tiny-gqa", auth_key=key,
                                 handshake_timeout_s=fetch_timeout_s), [(spec, bufs)])  # fmt: skip
    dead = f"tcp://127.0.0.1:{free_port()}"
    cons = Consumer(EngineConfig("d", model_name="tiny-gqa", auth_key=key, advertise_addr=dead,
                                 heartbeat_s=0.2, deadline_s=DEADLINE_S), [(spec, local)])  # fmt: skip
    return prod, cons, local, dead


@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "keyed"])
def test_a_push_the_producer_cannot_announce_fails_within_heartbeats(key: bytes | None) -> None:
    prod, cons, local, dead = _pair(0.5, key)
    with prod, cons:
        t0 = time.monotonic()
        t = cons.push("r", prod.address, local_block_ids=[1, 2], remote_block_ids=[3, 4])
        state = t.wait(10.0)
        took = time.monotonic() - t0
        print(
            f"[measure] unannounced push failure seen after {took:.2f} s (deadline {DEADLINE_S} s)"
        )
        assert state is RequestState.FAILED, (state, t.error)
        msg = str(t.error)
        assert dead in msg and "side channel" in msg, msg  # the producer's reason, and how
        assert not any(b.any() for b in local), "nothing may have been written"
        assert cons._inbox.num_forged == 0
        assert prod._pusher.num_failed == 1


def test_push_failures_are_obeyed_only_for_the_push_address_rank_and_generation() -> None:
    prod, cons, _, _ = _pair(20.0, None)  # the real failure comes long after this test
    with prod, cons:
        t = cons.push("r", prod.address, local_block_ids=[1], remote_block_ids=[3])
        assert until(lambda: t.poll() is RequestState.PENDING and t.posted_at, 5.0)
        gen = t.peer.generations[0]
        inbox = cons._inbox
        assert inbox.pending_pushes(prod.address) == (t.attempt,)
        assert inbox.pending_pushes("tcp://127.0.0.1:1") == ()

        def report(address: str = prod.address, **kw: object) -> int:
            fields = dict(request_id="r", attempt=t.attempt, generation=gen, producer_rank=0,
                          consumer_rank=0, reason="injected")  # fmt: skip
            fields.update(kw)
            return inbox.push_failed(address, (PushFailure(**fields),))  # type: ignore[arg-type]

        assert report(generation=gen ^ 1) == 0 and inbox.num_forged == 1  # another incarnation
        assert report(address="tcp://127.0.0.1:1") == 0  # another producer's word
        assert report(request_id="other") == 0
        assert report(attempt=t.attempt ^ 1) == 0
        assert report(producer_rank=1) == 0  # a rank this push never asked
        assert t.poll() is RequestState.PENDING  # none of those touched it
        assert report() == 1
        assert t.poll() is RequestState.FAILED and "injected" in str(t.error)


def test_a_server_without_pushes_answers_none_and_a_consumer_asks_nothing_idle() -> None:
    prod, cons, _, _ = _pair(0.5, None)
    with prod, cons:
        assert cons.server is not None  # (cons.address is the advertised, dead one)
        assert fetch_push_failures(cons.server.address, (1, 2, 3), 5.0) == ()  # no pusher
        assert fetch_push_failures(prod.address, (1, 2, 3), 5.0) == ()  # none failed
        assert cons._inbox.pending_pushes(prod.address) == ()
        np.testing.assert_equal(prod._pusher.failures((1,)), ())
