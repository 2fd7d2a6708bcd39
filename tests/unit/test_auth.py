"""Sealed frames (HMAC-SHA256): forged, altered, replayed, stale or misdirected frames fail."""

from __future__ import annotations

import contextlib
import itertools
import threading

import pytest

from kvxfer.errors import AuthError, LayoutError, ProtocolError
from kvxfer.wire.auth import (
    ENV_KEY,
    NOTIFICATION,
    SIDE_REPLY,
    SIDE_REQUEST,
    ReplayGuard,
    Sealer,
    is_sealed,
    load_auth_key,
    open_frame,
    open_notification,
    seal_notification,
)

KEY = b"k" * 32
OTHER = b"o" * 32


def test_round_trip_names_sender_and_payload() -> None:
    s = Sealer(KEY, SIDE_REQUEST, "consumer-0", generation=7)
    frame = s.seal(b"hello")
    assert is_sealed(frame) and frame[0] == 0xC1  # never a msgpack first byte
    o = open_frame(KEY, frame, SIDE_REQUEST, guard=ReplayGuard())
    assert (o.sender, o.generation, o.counter, o.payload) == ("consumer-0", 7, 0, b"hello")
    assert open_frame(KEY, s.seal(b"x"), SIDE_REQUEST).counter == 1


def test_wrong_key_and_altered_frames_fail() -> None:
    frame = Sealer(KEY, SIDE_REQUEST, "c").seal(b"payload")
    with pytest.raises(AuthError, match="bad MAC"):
        open_frame(OTHER, frame, SIDE_REQUEST)
    for i in range(4, len(frame)):  # every byte after the magic is covered by the MAC
        bad = bytearray(frame)
        bad[i] ^= 1
        with pytest.raises(AuthError):
            open_frame(KEY, bytes(bad), SIDE_REQUEST)
    with pytest.raises(AuthError, match="not sealed"):
        open_frame(KEY, b"\x82\xa1t\xa3get", SIDE_REQUEST)
    assert issubclass(AuthError, ProtocolError) and issubclass(AuthError, ValueError)


def test_purpose_sender_and_context_are_bound() -> None:
    req = Sealer(KEY, SIDE_REQUEST, "c").seal(b"p")
    with pytest.raises(AuthError, match="sealed for 'kvxfer/side-request'"):
        open_frame(KEY, req, NOTIFICATION)
    with pytest.raises(AuthError, match="sealed by 'c', received from 'd'"):
        open_frame(KEY, req, SIDE_REQUEST, sender="d")
    reply = Sealer(KEY, SIDE_REPLY, "srv").seal(b"r", context=b"tag-of-request-1")
    assert open_frame(KEY, reply, SIDE_REPLY, context=b"tag-of-request-1").payload == b"r"
    with pytest.raises(AuthError, match="bad MAC"):  # a reply to another request
        open_frame(KEY, reply, SIDE_REPLY, context=b"tag-of-request-2")


def test_replay_rejected_out_of_order_accepted() -> None:
    s, guard = Sealer(KEY, SIDE_REQUEST, "c"), ReplayGuard()
    frames = [s.seal(bytes([i])) for i in range(5)]
    for i in (0, 3, 1, 4, 2):  # any order, each once
        assert open_frame(KEY, frames[i], SIDE_REQUEST, guard=guard).payload == bytes([i])
    for f in frames:
        with pytest.raises(AuthError, match="replayed"):
            open_frame(KEY, f, SIDE_REQUEST, guard=guard)
    # a restarted sender (new generation) starts its counter again: accepted
    s2 = Sealer(KEY, SIDE_REQUEST, "c")
    assert open_frame(KEY, s2.seal(b"new"), SIDE_REQUEST, guard=guard).counter == 0


def test_counters_older_than_the_window_rejected() -> None:
    s, guard = Sealer(KEY, SIDE_REQUEST, "c"), ReplayGuard()
    first = s.seal(b"0")
    for _ in range(2000):
        s.seal(b"")
    open_frame(KEY, s.seal(b"late"), SIDE_REQUEST, guard=guard)
    with pytest.raises(AuthError, match="too old"):
        open_frame(KEY, first, SIDE_REQUEST, guard=guard)


def test_stale_and_future_frames_rejected() -> None:
    s, guard = Sealer(KEY, SIDE_REQUEST, "c"), ReplayGuard(window_s=30)
    with pytest.raises(AuthError, match="stale frame"):
        open_frame(KEY, s.seal(b"", now=1000.0), SIDE_REQUEST, guard=guard, now=1031.0)
    with pytest.raises(AuthError, match="stale frame"):
        open_frame(KEY, s.seal(b"", now=1100.0), SIDE_REQUEST, guard=guard, now=1031.0)
    assert open_frame(KEY, s.seal(b"", now=1010.0), SIDE_REQUEST, guard=guard, now=1031.0)


def test_guard_memory_bounded() -> None:
    guard = ReplayGuard(window_s=10, max_streams=100)
    for i in range(100):
        open_frame(KEY, Sealer(KEY, SIDE_REQUEST, f"c{i}").seal(b"", now=0.0), SIDE_REQUEST,
                   guard=guard, now=0.0)  # fmt: skip
    with pytest.raises(AuthError, match="replay guard full"):
        open_frame(KEY, Sealer(KEY, SIDE_REQUEST, "x").seal(b"", now=1.0), SIDE_REQUEST,
                   guard=guard, now=1.0)  # fmt: skip
    # once the old streams are idle for twice the window, they are forgotten
    open_frame(KEY, Sealer(KEY, SIDE_REQUEST, "y").seal(b"", now=25.0), SIDE_REQUEST,
               guard=guard, now=25.0)  # fmt: skip
    assert len(guard) == 1


def test_guard_thread_safe_each_frame_accepted_once() -> None:
    s, guard = Sealer(KEY, SIDE_REQUEST, "c"), ReplayGuard()
    frames = [s.seal(b"") for _ in range(200)]
    accepted: list[int] = []

    def worker() -> None:
        for f in frames:
            with contextlib.suppress(AuthError):
                accepted.append(open_frame(KEY, f, SIDE_REQUEST, guard=guard).counter)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(accepted) == list(range(200))


def test_notifications() -> None:
    guard = ReplayGuard()
    frame = seal_notification(KEY, "E-p0-1a2b", b"\x81\xa1t\xa2rd")
    assert open_notification(KEY, "E-p0-1a2b", frame, guard) == b"\x81\xa1t\xa2rd"
    with pytest.raises(AuthError, match="replayed"):
        open_notification(KEY, "E-p0-1a2b", frame, guard)
    # a key holder's frame relayed as if from another agent is refused
    with pytest.raises(AuthError, match="sealed by 'E-p0-1a2b', received from 'E-p1-1a2b'"):
        open_notification(KEY, "E-p1-1a2b", seal_notification(KEY, "E-p0-1a2b", b"x"), guard)
    with pytest.raises(AuthError, match="bad MAC"):
        open_notification(OTHER, "E-p0-1a2b", seal_notification(KEY, "E-p0-1a2b", b"x"), guard)
    with pytest.raises(AuthError, match="not sealed"):
        open_notification(KEY, "E-p0-1a2b", b"\x81\xa1t\xa2rd", guard)
    # counters increase per agent: two frames of one agent differ and both open once
    a, b = seal_notification(KEY, "A", b"same"), seal_notification(KEY, "A", b"same")
    assert a != b
    assert open_notification(KEY, "A", a, guard) == open_notification(KEY, "A", b, guard)


def test_load_auth_key() -> None:
    assert load_auth_key(env={}) is None
    assert load_auth_key(env={ENV_KEY: ""}) is None
    assert load_auth_key(env={ENV_KEY: "s" * 16}) == b"s" * 16
    assert load_auth_key(b"x" * 20, env={ENV_KEY: "s" * 16}) == b"x" * 20
    with pytest.raises(LayoutError, match="at least 16 bytes required, got 5"):
        load_auth_key(env={ENV_KEY: "short"})
    with pytest.raises(LayoutError, match="at least 16 bytes"):
        Sealer(b"short", SIDE_REQUEST, "c")


def test_engine_config_keeps_the_key_out_of_repr() -> None:
    from kvxfer.engine.config import EngineConfig

    cfg = EngineConfig("e", auth_key=KEY)
    assert cfg.auth_key == KEY and KEY.decode() not in repr(cfg)
    assert EngineConfig("e").auth_key is None


def test_a_counter_jump_past_the_window_restarts_it_without_a_huge_shift() -> None:
    # a sealed counter far ahead (2**62: a key holder's forged frame) once made the
    # guard shift its bit mask by the gap: OverflowError out of the notification drain
    s, guard = Sealer(KEY, SIDE_REQUEST, "c"), ReplayGuard()
    assert open_frame(KEY, s.seal(b"0"), SIDE_REQUEST, guard=guard).counter == 0
    s._counter = itertools.count(2**62)
    far = s.seal(b"far")
    assert open_frame(KEY, far, SIDE_REQUEST, guard=guard).counter == 2**62
    with pytest.raises(AuthError, match="replayed frame"):
        open_frame(KEY, far, SIDE_REQUEST, guard=guard)
    s._counter = itertools.count(2**62 - 5)  # within the window below the newest: once
    assert open_frame(KEY, s.seal(b"near"), SIDE_REQUEST, guard=guard).counter == 2**62 - 5
    s._counter = itertools.count(1)  # the old stream position: far too old now
    with pytest.raises(AuthError, match="too old"):
        open_frame(KEY, s.seal(b"old"), SIDE_REQUEST, guard=guard)


def test_a_notification_is_bound_to_the_agent_it_was_sent_to() -> None:
    # guards are per receiving agent: a frame sent to one rank replayed to another rank
    # of the same process (whose guard never saw it) must not open there
    frame = seal_notification(KEY, "E-d0-1a2b", b"rd", receiver_agent="P-p0-9f")
    assert open_notification(KEY, "E-d0-1a2b", frame, ReplayGuard(),
                             receiver_agent="P-p0-9f") == b"rd"  # fmt: skip
    with pytest.raises(AuthError, match="bad MAC"):
        open_notification(KEY, "E-d0-1a2b", frame, ReplayGuard(), receiver_agent="P-p1-9f")


def test_counters_run_per_receiver_so_a_notice_delivered_late_is_not_too_old() -> None:
    # a WriteDone is sealed when its WRITE is made and arrives when it ends; meanwhile
    # the sender seals notices to other consumers. With one counter for all receivers,
    # the next notice to this receiver jumped its window past the late one ("too old").
    guard, sender = ReplayGuard(), "S-per-receiver-test"
    late = seal_notification(KEY, sender, b"late", receiver_agent="R2")
    for _ in range(1100):
        seal_notification(KEY, sender, b"", receiver_agent="R1")
    now = seal_notification(KEY, sender, b"now", receiver_agent="R2")
    assert open_notification(KEY, sender, now, guard, receiver_agent="R2") == b"now"
    assert open_notification(KEY, sender, late, guard, receiver_agent="R2") == b"late"
