"""LeaseTable: when a producer rank frees a request's blocks (pure, no processes)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvxfer.engine.leases import MAX_EARLY_ACKS, FreeReason, LeaseTable
from kvxfer.errors import ConfigError


def test_freed_after_last_expected_consumer() -> None:
    t = LeaseTable(10.0)
    t.hold("r", 4, now=0.0)
    assert t.held_blocks == 4
    assert t.ack("r", consumer_rank=0, expected=2) is False
    assert t.ack("r", consumer_rank=0, expected=2) is False  # the same rank twice: not two
    assert "r" in t
    assert t.pop_freed() == []
    assert t.ack("r", consumer_rank=1, expected=2) is True
    assert "r" not in t
    assert t.held_blocks == 0
    assert t.pop_freed() == [("r", FreeReason.READ)]
    assert t.pop_freed() == []


def test_expected_below_one_means_one() -> None:
    t = LeaseTable(10.0)
    t.hold("r", 1, now=0.0)
    assert t.ack("r", 3, expected=0) is True


def test_expired_freed_behind_renewed_leases() -> None:
    """Renewed leases sit ahead in the heap (old items) and in insertion order."""
    t = LeaseTable(10.0)
    for i in range(5):
        t.hold(f"renewed{i}", 1, now=0.0)  # first in time and in order
    t.hold("short", 2, now=0.0, lease_s=12.0)
    t.hold("long", 3, now=0.0, lease_s=50.0)
    for i in range(5):
        assert t.renew(f"renewed{i}", now=5.0, lease_s=100.0)
    assert t.expire(now=11.0) == []  # stale heap items of the renewed leases are skipped
    assert t.expire(now=12.0) == ["short"]
    assert t.held_blocks == 5 + 3
    assert t.expire(now=60.0) == ["long"]
    assert t.expire(now=104.9) == []
    assert sorted(t.expire(now=105.0)) == [f"renewed{i}" for i in range(5)]
    assert [r for _, r in t.pop_freed()] == [FreeReason.EXPIRED] * 7
    assert t.held_blocks == 0


def test_renew_never_shortens_and_unknown_renew_is_false() -> None:
    t = LeaseTable(10.0)
    t.hold("r", 1, now=0.0, lease_s=30.0)
    assert t.renew("r", now=1.0, lease_s=1.0) is True  # 2.0 < 30.0: kept
    assert t.expire(now=29.0) == []
    assert t.expire(now=30.0) == ["r"]
    assert t.renew("r", now=31.0) is False
    assert t.renew("never", now=31.0) is False


def test_idempotent_acks_after_release() -> None:
    t = LeaseTable(10.0)
    t.hold("r", 2, now=0.0)
    assert t.ack("r", 0, 1) is True
    assert t.ack("r", 0, 1) is False
    assert t.ack("r", 1, 1) is False
    assert t.ack("unknown", 0, 1) is False
    assert t.num_unknown_acks == 3
    assert t.pop_freed() == [("r", FreeReason.READ)]


def test_abort_releases_once() -> None:
    t = LeaseTable(10.0)
    t.hold("r", 2, now=0.0)
    t.ack("r", 0, 2)
    assert t.abort("r") is True
    assert t.abort("r") is False
    assert t.ack("r", 1, 2) is False  # the second reader comes late: nothing to free
    assert t.expire(now=1e9) == []
    assert t.pop_freed() == [("r", FreeReason.ABORTED)]
    assert t.held_blocks == 0


def test_no_double_release_any_order() -> None:
    t = LeaseTable(1.0)
    t.hold("a", 1, now=0.0)
    t.hold("b", 1, now=0.0)
    t.hold("c", 1, now=0.0)
    assert t.ack("a", 0, 1)
    assert t.abort("b")
    assert t.expire(now=5.0) == ["c"]  # a and b have heap items too: skipped
    assert not t.abort("a")
    assert not t.abort("c")
    assert not t.ack("b", 0, 1)
    assert t.expire(now=10.0) == []
    assert t.pop_freed() == [
        ("a", FreeReason.READ),
        ("b", FreeReason.ABORTED),
        ("c", FreeReason.EXPIRED),
    ]


def test_rehold_after_release_is_a_new_request() -> None:
    t = LeaseTable(10.0)
    t.hold("r", 1, now=0.0)
    t.abort("r")
    t.hold("r", 2, now=1.0)  # a stale heap item (expires 10.0) of the first hold remains
    assert t.expire(now=10.0) == []
    assert t.held_blocks == 2
    assert t.expire(now=11.0) == ["r"]
    assert t.pop_freed() == [("r", FreeReason.ABORTED), ("r", FreeReason.EXPIRED)]


def test_bad_input() -> None:
    with pytest.raises(ConfigError):
        LeaseTable(0.0)
    t = LeaseTable(1.0)
    t.hold("r", 1, now=0.0)
    with pytest.raises(ConfigError, match="already held"):
        t.hold("r", 1, now=0.0)
    with pytest.raises(ConfigError, match="num_blocks"):
        t.hold("s", -1, now=0.0)
    assert t.held_blocks == 1


def test_renewals_do_not_grow_the_heap_without_bound() -> None:
    """Renewing at a heartbeat with an unchanged expiry adds no heap items."""
    t = LeaseTable(10.0)
    t.hold("r", 1, now=0.0, lease_s=100.0)
    for i in range(1000):
        t.renew("r", now=i * 0.01, lease_s=1.0)  # never extends: no new item needed
    assert len(t._heap) == 1


# ---------------------------------------------------------------- model-based


@dataclass
class _Live:
    num_blocks: int
    expires_at: float
    lease_s: float  # its own lease: a renewal without one extends by it
    acked: set[int] = field(default_factory=set)


IDS = st.sampled_from([f"r{i}" for i in range(6)])
LEASE = st.sampled_from([None, 0.0, 0.5, 1.0, 2.5, 10.0])
DT = st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 3.0])


class LeaseMachine(RuleBasedStateMachine):
    """Random hold/ack/renew/expire/abort sequences against a dict-based reference model."""

    def __init__(self) -> None:
        super().__init__()
        self.table = LeaseTable(default_lease_s=2.0)
        self.now = 0.0
        self.live: dict[str, _Live] = {}
        self.expected_freed: list[tuple[str, FreeReason]] = []
        self.num_holds = 0
        self.num_released = 0
        self.num_unknown = 0

    def _release(self, rid: str, reason: FreeReason) -> None:
        del self.live[rid]
        self.expected_freed.append((rid, reason))
        self.num_released += 1

    @rule(dt=DT)
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(rid=IDS, n=st.integers(0, 8), lease=LEASE)
    def hold(self, rid: str, n: int, lease: float | None) -> None:
        if rid in self.live:
            with pytest.raises(ConfigError):
                self.table.hold(rid, n, self.now, lease)
            return
        self.table.hold(rid, n, self.now, lease)
        own = 2.0 if lease is None else lease
        self.live[rid] = _Live(n, self.now + own, own)
        self.num_holds += 1

    @rule(rid=IDS, rank=st.integers(0, 3), expected=st.integers(0, 3))
    def ack(self, rid: str, rank: int, expected: int) -> None:
        got = self.table.ack(rid, rank, expected)
        entry = self.live.get(rid)
        if entry is None:
            self.num_unknown += 1
            assert got is False
            return
        entry.acked.add(rank)
        want = len(entry.acked) >= max(1, expected)
        assert got is want
        if want:
            self._release(rid, FreeReason.READ)

    @rule(rid=IDS, lease=LEASE)
    def renew(self, rid: str, lease: float | None) -> None:
        got = self.table.renew(rid, self.now, lease)
        entry = self.live.get(rid)
        assert got is (entry is not None)
        if entry is not None:
            by = entry.lease_s if lease is None else lease
            entry.expires_at = max(entry.expires_at, self.now + by)

    @rule(rid=IDS)
    def abort(self, rid: str) -> None:
        got = self.table.abort(rid)
        assert got is (rid in self.live)
        if got:
            self._release(rid, FreeReason.ABORTED)

    @rule()
    def expire(self) -> None:
        got = self.table.expire(self.now)
        want = sorted((e.expires_at, r) for r, e in self.live.items() if e.expires_at <= self.now)
        assert sorted(got) == sorted(r for _, r in want)
        # released in expiry order
        order = [self.live[r].expires_at for r in got]
        assert order == sorted(order)
        for rid in got:
            self._release(rid, FreeReason.EXPIRED)

    @rule()
    def pop_freed(self) -> None:
        assert self.table.pop_freed() == self.expected_freed
        self.expected_freed = []

    @invariant()
    def held_blocks_match(self) -> None:
        assert self.table.held_blocks == sum(e.num_blocks for e in self.live.values())
        assert self.table.num_requests == len(self.live)
        assert all(r in self.table for r in self.live)
        assert self.table.num_unknown_acks == self.num_unknown

    @invariant()
    def released_exactly_once(self) -> None:
        # every hold is either live or released once; nothing released twice
        assert self.num_holds == len(self.live) + self.num_released

    def teardown(self) -> None:
        # draining: everything still held expires exactly once, then the table is empty
        self.table.expire(float("inf"))
        freed = self.table.pop_freed()
        assert freed[: len(self.expected_freed)] == self.expected_freed
        rest = freed[len(self.expected_freed) :]
        assert sorted(r for r, _ in rest) == sorted(self.live)
        assert {reason for _, reason in rest} <= {FreeReason.EXPIRED}
        assert self.table.held_blocks == 0
        assert not self.table._heap  # no stale heap items survive a full drain


LeaseMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestLeaseMachine = LeaseMachine.TestCase


def test_heap_stays_bounded_under_extending_renewals() -> None:
    """A heartbeat that extends every lease leaves stale heap items; they are compacted."""
    t = LeaseTable(10.0)
    for i in range(10):
        t.hold(f"r{i}", 1, now=0.0)
    for step in range(1, 2001):
        for i in range(10):
            t.renew(f"r{i}", now=step * 0.01)
    assert len(t._heap) <= 2 * 10 + 64 + 1
    assert t.expire(now=20.0 + 9.99) == []
    assert sorted(t.expire(now=30.0)) == [f"r{i}" for i in range(10)]
    assert t.held_blocks == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_lease_seconds_validated(bad: float) -> None:
    """Issue 9 item 9: one NaN lease used to stop every later lease in the table expiring."""
    with pytest.raises(ValueError, match="lease_s"):
        LeaseTable(bad)
    t = LeaseTable(1.0)
    with pytest.raises(ValueError, match="lease_s"):
        t.hold("a", 1, 0.0, bad)
    t.hold("b", 1, 0.0)
    with pytest.raises(ValueError, match="lease_s"):
        t.renew("b", 0.5, bad)
    assert t.expire(2.0) == ["b"]


def test_an_ack_that_arrives_before_the_hold_counts_once_the_hold_comes() -> None:
    # vLLM's prefill worker learns of a finished request one step after the engine
    # returned its params: a fast decode can read (and ack) before the hold is placed
    t = LeaseTable(30.0)
    assert t.ack("early", 0, expected=2, now=5.0) is False
    assert t.ack("early", 1, expected=2, now=5.1) is False
    t.hold("early", 3, now=5.2)
    assert t.pop_freed() == [("early", FreeReason.READ)]
    assert t.held_blocks == 0
    # one of two expected ranks acked early: held until the second one
    t.ack("half", 0, expected=2, now=6.0)
    t.hold("half", 1, now=6.1)
    assert t.pop_freed() == [] and t.held_blocks == 1
    assert t.ack("half", 1, expected=2, now=6.2) is True


def test_a_late_ack_of_a_released_hold_does_not_free_a_new_hold_of_that_id() -> None:
    """An ack that comes after its hold ended (by lease, abort or reads) is late, not
    early: it must not count toward a new hold of the same request id made within
    ``early_ack_s`` (review finding of stop 29: the new hold was freed at once, and its
    reader could read blocks already reused). The new hold then waits for its own acks."""
    for end in ("expire", "abort", "read", "forget"):
        t = LeaseTable(30.0)
        t.hold("r", 2, now=0.0, lease_s=1.0)
        if end == "expire":
            assert t.expire(now=1.5) == ["r"]
        elif end == "abort":
            assert t.abort("r", now=1.5)
        elif end == "forget":  # the producer's release(): its owner frees the blocks
            assert t.forget("r", now=1.5)
        else:
            assert t.ack("r", 0, expected=1, now=0.5) is True
        t.pop_freed()
        assert t.ack("r", 0, expected=1, now=2.0) is False  # the late (or duplicate) ack
        t.hold("r", 3, now=2.5)  # the id reused within early_ack_s
        assert t.pop_freed() == [] and t.held_blocks == 3, end
        assert t.ack("r", 0, expected=1, now=3.0) is True  # its own reader frees it
    # past early_ack_s after the release, an ack before a hold is early again
    t = LeaseTable(30.0)
    t.hold("q", 1, now=0.0)
    assert t.abort("q")
    later = t.early_ack_s + 1.0
    t.expire(now=later)
    t.ack("q", 0, expected=1, now=later)
    t.hold("q", 1, now=later + 0.1)
    assert t.pop_freed()[-1] == ("q", FreeReason.READ)


def test_early_acks_are_forgotten_after_a_while_and_bounded() -> None:
    t = LeaseTable(30.0)
    t.ack("old", 0, expected=1, now=0.0)
    t.hold("old", 1, now=t.early_ack_s + 1.0)  # too late: an ack of something else
    assert t.pop_freed() == [] and t.held_blocks == 1
    for i in range(MAX_EARLY_ACKS + 10):
        t.ack(f"x{i}", 0, expected=1, now=100.0)
    assert t.num_early_acks == MAX_EARLY_ACKS
    t.expire(now=100.0 + t.early_ack_s + 1.0)
    assert t.num_early_acks == 0
    # without a time (callers that do not opt in) an unknown ack is only counted
    t.ack("y", 0, expected=1)
    assert t.num_early_acks == 0 and t.num_unknown_acks == MAX_EARLY_ACKS + 12


def test_a_renewal_keeps_a_short_hold_short() -> None:
    """A consumer's renewal extends a hold to cover its deadline (``cover_s``), by the
    hold's own lease at least: not the table's default. A 2 s hold renewed once was held
    for the engine's 60 s lease instead (found by a review)."""
    t = LeaseTable(60.0)
    t.hold("r", 1, now=0.0, lease_s=2.0)
    assert t.renew("r", now=1.0, cover_s=0.5) is True
    assert t.expire(now=2.9) == []
    assert t.expire(now=3.0) == ["r"]  # 1.0 + its own 2 s, not 1.0 + 60 s
    t.hold("s", 1, now=10.0, lease_s=2.0)
    assert t.renew("s", now=11.0, cover_s=5.0) is True  # the deadline is further: covered
    assert t.expire(now=15.9) == []
    assert t.expire(now=16.0) == ["s"]
