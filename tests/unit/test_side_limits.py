"""Reply budget of the side-channel server: one reply in flight per peer, shared bytes once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvxfer.transport import side_limits
from kvxfer.transport.side_limits import Pending, is_loopback


@dataclass
class FakeTracker:
    done: bool = False


def test_one_large_reply_in_flight_per_peer_and_shared_buffers_count_once() -> None:
    p, reply = Pending(), b"r" * side_limits.PEER_BYTES
    trackers = {peer: FakeTracker() for peer in (b"a", b"b", b"c")}
    for peer, t in trackers.items():
        assert not p.busy(peer) and p.admit(peer, reply)
        p.add(peer, t, reply)
    assert p.num_bytes == side_limits.PEER_BYTES  # three peers, one buffer
    assert p.busy(b"a")  # a peer that has not taken its reply gets no more work
    trackers[b"a"].done = True
    assert not p.busy(b"a") and p.num_bytes == side_limits.PEER_BYTES  # b, c hold it
    for peer in (b"b", b"c"):
        trackers[peer].done = True
        assert not p.busy(peer)
    assert p.num_bytes == 0


def test_pipelined_small_replies_keep_flowing() -> None:
    p = Pending()
    for i in range(200):  # a client that pipelines requests with small replies
        assert not p.busy(b"a")
        buf = b"%d" % i * 100
        assert p.admit(b"a", buf)
        p.add(b"a", FakeTracker(), buf)


def test_budget_refuses_unique_buffers_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(side_limits, "MAX_PENDING_BYTES", 2500)
    p = Pending()
    for i in range(2):
        buf = bytes([i]) * 1000
        assert p.admit(b"p%d" % i, buf)
        p.add(b"p%d" % i, FakeTracker(), buf)
    assert not p.admit(b"new", b"x" * 1000)  # 3000 > 2500 while both are in flight


def test_repeaters_share_a_rate_limit() -> None:
    p, buf = Pending(), b"x" * (1 << 20)
    assert p.admit(b"a", buf)
    p.add(b"a", FakeTracker(done=True), buf)
    assert not p.busy(b"a")
    sent = 0
    for _ in range(100):  # a peer asking again and again: the burst, then refusals
        if p.admit(b"a", buf):
            p.add(b"a", FakeTracker(done=True), buf)
            sent += 1
    assert sent == side_limits.REPEAT_BURST >> 20
    assert p.admit(b"first-time", buf)  # a new peer is not held back by repeaters


def test_is_loopback() -> None:
    assert is_loopback("tcp://127.0.0.1:5600") and is_loopback("tcp://[::1]:5600")
    assert is_loopback("tcp://localhost:1") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5600") and not is_loopback("tcp://*:5600")
    assert not is_loopback("tcp://10.0.0.5:5600") and not is_loopback("tcp://eth0:5600")
