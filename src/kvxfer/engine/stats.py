"""Typed statistics snapshots of an engine (pure values; the recorder is lock-protected).

A consumer records every request when it ends; :meth:`kvxfer.engine.Consumer.stats`
returns an :class:`EngineStats` snapshot, which the optional Prometheus exporter
(:mod:`kvxfer.integrations.prometheus`) and the demo read.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvxfer.engine.peer import PeerInfo
    from kvxfer.engine.transfer import Transfer

__all__ = ["LATENCY_BUCKETS_S", "EngineStats", "FirstContactStats", "StatsRecorder"]

# upper bounds of the latency histogram's buckets (seconds); the last bucket is +Inf
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                     5.0, 10.0, 30.0)  # fmt: skip


@dataclass(frozen=True, slots=True)
class FirstContactStats:
    """One contacted producer: first-contact phases and what was prepared.

    Attributes:
        address: the producer's side-channel endpoint(s).
        phases_s: seconds per phase (fetch, add_agent, build, prepare, wire_up).
        num_rows: strided rows prepared (what NIXL ingested).
        num_descriptors: descriptors those rows stand for (what a dense list would hold).
        generations: the incarnation contacted, per producer TP rank.
    """

    address: str
    phases_s: Mapping[str, float]
    num_rows: int
    num_descriptors: int
    generations: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of one consumer engine.

    Attributes:
        requests: ended requests by end state (``done``, ``failed``, ``timeout``,
            ``peer_lost``, ``aborted``), plus ``pending`` (live now).
        bytes_moved: bytes of requests that ended DONE.
        descriptors_posted: descriptors posted to the backend (after the planner's
            coalescing; NIXL may merge consecutive ones further).
        latency_buckets_s: histogram bucket upper bounds (the last, +Inf, is implied).
        latency_counts: requests per bucket (not cumulative; one more entry than bounds).
        latency_sum_s: total latency of ended requests.
        first_contacts: the producers contacted, with their first-contact figures.
    """

    requests: Mapping[str, int]
    bytes_moved: int
    descriptors_posted: int
    latency_buckets_s: tuple[float, ...]
    latency_counts: tuple[int, ...]
    latency_sum_s: float
    first_contacts: tuple[FirstContactStats, ...] = ()

    @property
    def num_ended(self) -> int:
        return sum(v for k, v in self.requests.items() if k != "pending")


@dataclass(slots=True)
class StatsRecorder:
    """Counters a consumer updates as requests end. Thread-safe (one lock)."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ended: dict[str, int] = field(default_factory=dict)
    _bytes: int = 0
    _descriptors: int = 0
    _counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    _sum_s: float = 0.0

    def record(self, t: Transfer) -> None:
        """Count one request that just ended (call once per request)."""
        latency = max(0.0, t.latency_s)
        with self._lock:
            self._ended[t.state.value] = self._ended.get(t.state.value, 0) + 1
            self._descriptors += t.num_descriptors
            if t.state.value == "done":
                self._bytes += t.num_bytes
            self._counts[bisect.bisect_left(LATENCY_BUCKETS_S, latency)] += 1
            self._sum_s += latency

    def snapshot(self, pending: int, peers: list[PeerInfo]) -> EngineStats:
        with self._lock:
            requests = {**self._ended, "pending": pending}
            counts, total = tuple(self._counts), self._sum_s
            moved, posted = self._bytes, self._descriptors
        contacts = tuple(
            FirstContactStats(
                p.address, dict(p.timings_s), p.num_rows, p.num_descriptors, dict(p.generations)
            )
            for p in peers
            if p.ready.is_set() and p.error is None
        )
        return EngineStats(requests, moved, posted, LATENCY_BUCKETS_S, counts, total, contacts)
