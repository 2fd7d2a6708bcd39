"""A READ whose producer the heartbeat drops (PEER_LOST) tells the producer, when it is
in fact alive (a stall longer than the verdict: a stopped container, a long pause), to
free the request's blocks, instead of leaving them held until the lease ends (review
finding of stop 29: the peer's agents were released before anything was said, so no
Abort could go). The READ runs over UCX's TCP transport, so a stopped producer does not
serve it (CMA would copy out of the stopped process and end DONE)."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from kvxfer.engine.config import RequestState

from .procs import ids, make_consumer, wait_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NB = 256
LEASE_S = 60.0  # far longer than the test waits: only an Abort frees the hold in time


def test_a_read_ended_peer_lost_frees_the_live_producers_blocks(
    monkeypatch: pytest.MonkeyPatch, spawn, closing
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("UCX_TLS", "tcp")
    a = spawn(engine_id="pa", num_blocks=NB).start()
    cons, _ = make_consumer("tiny-gqa", NB, handshake_timeout_s=2.0, heartbeat_s=0.2)
    closing(cons)
    a.hold([("warm", 2), ("stalled", 128)], lease_s=LEASE_S)
    t = cons.read("warm", a.address, local_block_ids=ids(0, 1), remote_block_ids=ids(5, 6))
    assert t.wait(20) is RequestState.DONE, t.error  # contacted and watched
    assert a.wait_free(5.0)["freed_by_reason"] == {"read": 1}
    a.stop_process()
    try:
        stalled = cons.read("stalled", a.address, local_block_ids=np.arange(128),
                            remote_block_ids=np.arange(128), deadline_s=20.0)  # fmt: skip
        wait_all([stalled], 10)
        assert stalled.state is RequestState.PEER_LOST, (stalled.state, stalled.error)
    finally:
        a.signal(signal.SIGCONT)
    t0 = time.monotonic()
    stats = a.wait_free(10.0)
    print(f"[measure] blocks of the PEER_LOST read freed after {time.monotonic() - t0:.2f} s: "
          f"{stats['freed_by_reason']}")  # fmt: skip
    assert stats["held_blocks"] == 0, stats
    assert stats["freed_by_reason"].get("aborted") == 1, stats


def test_a_request_whose_producer_was_told_to_free_its_blocks_never_ends_done() -> None:
    """Once a drop sent a request's Abort, the request ends PEER_LOST even if its READ
    then reports complete: here the producer's agent outlives the drop (another spelling
    of its address still uses it), so the READ's handle stays valid, and the producer
    has freed (and may reuse) the blocks the bytes came from. Real NIXL in one process;
    the first poll of the READ is made to report it still in flight."""
    from kvxfer.transport.nixl import XferState
    from tests.engines import local_pair, until

    with local_pair() as (_, _, prod, cons):
        port = prod.address.rsplit(":", 1)[1]
        other = cons.connect(f"tcp://localhost:{port}")  # the same producer, same agent
        assert other.agents == cons.connect(prod.address).agents
        prod.hold("r", block_ids=[1, 2, 3])
        backend = next(iter(cons.ranks.values())).backend
        real_poll, calls = backend.poll, []

        def in_flight_once(x):  # type: ignore[no-untyped-def]
            calls.append(1)
            return XferState.IN_PROGRESS if len(calls) == 1 else real_poll(x)

        backend.poll = in_flight_once  # type: ignore[method-assign]
        t = cons.read("r", prod.address, local_block_ids=[1, 2, 3], remote_block_ids=[1, 2, 3])
        assert t.poll() is RequestState.PENDING and t.posted_at  # posted, "in flight"
        cons._drop_peer(t.peer)  # a heartbeat verdict on this spelling of the address
        # freed by the Abort, or by the ReadDone NIXL sends as the unticketed READ completes
        assert until(lambda: any(rid == "r" for rid, _ in prod.pop_freed()), 5.0)
        assert t.poll() is RequestState.PEER_LOST, (t.state, t.error)
        assert not other.error  # the other spelling's peer is untouched


def test_a_push_whose_producer_was_told_to_free_its_blocks_never_ends_done() -> None:
    """The push side of the test above: the producer's WriteDone arrives only after the
    drop sent the request's Abort (the consumer's notifications are held back until
    then; another spelling of the producer's address keeps its agent loaded). The bytes
    landed, but the producer was told it may free and reuse the blocks they came from:
    the request ends PEER_LOST, never DONE."""
    import threading

    from kvxfer.wire import WriteDone, decode_msg
    from tests.engines import local_pair, until

    with local_pair() as (_, _, prod, cons):
        port = prod.address.rsplit(":", 1)[1]
        other = cons.connect(f"tcp://localhost:{port}")
        assert other.agents == cons.connect(prod.address).agents
        backend = next(iter(cons.ranks.values())).backend
        real_get, gate = backend.get_notifs, threading.Event()
        held: dict[str, list[bytes]] = {}

        def held_back() -> dict[str, list[bytes]]:
            got = real_get()
            if not gate.is_set():
                for agent, msgs in got.items():
                    held.setdefault(agent, []).extend(msgs)
                return {}
            for agent, msgs in held.items():
                got.setdefault(agent, [])[:0] = msgs
            held.clear()
            return got

        def write_done_held() -> bool:
            msgs = [decode_msg(m) for ms in held.values() for m in ms]
            return any(isinstance(m, WriteDone) and m.request_id == "p" for m in msgs)

        backend.get_notifs = held_back  # type: ignore[method-assign]
        t = cons.push("p", prod.address, local_block_ids=[1, 2, 3], remote_block_ids=[1, 2, 3])
        assert until(lambda: t.poll() is RequestState.PENDING and write_done_held(), 5.0)
        assert t.poll() is RequestState.PENDING and t.posted_at  # written, not yet told
        cons._drop_peer(t.peer)  # a heartbeat verdict on this spelling of the address
        assert t.abort_sent
        gate.set()  # now the WriteDone reaches the request
        assert until(lambda: not held, 5.0)
        assert t.wait(5.0) is RequestState.PEER_LOST, (t.state, t.error)
        assert not other.error
