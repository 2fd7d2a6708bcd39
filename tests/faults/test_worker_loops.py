"""Issue 9 item 7: the handshake and heartbeat threads survive any exception; a fault
fails only the job it hit, typed, with the cause chained."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvxfer.engine import RequestState
from kvxfer.engine.liveness import PeerMonitor
from kvxfer.errors import PeerLostError
from kvxfer.testing import mismatches
from tests.engines import free_port, local_pair

pytestmark = pytest.mark.timeout(60)


def _dead_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"  # nobody listens there


def test_handshake_thread_error_fails_one_contact_typed_and_the_next_succeeds() -> None:
    with local_pair(16) as (spec, local, prod, cons):
        backend = cons.ranks[0].backend
        real_add = backend.add_remote
        calls = []

        def add_remote_failing_once(blob: bytes) -> str:  # a non-kvxfer fault, once
            calls.append(len(blob))
            if len(calls) == 1:
                raise RuntimeError("injected: UCX said no")
            return real_add(blob)

        backend.add_remote = add_remote_failing_once  # type: ignore[method-assign]
        prod.hold("r1", block_ids=[3])
        t1 = cons.read("r1", prod.address, local_block_ids=[0], remote_block_ids=[3])
        assert t1.wait(10) is RequestState.PEER_LOST
        assert isinstance(t1.error, PeerLostError)
        assert "RuntimeError: injected: UCX said no" in str(t1.error)
        assert isinstance(t1.error.__cause__, RuntimeError)
        assert prod.address not in cons._peers  # no half-made peer is left "ready"
        lids, rids = np.array([1, 2]), np.array([7, 11])
        t2 = cons.read("r2", prod.address, local_block_ids=lids, remote_block_ids=rids)
        assert t2.wait(10) is RequestState.DONE, t2.error
        assert len(calls) == 2  # the second request made a fresh contact
        assert mismatches(spec, local, spec, lids, rids) == 0
        threads = [th.name for th in threading.enumerate()]
        assert "kvxfer-heartbeat" in threads


def test_heartbeat_thread_survives_a_failing_verdict_callback_and_bad_endpoints() -> None:
    verdicts: list[tuple[str, str]] = []

    def on_lost(key: str, reason: str, generations: set[int]) -> None:
        verdicts.append((key, reason))
        if len(verdicts) == 1:
            raise RuntimeError("injected: the consumer's drop failed")

    mon = PeerMonitor("hash", 0.1, on_lost, max_misses=2)
    try:
        mon.watch("a", {_dead_endpoint(): {1}})
        end = time.monotonic() + 10
        while not verdicts and time.monotonic() < end:
            time.sleep(0.05)
        assert [k for k, _ in verdicts] == ["a"]
        assert "refuses connections" in verdicts[0][1]  # nothing listens: one probe
        # the callback raised: the thread lives on and judges the next peers
        mon.watch("b", {"not-an-endpoint": {2}})  # ZMQ refuses the address itself
        mon.watch("c", {_dead_endpoint(): {3}})
        while len(verdicts) < 3 and time.monotonic() < end:
            time.sleep(0.05)
        assert sorted(k for k, _ in verdicts) == ["a", "b", "c"]
        reason_b = dict(verdicts)["b"]
        assert reason_b.startswith("not-an-endpoint: heartbeat"), reason_b
        assert mon._thread.is_alive()
    finally:
        mon.close()
    assert not mon._thread.is_alive()


def test_heartbeat_verdict_about_an_older_incarnation_keeps_the_peer() -> None:
    """Issue 9 item 12, made deterministic: a verdict computed from an old snapshot (other
    generations than the peer's now) must not drop the peer; one about its current
    generations drops it, and the next request makes a fresh contact and succeeds."""
    with local_pair(16) as (spec, local, prod, cons):
        peer = cons.connect(prod.address)
        cons._on_peer_lost(prod.address, "verdict about a predecessor", {prod.generation ^ 1})
        assert cons._peers.get(prod.address) is peer and peer.error is None
        t1 = cons.read("r1", prod.address, local_block_ids=[0], remote_block_ids=[5])
        assert t1.wait(10) is RequestState.DONE and t1.peer is peer
        cons._on_peer_lost(prod.address, "verdict about this one", {prod.generation})
        assert prod.address not in cons._peers
        assert isinstance(peer.error, PeerLostError) and "verdict about this one" in str(peer.error)
        t2 = cons.read("r2", prod.address, local_block_ids=[1], remote_block_ids=[6])
        assert t2.wait(10) is RequestState.DONE and t2.peer is not peer  # a fresh contact
        assert mismatches(spec, local, spec, np.array([0, 1]), np.array([5, 6])) == 0
