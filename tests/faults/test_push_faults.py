"""Push mode under a stalled producer (issue 9, items 1 and 2).

A push that ended TIMEOUT on the consumer must never be written afterwards, and a retry
with the same request id must never be completed by the first attempt's WriteDone.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from kvxfer.engine.config import RequestState
from kvxfer.wire import PushRequest, encode_msg

from .procs import clear, free_port, ids, make_consumer, verify, wait_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

DEADLINE_S = 1.0


def _landed(ranks, lids) -> int:  # type: ignore[no-untyped-def]
    """Nonzero bytes in local blocks ``lids`` (split K/V regions; zeroed before use)."""
    out = 0
    for s, bufs in ranks:
        n = s.kernel_block_bytes
        for buf in bufs:
            out += sum(int(np.count_nonzero(buf[i * n : (i + 1) * n])) for i in lids)
    return out


def _warm(cons, a, ranks) -> None:  # type: ignore[no-untyped-def]
    t = cons.push("warm", a.address, local_block_ids=ids(0, 1), remote_block_ids=ids(5, 6))
    assert t.wait(20) is RequestState.DONE, t.error  # both sides connected
    assert verify(ranks, a.remote_spec(), ids(0, 1), ids(5, 6)) == 0
    clear(ranks)


def test_push_after_timeout_never_lands(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """Item 1: a TIMEOUT push is not written after SIGCONT; the producer confirms."""
    a = spawn(engine_id="pa", num_blocks=256).start()
    cons, ranks = make_consumer("tiny-gqa", 256, handshake_timeout_s=2.0)
    closing(cons)
    _warm(cons, a, ranks)
    lids, rids = np.arange(10, 138), np.arange(0, 128)
    a.stop_process()
    try:
        t = cons.push("late", a.address, local_block_ids=lids, remote_block_ids=rids,
                      deadline_s=DEADLINE_S)  # fmt: skip
        wait_all([t], DEADLINE_S + 5)
        assert t.state is RequestState.TIMEOUT, (t.state, t.error)
        assert t.quarantined  # the producer has not confirmed: blocks not reusable yet
    finally:
        a.signal(signal.SIGCONT)
    time.sleep(1.0)  # a write started after the deadline would land now
    landed = _landed(ranks, lids)
    print(f"[measure] bytes landed after TIMEOUT: {landed}")
    assert landed == 0
    until = time.monotonic() + 5
    while t.quarantined and time.monotonic() < until:
        time.sleep(0.01)
    assert not t.quarantined  # the producer confirmed nothing more of this attempt lands
    time.sleep(0.05)
    assert cons._inbox.num_live == 0  # settled attempts are pruned: nothing grows


def test_a_killed_producer_ends_the_quarantine_at_once(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """A push that timed out while its producer was stopped stays quarantined while that
    process lives (stopped, it could still write when continued). Once it is killed,
    nothing more can land: the consumer sees its side channel refuse connections and
    ends the quarantine within a few heartbeats, not at ``deadline + lease_s`` (60 s
    here; before, a vLLM decode reported such a load 125 s after it started)."""
    a = spawn(engine_id="pa", num_blocks=256).start()
    cons, ranks = make_consumer("tiny-gqa", 256, handshake_timeout_s=2.0, heartbeat_s=0.2)
    closing(cons)
    assert cons.config.lease_s >= 60
    _warm(cons, a, ranks)
    lids, rids = np.arange(10, 138), np.arange(0, 128)
    a.stop_process()
    t = cons.push("late", a.address, local_block_ids=lids, remote_block_ids=rids,
                  deadline_s=DEADLINE_S)  # fmt: skip
    wait_all([t], DEADLINE_S + 5)
    assert t.state in (RequestState.TIMEOUT, RequestState.PEER_LOST), (t.state, t.error)
    time.sleep(1.0)  # heartbeats go unanswered: the producer may be gone or only stopped
    assert t.quarantined
    a.kill()
    t0 = time.monotonic()
    while t.quarantined and time.monotonic() < t0 + 10:
        time.sleep(0.01)
    took = time.monotonic() - t0
    print(f"[measure] quarantine ended {took * 1e3:.0f} ms after the kill")
    assert not t.quarantined
    assert took < 5.0, took
    assert _landed(ranks, lids) == 0
    time.sleep(0.05)
    assert cons._inbox.num_live == 0


def test_retry_not_completed_by_stale_write_done(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """Item 2: the first attempt's WriteDone does not complete a retry with the same id."""
    a = spawn(engine_id="pa", num_blocks=64).start()
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0)
    closing(cons)
    _warm(cons, a, ranks)
    # attempt 1 is written (WriteDone reaches the consumer) after it ended TIMEOUT
    a.stop_process()
    try:
        t1 = cons.push("r", a.address, local_block_ids=ids(2, 3), remote_block_ids=ids(7, 8),
                       deadline_s=0.3)  # fmt: skip
        wait_all([t1], 5)
        assert t1.state is RequestState.TIMEOUT
    finally:
        a.signal(signal.SIGCONT)
    time.sleep(0.5)
    w = cons.push("w", a.address, local_block_ids=ids(4), remote_block_ids=ids(9))
    assert w.wait(10) is RequestState.DONE  # drains whatever attempt 1 sent
    # attempt 2 (same id) to a stopped producer: nothing can complete it
    a.stop_process()
    try:
        t2 = cons.push("r", a.address, local_block_ids=ids(10, 11), remote_block_ids=ids(12, 13),
                       deadline_s=DEADLINE_S)  # fmt: skip
        wait_all([t2], DEADLINE_S + 5)
        print(f"[measure] retry while stopped: {t2.state.value}, {t2.latency_s * 1e3:.1f} ms")
        assert t2.state is RequestState.TIMEOUT, t2.state
        assert _landed(ranks, [10, 11]) == 0
    finally:
        a.signal(signal.SIGCONT)


def test_restarted_consumer_at_same_address_gets_pushes(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """Item 8: the producer keys consumer peers by generation, not by address alone."""
    a = spawn(engine_id="pa", num_blocks=64).start()
    addr = f"tcp://127.0.0.1:{free_port()}"
    first, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0, side_channel_addr=addr)
    _warm(first, a, ranks)
    first.close()
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0, side_channel_addr=addr)
    closing(cons)
    t = cons.push("again", a.address, local_block_ids=ids(2, 3), remote_block_ids=ids(7, 8),
                  deadline_s=5.0)  # fmt: skip
    assert t.wait(10) is RequestState.DONE, (t.state, t.error)
    assert verify(ranks, a.remote_spec(), ids(2, 3), ids(7, 8)) == 0


def test_silent_consumer_address_does_not_stall_pushes(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """Item 11: push requests naming a silent address (a records fetch that only times
    out) do not delay a genuine push: fetches run off the push thread."""
    a = spawn(engine_id="pa", num_blocks=64).start()
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0)
    closing(cons)
    _warm(cons, a, ranks)
    peer, backend = cons._peers[a.address], cons.ranks[0].backend
    for i in range(4):  # the producer's records fetch to each waits its full 5 s timeout
        silent = f"tcp://127.0.0.1:{free_port()}"
        kw = {"attempt": i + 1, "budget_ms": 30000, "sent_at_ns": time.time_ns()}
        if "attempt" not in PushRequest.__struct_fields__:  # schema 1 (before the fix)
            kw = {}
        bad = PushRequest(f"f{i}", peer.generations[0], silent, 0, 1, (2,), (3,), **kw)
        backend.send_notif(peer.agents[0], encode_msg(bad))
    time.sleep(0.2)
    t0 = time.monotonic()
    t = cons.push("genuine", a.address, local_block_ids=ids(4, 5), remote_block_ids=ids(9, 10),
                  deadline_s=4.0)  # fmt: skip
    state = t.wait(10)
    print(f"[measure] genuine push behind 4 silent fetches: {state.value} after "
          f"{time.monotonic() - t0:.3f} s")  # fmt: skip
    assert state is RequestState.DONE, (t.state, t.error)
    assert verify(ranks, a.remote_spec(), ids(4, 5), ids(9, 10)) == 0


def test_forged_write_done_is_not_obeyed(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """Item 16 (engine part): a WriteDone from an agent the attempt is not bound to (a
    third process that knows the request id, attempt and generation) is dropped."""
    from kvxfer.transport.nixl import NixlBackend
    from kvxfer.wire import WriteDone

    a = spawn(engine_id="pa", num_blocks=64).start()
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0)
    closing(cons)
    _warm(cons, a, ranks)
    forger = closing(NixlBackend("forger", progress_delay_us=100))
    target = forger.add_remote(cons.ranks[0].backend.metadata())
    a.stop_process()
    try:
        t = cons.push("v", a.address, local_block_ids=ids(2, 3), remote_block_ids=ids(7, 8),
                      deadline_s=DEADLINE_S)  # fmt: skip
        t.poll()
        kw = {"attempt": t.attempt} if hasattr(t, "attempt") else {}
        forged = WriteDone("v", t.peer.generations[0], 0, 1, **kw)
        forger.send_notif(target, encode_msg(forged))
        wait_all([t], DEADLINE_S + 5)
        assert t.state is RequestState.TIMEOUT, t.state  # never DONE on bytes not written
    finally:
        a.signal(signal.SIGCONT)


def test_cancelled_push_never_lands(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """Item 1 (Abort path): a push cancelled while the producer is stopped is dropped
    from its queue when it runs again (its 30 s deadline alone would let it write)."""
    a = spawn(engine_id="pa", num_blocks=256).start()
    cons, ranks = make_consumer("tiny-gqa", 256, handshake_timeout_s=2.0)
    closing(cons)
    _warm(cons, a, ranks)
    lids, rids = np.arange(10, 138), np.arange(0, 128)
    a.stop_process()
    try:
        t = cons.push("c", a.address, local_block_ids=lids, remote_block_ids=rids,
                      deadline_s=30.0)  # fmt: skip
        t.poll()
        assert t.expected  # the PushRequest went out
        assert t.cancel() is RequestState.ABORTED
        assert t.quarantined
    finally:
        a.signal(signal.SIGCONT)
    until = time.monotonic() + 5
    while t.quarantined and time.monotonic() < until:
        time.sleep(0.01)
    assert not t.quarantined  # the producer confirmed the cancellation
    time.sleep(0.5)
    assert _landed(ranks, lids) == 0
