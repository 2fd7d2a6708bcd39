"""Misuse and dead peers (issue 9, items 5, 7, 9): typed errors, no stuck requests.

Each test failed against the engine before attempt ids (see the commit message).
"""

from __future__ import annotations

import math
import time

import pytest

from kvxfer import errors
from kvxfer.engine.config import EngineConfig, RequestState
from kvxfer.errors import ConfigError
from kvxfer.wire import PushRequest, encode_msg
from tests.engines import local_pair

from .procs import MODEL, clear, free_port, ids, make_consumer, verify, wait_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_use_after_close(closing) -> None:  # type: ignore[no-untyped-def]
    """Item 5: live requests end ABORTED, new ones raise ClosedError, poll never KeyErrors."""
    cons, _ = make_consumer("tiny-gqa", 16, handshake_timeout_s=5.0)
    closing(cons)
    silent = f"tcp://127.0.0.1:{free_port()}"  # nobody answers: first contact stays pending
    t = cons.read("live", silent, local_block_ids=ids(0), remote_block_ids=ids(1))
    assert t.poll() is RequestState.PENDING
    cons.close()
    assert t.poll() is RequestState.ABORTED
    assert isinstance(t.error, errors.ClosedError)
    for start in (cons.read, cons.push):
        with pytest.raises(errors.ClosedError):
            start("new", silent, local_block_ids=ids(0), remote_block_ids=ids(1))
    assert issubclass(errors.ClosedError, errors.KvxferError)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0])
def test_float_inputs_are_validated(bad: float, closing) -> None:  # type: ignore[no-untyped-def]
    """Item 9: nan/inf/negative seconds are refused with a ValueError naming the field."""
    for name in ("deadline_s", "lease_s", "heartbeat_s", "handshake_timeout_s"):
        with pytest.raises(ValueError, match=name):
            EngineConfig("x", model_name=MODEL, **{name: bad}).check()
    cons, _ = make_consumer("tiny-gqa", 16)
    closing(cons)
    with pytest.raises(ValueError, match="deadline_s"):
        cons.read("r", "tcp://127.0.0.1:1", local_block_ids=ids(0), remote_block_ids=ids(1),
                  deadline_s=bad)  # fmt: skip
    if bad != 0.0:  # a zero wait is a plain poll
        t = cons.read("w", "tcp://127.0.0.1:1", local_block_ids=ids(0), remote_block_ids=ids(1))
        with pytest.raises(ValueError, match="timeout_s"):
            t.wait(bad)


def test_push_survives_a_bad_consumer_rank(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """Item 7: a PushRequest naming an unknown consumer rank fails alone; pushes go on."""
    a = spawn(engine_id="pa").start()
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0)
    closing(cons)
    t = cons.push("warm", a.address, local_block_ids=ids(0, 1), remote_block_ids=ids(5, 6))
    assert t.wait(20) is RequestState.DONE, t.error
    peer, backend = t.peer, cons.ranks[0].backend
    kw = {"attempt": 1, "budget_ms": 5000, "sent_at_ns": time.time_ns(),
          "consumer_generation": cons.generation}  # fmt: skip
    if "attempt" not in PushRequest.__struct_fields__:  # schema 1 (before the fix)
        kw = {}
    bad = PushRequest("bad", peer.generations[0], cons.address, 7, 8, (2,), (3,), **kw)
    backend.send_notif(peer.agents[0], encode_msg(bad))
    time.sleep(0.3)
    clear(ranks)
    t = cons.push("after", a.address, local_block_ids=ids(4, 5), remote_block_ids=ids(9, 10),
                  deadline_s=5.0)  # fmt: skip
    assert t.wait(10) is RequestState.DONE, (t.state, t.error)
    assert verify(ranks, a.remote_spec(), ids(4, 5), ids(9, 10)) == 0


def test_push_to_dead_producer_ends_peer_lost(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """Item 9: within the heartbeat window, not at the request's full deadline."""
    a = spawn(engine_id="pa").start()
    cons, _ = make_consumer("tiny-gqa", 64, handshake_timeout_s=1.0, heartbeat_s=0.3)
    closing(cons)
    t = cons.push("warm", a.address, local_block_ids=ids(0, 1), remote_block_ids=ids(5, 6))
    assert t.wait(20) is RequestState.DONE, t.error
    a.stop_process()  # it stops answering, then dies with the request in flight
    t = cons.push("lost", a.address, local_block_ids=ids(2, 3), remote_block_ids=ids(7, 8),
                  deadline_s=15.0)  # fmt: skip
    t.poll()
    a.kill()
    t0 = time.monotonic()
    wait_all([t], 16)
    elapsed = time.monotonic() - t0
    print(f"[measure] push to a dead producer: {t.state.value} after {elapsed:.2f} s ({t.error})")
    assert t.state is RequestState.PEER_LOST, (t.state, t.error)
    assert elapsed < 3.0


def test_a_request_id_past_the_wire_limit_is_refused_when_made() -> None:
    """An id the wire cannot carry (over MAX_REQUEST_ID_LEN) was accepted: encoding failed
    when the request posted, then again in its Abort, so the request ended FAILED without
    setting its end event or running its end callbacks (waiters slept until the
    deadline; found by a review). Now the id is refused by read, push and hold."""
    from kvxfer.wire import MAX_REQUEST_ID_LEN

    long_id = "r" * (MAX_REQUEST_ID_LEN + 1)
    with local_pair() as (_, _, prod, cons):
        for make in (cons.read, cons.push):
            with pytest.raises(ConfigError, match="request_id"):
                make(long_id, prod.address, local_block_ids=[0], remote_block_ids=[0])
        with pytest.raises(ConfigError, match="request_id"):
            prod.hold(long_id, 1)
        assert prod.num_held == 0
        ok = "r" * MAX_REQUEST_ID_LEN  # the limit itself is fine
        prod.hold(ok, 1, block_ids=[0])
        t = cons.read(ok, prod.address, local_block_ids=[0], remote_block_ids=[0])
        assert t.wait(10) is RequestState.DONE, t.error


def test_a_lease_past_an_hour_is_refused_and_holds_nothing() -> None:
    """hold(lease_s=1e300) overflowed after the tables, ticket book and slot words were
    written: OverflowError, and blocks held for ever (found by a review)."""
    with local_pair() as (_, _, prod, _):
        for bad in (1e300, 3600.5):
            with pytest.raises(ConfigError, match="lease_s"):
                prod.hold("x", 2, lease_s=bad)
        assert prod.num_held == 0 and prod.held_blocks == 0
        prod.hold("x", 2, lease_s=3600)
        assert prod.num_held == 1
    with pytest.raises(ConfigError, match="lease_s"):
        EngineConfig("p", lease_s=1e9).check()
