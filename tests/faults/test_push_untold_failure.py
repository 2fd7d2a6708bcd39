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
        now = time.perf_counter()
        assert inbox.pending_pushes(prod.address, now) == (t.attempt,)
        assert inbox.pending_pushes(prod.address, t.posted_at) == ()  # not posted before
        assert inbox.pending_pushes("tcp://127.0.0.1:1", now) == ()

        def report(address: str = prod.address, **kw: object) -> int:
            fields = dict(request_id="r", attempt=t.attempt, generation=gen, producer_rank=0,
                          consumer_rank=0, reason="injected")  # fmt: skip
            fields.update(kw)
            return inbox.push_failed(address, (PushFailure(**fields),))  # type: ignore[arg-type]

        assert report(generation=gen ^ 1) == 0 and inbox.num_forged == 1  # another incarnation
        assert report(address="tcp://127.0.0.1:1") == 0  # another producer's word
        assert report(request_id="other") == 0
        assert report(attempt=t.attempt ^ 1) == 0
        assert report(producer_rank=1) == 0  # a rank this producer does not have
        assert report(consumer_rank=1) == 0  # a pair this push never asked
        assert t.poll() is RequestState.PENDING  # none of those touched it
        assert report() == 1
        assert t.poll() is RequestState.FAILED and "injected" in str(t.error)
        assert inbox.pending_pushes(prod.address, time.perf_counter()) == ()  # settled


def test_a_server_without_pushes_answers_none_and_an_older_one_is_asked_once() -> None:
    prod, cons, _, _ = _pair(0.5, None)
    with prod, cons:
        assert cons.server is not None  # (cons.address is the advertised, dead one)
        rejected = prod.server.num_rejected
        assert fetch_push_failures(cons.server.address, (1, 2, 3), 5.0) == ()  # no pusher
        assert fetch_push_failures(prod.address, (1, 2, 3), 5.0) == ()  # none failed
        assert prod.server.num_rejected == rejected  # understood, not refused
        assert prod._pusher.failures((1,)) == ()
        # an older producer refuses the question as malformed: None, and the heartbeat
        # does not ask it again while it runs the same generations
        srv, real = prod.server, prod.server._answer
        srv._answer = lambda body: (  # type: ignore[method-assign]
            srv._reject("expected GetRecords") if b"gps" in body else real(body)
        )
        assert fetch_push_failures(prod.address, (1,), 5.0) is None
        t = cons.push("r", prod.address, local_block_ids=[1], remote_block_ids=[3])
        assert until(lambda: t.poll() and prod.address in cons._monitor._no_push_status, 5.0)
        asked = srv.num_rejected
        time.sleep(1.0)  # five more heartbeats
        assert srv.num_rejected == asked


def test_a_failure_told_over_nixl_is_not_kept_for_the_side_channel() -> None:
    """A push failing once its consumer's agent is loaded goes out as Failed (over NIXL)
    and is not remembered for GetPushStatus."""
    from tests.engines import local_pair

    with local_pair() as (_, _, prod, cons):
        prod.hold("h", block_ids=[5])
        t = cons.push("h", prod.address, local_block_ids=[1], remote_block_ids=[6])
        assert t.wait(10.0) is RequestState.FAILED
        assert "not held" in str(t.error) and "side channel" not in str(t.error), t.error
        assert prod._pusher._untold == {}


def test_a_push_failed_by_one_rank_is_still_asked_about_for_the_others() -> None:
    """The first failure ends the request FAILED, but its blocks stay quarantined until
    every producer rank settled: the heartbeat keeps asking for the ranks left."""
    specs = [spec_for("tiny-gqa", tp_rank=r, tp_size=2, num_blocks=16) for r in (0, 1)]
    ranks = [(s, allocate_cache(s)) for s in specs]
    spec = spec_for("tiny-gqa", num_blocks=16)
    dead = f"tcp://127.0.0.1:{free_port()}"
    with (
        Producer(EngineConfig("p2", model_name="tiny-gqa", handshake_timeout_s=20.0), ranks) as prod,
        Consumer(EngineConfig("d1", model_name="tiny-gqa", advertise_addr=dead, heartbeat_s=0.2),
                 [(spec, allocate_cache(spec))]) as cons,
    ):  # fmt: skip
        t = cons.push("r", prod.address, local_block_ids=[1], remote_block_ids=[3])
        assert until(lambda: t.poll() is RequestState.PENDING and len(t.expected) == 2, 5.0)
        inbox, gens = cons._inbox, t.peer.generations
        fails = [PushFailure("r", t.attempt, gens[r], r, 0, f"rank {r}") for r in (0, 1)]
        assert inbox.push_failed(prod.address, fails[:1]) == 1
        assert t.poll() is RequestState.FAILED and "rank 0" in str(t.error)
        assert inbox.pending_pushes(prod.address, time.perf_counter()) == (t.attempt,)
        assert inbox.push_failed(prod.address, fails[1:]) == 1
        assert inbox.pending_pushes(prod.address, time.perf_counter()) == ()
