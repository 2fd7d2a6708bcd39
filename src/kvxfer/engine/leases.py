"""Which requests' blocks a producer rank still holds, and when to free them (pure).

A request's blocks are held until every expected consumer has read them, the request
is aborted, or its lease expires. Consumers still waiting renew leases. Expiry is
ordered by deadline (a heap with lazy deletion), so a renewed entry never hides
expired ones behind it. Every request is released exactly once.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from kvxfer.engine.config import check_seconds
from kvxfer.errors import ConfigError

__all__ = ["FreeReason", "Lease", "LeaseTable"]


class FreeReason(str, Enum):
    """Why a request's blocks were released."""

    READ = "read"  # every expected consumer read (or was told about) the request
    ABORTED = "aborted"  # a consumer aborted, failed or timed out
    EXPIRED = "expired"  # the lease ran out


@dataclass(frozen=True, slots=True)
class Lease:
    """What :meth:`kvxfer.engine.producer.Producer.hold` returns: pass ``expires_at_ns``
    to the consumer's ``read(..., lease_expires_at_ns=)`` (with the block ids).

    Attributes:
        request_id: the held request.
        expires_at_ns: when the lease ends, producer wall clock (``time.time_ns()``).
            The consumer refuses to post within ``lease_margin_s`` of it and the
            producer frees only ``lease_margin_s`` after it, so clocks may differ by up
            to the margin (NTP keeps hosts far closer).
        generation: the producer's incarnation (pass it as ``read(generation=)``).
        ticket: the hold's ticket (pass it as ``read(hold_ticket=)``): the consumer
            checks after its READ that the hold was still alive
            (:mod:`kvxfer.engine.holds`); 0: none.
    """

    request_id: str
    expires_at_ns: int
    generation: int
    ticket: int = 0


@dataclass(slots=True)
class _Entry:
    num_blocks: int
    expires_at: float
    lease_s: float  # the hold's own lease: what a renewal extends it by, at least
    acked: set[int] = field(default_factory=set)


MAX_EARLY_ACKS = 4096  # acks remembered for requests not (yet) held

_T = TypeVar("_T")


def _drop_older(
    table: dict[str, _T], stamp: Callable[[_T], float], now: float, keep_s: float
) -> None:
    """Drop ``table``'s entries stamped more than ``keep_s`` before ``now``, from the
    first on, up to the first that is not (the table is kept in time order)."""
    while table:
        first = next(iter(table))
        if now - stamp(table[first]) <= keep_s:
            return
        del table[first]


class LeaseTable:
    """Requests held by one producer rank. Times are caller-supplied seconds (monotonic).

    Not thread-safe (pure bookkeeping): the producer calls it under its own lock.
    """

    def __init__(self, default_lease_s: float = 30.0) -> None:
        self.default_lease_s = check_seconds("lease_s (default)", default_lease_s)
        self._entries: dict[str, _Entry] = {}
        self._heap: list[tuple[float, int, str]] = []  # (expires_at, seq, request_id)
        self._seq = 0
        self._freed: list[tuple[str, FreeReason]] = []
        self.num_unknown_acks = 0
        # acks (with a time) for requests not held yet: request -> (ranks, expected, first
        # seen); a hold within early_ack_s counts them (oldest dropped past the bound)
        self._early: dict[str, tuple[set[int], int, float]] = {}
        self.early_ack_s = 10.0
        # requests released within early_ack_s -> when: an ack for one then is late (its
        # READ outlived the hold, or a duplicate), not early, and is never remembered for
        # a new hold of the same id (bounded like _early, oldest dropped first)
        self._released: dict[str, float] = {}
        self.num_late_acks = 0
        self._clock = 0.0  # the latest ``now`` a caller gave (abort() is given none)

    @property
    def held_blocks(self) -> int:
        """Blocks held by requests not yet released."""
        return sum(e.num_blocks for e in self._entries.values())

    @property
    def num_early_acks(self) -> int:
        """Requests with acks remembered from before their hold."""
        return len(self._early)

    @property
    def num_requests(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def _push(self, request_id: str, expires_at: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (expires_at, self._seq, request_id))
        if len(self._heap) > 2 * len(self._entries) + 64:  # mostly stale items: rebuild
            self._heap = [
                (e.expires_at, seq, rid)
                for seq, (rid, e) in enumerate(self._entries.items(), self._seq + 1)
            ]
            self._seq += len(self._entries)
            heapq.heapify(self._heap)

    def hold(
        self,
        request_id: str,
        num_blocks: int,
        now: float,
        lease_s: float | None = None,
        *,
        early: bool = True,
    ) -> None:
        """Start holding ``num_blocks`` blocks for ``request_id`` until ``now + lease_s``
        (``early``: count the acks that came before it; False drops them)."""
        if request_id in self._entries:
            raise ConfigError(f"request {request_id!r} is already held")
        if num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {num_blocks}")
        lease = (
            self.default_lease_s
            if lease_s is None
            else check_seconds("lease_s", lease_s, allow_zero=True)
        )
        expires = now + lease
        self._tick(now)
        self._entries[request_id] = _Entry(num_blocks, expires, lease)
        self._push(request_id, expires)
        acks = self._early.pop(request_id, None)
        if early and acks is not None and now - acks[2] <= self.early_ack_s:
            ranks, expected, _ = acks
            self._entries[request_id].acked |= ranks
            if len(ranks) >= max(1, expected):
                self._release(request_id, FreeReason.READ)

    def ack(
        self, request_id: str, consumer_rank: int, expected: int, now: float | None = None
    ) -> bool:
        """Record that ``consumer_rank`` read the request; True if this released it.

        Idempotent per consumer rank. Acks for requests not held are counted in
        ``num_unknown_acks``; with ``now`` they are also remembered (bounded, for
        ``early_ack_s``), so an ack that overtook its hold counts when the hold comes.
        An ack for a request released within ``early_ack_s`` is late (its READ outlived
        the hold, or a duplicate): counted in ``num_late_acks`` and never remembered,
        so a new hold of the same id is not freed by an ack of the one that ended. An
        unbound hold cannot tell a late ack that comes after a new hold of the same id
        from that hold's own: only hold tickets (:mod:`kvxfer.engine.holds`) separate
        two holds of one id fully; and a true early ack of an id reused within
        ``early_ack_s`` is taken for late (the new hold then waits for its lease).
        """
        self._tick(now)
        entry = self._entries.get(request_id)
        if entry is None:
            self.num_unknown_acks += 1
            released = self._released.get(request_id)
            if now is not None and released is not None and 0 <= now - released <= self.early_ack_s:
                self.num_late_acks += 1  # of the hold that ended: no new hold may count it
                return False
            if now is not None:
                ranks, _, seen = self._early.pop(request_id, (set(), expected, now))
                ranks.add(consumer_rank)
                self._early[request_id] = (ranks, expected, seen)
                while len(self._early) > MAX_EARLY_ACKS:
                    del self._early[next(iter(self._early))]
            return False
        entry.acked.add(consumer_rank)
        if len(entry.acked) >= max(1, expected):
            self._release(request_id, FreeReason.READ)
            return True
        return False

    def renew(
        self, request_id: str, now: float, lease_s: float | None = None, *, cover_s: float = 0.0
    ) -> bool:
        """Extend a held request's lease to ``now + lease_s`` (None: by the hold's own
        lease, or ``cover_s`` when longer: a reader's deadline); False if it is not held."""
        if lease_s is not None:
            check_seconds("lease_s", lease_s, allow_zero=True)
        check_seconds("cover_s", cover_s, allow_zero=True)
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        expires = now + (max(entry.lease_s, cover_s) if lease_s is None else lease_s)
        if expires > entry.expires_at:  # a lease never shortens; unchanged needs no heap item
            entry.expires_at = expires
            self._push(request_id, expires)
        return True

    def abort(self, request_id: str, now: float | None = None) -> bool:
        """Release a request now; False if it was not held (idempotent)."""
        self._tick(now)
        if request_id not in self._entries:
            return False
        self._release(request_id, FreeReason.ABORTED)
        return True

    def forget(self, request_id: str, now: float | None = None) -> bool:
        """Stop holding a request without reporting it in :meth:`pop_freed` (its owner
        frees it), and drop a release of it not yet reported; False if it was not held.
        Its acks from now on are late, as after any release."""
        self._tick(now)
        self._freed = [f for f in self._freed if f[0] != request_id]
        if self._entries.pop(request_id, None) is None:
            return False
        self._mark_released(request_id)
        return True

    def _tick(self, now: float | None) -> None:
        """Advance the table's clock to a caller's ``now`` (it never goes back)."""
        if now is not None:
            self._clock = max(self._clock, now)

    def expire(self, now: float) -> list[str]:
        """Release every request whose lease ended at or before ``now``; return their ids."""
        out: list[str] = []
        self._tick(now)
        # forget early acks and past releases from the oldest on (dict order is time order)
        _drop_older(self._early, lambda acks: acks[2], now, self.early_ack_s)
        _drop_older(self._released, lambda at: at, now, self.early_ack_s)
        while self._heap and self._heap[0][0] <= now:
            expires_at, _, rid = heapq.heappop(self._heap)
            entry = self._entries.get(rid)
            if entry is not None and entry.expires_at == expires_at:  # else a stale heap item
                self._release(rid, FreeReason.EXPIRED)
                out.append(rid)
        return out

    def pop_freed(self) -> list[tuple[str, FreeReason]]:
        """Requests released since the last call, in release order."""
        out, self._freed = self._freed, []
        return out

    def _release(self, request_id: str, reason: FreeReason) -> None:
        del self._entries[request_id]
        self._freed.append((request_id, reason))
        self._mark_released(request_id)

    def _mark_released(self, request_id: str) -> None:
        self._released.pop(request_id, None)  # re-inserted last: the dict stays time-ordered
        self._released[request_id] = self._clock
        while len(self._released) > MAX_EARLY_ACKS:
            del self._released[next(iter(self._released))]
