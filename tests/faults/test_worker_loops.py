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


def test_close_waits_for_the_heartbeat_thread_over_many_silent_producers() -> None:
    """A heartbeat round over 20 producers that never answer (listening sockets that
    speak no ZMTP) took seconds; close() returned while the thread probed on (and
    could still call back into the closed engine)."""
    import socket

    from kvxfer.engine import Consumer, EngineConfig, allocate_cache
    from kvxfer.layout.presets import spec_for

    socks = []
    try:
        for _ in range(20):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(64)
            socks.append(s)
        spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=4)
        cons = Consumer(EngineConfig("d", model_name="tiny-gqa", heartbeat_s=0.2),
                        [(spec, allocate_cache(spec))])  # fmt: skip
        for i, s in enumerate(socks):  # what a first contact does for each producer
            ep = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            cons._monitor.watch(ep, {ep: {i + 1}})
        time.sleep(0.5)  # a round is under way
        t0 = time.monotonic()
        cons.close()
        took = time.monotonic() - t0
        assert not cons._monitor._thread.is_alive(), (
            f"close returned after {took:.1f} s with the heartbeat thread still probing"
        )
    finally:
        for s in socks:
            s.close()


def test_a_refused_heartbeat_counts_as_a_miss_not_a_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A keyed probe refused as ``unauthorized`` (an on-path attacker who got a captured
    request to the server first, which then takes the real one for a replay; or a
    request overtaken by 1,024 later ones) dropped the producer at once, failing its
    live loads. It is a miss now: the next answer clears it."""
    from kvxfer.engine import liveness
    from kvxfer.errors import AuthError

    key = b"k" * 32
    real, calls = liveness.fetch_records, [0]

    def refused_once(*a, **k):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 1:
            raise AuthError("unauthorized: authentication required")
        return real(*a, **k)

    monkeypatch.setattr(liveness, "fetch_records", refused_once)
    from kvxfer.engine import EngineConfig, Producer, allocate_cache
    from kvxfer.layout.presets import spec_for

    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=4)
    verdicts: list[str] = []
    with Producer(EngineConfig("p", model_name="tiny-gqa", auth_key=key),
                  [(spec, allocate_cache(spec))]) as prod:  # fmt: skip
        mon = PeerMonitor(prod.compat_hash, 0.1, lambda k, r, g: verdicts.append(r),
                          max_misses=3, auth_key=key)  # fmt: skip
        try:
            mon.watch("p", {prod.address: {prod.generation}})
            end = time.monotonic() + 10
            while calls[0] < 4 and time.monotonic() < end:
                time.sleep(0.05)
            assert calls[0] >= 4  # refused once, then answered
            assert verdicts == []  # was: "heartbeat refused: unauthorized ..." at once
        finally:
            mon.close()


class _Handle:
    """A stand-in WRITE handle that records its release, or raises from it."""

    def __init__(self, raises: bool = False) -> None:
        self.released = 0
        self.raises = raises

    def release(self) -> None:
        self.released += 1
        if self.raises:
            from kvxfer.errors import TransferError

            raise TransferError("injected: release failed")


def _push_worker_with(handles: list[_Handle]):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from kvxfer.engine import EngineConfig, Producer, allocate_cache
    from kvxfer.layout.presets import spec_for

    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=4)
    prod = Producer(EngineConfig("p", model_name="tiny-gqa"), [(spec, allocate_cache(spec))])
    prod._pusher._writes = [SimpleNamespace(xfer=h, cancelled=False) for h in handles]
    return prod


def test_push_worker_close_leaves_in_use_handles_to_a_thread_that_did_not_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A push thread that did not stop within the join timeout (stuck in a call) may
    still use its WRITE handles: close() released them under it."""
    from kvxfer.engine import pusher as pusher_mod

    monkeypatch.setattr(pusher_mod, "CLOSE_JOIN_S", 0.2)
    h = _Handle()
    prod = _push_worker_with([h])
    stuck, go = threading.Event(), threading.Event()
    pusher = prod._pusher
    real_do = pusher._do

    def blocking(cmd):  # type: ignore[no-untyped-def]
        stuck.set()
        go.wait(10)
        return real_do(cmd)

    pusher._do = blocking  # type: ignore[method-assign]
    pusher._jobs.put(("precontact", ("tcp://127.0.0.1:9", 1)))
    assert stuck.wait(5)
    try:
        pusher.close()
        assert pusher._thread.is_alive() and h.released == 0  # left to the stuck thread
    finally:
        go.set()
        pusher._thread.join(5)
        pusher._writes = []
        prod.close()


def test_push_worker_close_goes_on_when_a_release_raises() -> None:
    """A release that raised stopped Producer.close() before its server and ranks."""
    bad, good = _Handle(raises=True), _Handle()
    prod = _push_worker_with([bad, good])
    prod.close()
    assert bad.released == 1 and good.released == 1
    assert prod._pusher._writes == []
