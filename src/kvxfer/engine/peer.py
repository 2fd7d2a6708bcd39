"""A producer engine as the consumer side knows it (:class:`PeerInfo`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvxfer.errors import KvxferError
from kvxfer.layout.model import MemKind
from kvxfer.planning.plans import PeerPlan
from kvxfer.transport.nixl import PreparedList

__all__ = ["PeerInfo"]


@dataclass(slots=True)
class PeerInfo:
    """A producer engine this consumer has contacted (or is contacting).

    Thread-safety: written by its handshake thread until ``ready`` is set, read-only
    afterwards (``error`` may be set once more by a heartbeat verdict).

    Attributes:
        address: the producer's side-channel endpoint.
        generations: remote rank -> producer incarnation the prepared lists belong to.
        timings_s: first-contact phases: fetch, add_agent, build, prepare, wire_up.
        num_rows, num_descriptors: strided rows prepared vs descriptors they stand for.
        phase, phase_at: the first-contact phase under way (fetch, build, add_agent,
            prepare, wire_up; "ready" at the end) and when it began (perf_counter), for
            the error of a request whose deadline passes while it waits.
    """

    address: str
    ready: threading.Event = field(default_factory=threading.Event)
    error: KvxferError | None = None
    generations: dict[int, int] = field(default_factory=dict)  # remote rank -> generation
    endpoint_generations: dict[str, set[int]] = field(default_factory=dict)  # endpoint -> gens
    plans: dict[int, PeerPlan] = field(default_factory=dict)
    lists: dict[tuple[int, int], tuple[PreparedList, PreparedList]] = field(default_factory=dict)
    agents: dict[int, str] = field(default_factory=dict)  # remote rank -> agent name
    mem_kinds: dict[int, MemKind] = field(default_factory=dict)  # remote rank -> its memory
    holds: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> hold table
    hold_lists: dict[tuple[int, int], PreparedList] = field(default_factory=dict)  # (d, r)
    timings_s: dict[str, float] = field(default_factory=dict)
    num_rows: int = 0
    num_descriptors: int = 0
    phase: str = "fetch"
    phase_at: float = field(default_factory=time.perf_counter)
    wanted_at: float = 0.0  # monotonic: when a request last asked for it (while queued)

    def enter(self, phase: str) -> None:
        """The handshake thread starts ``phase`` of first contact."""
        self.phase, self.phase_at = phase, time.perf_counter()

    @property
    def generation(self) -> int:
        """Generation of the lowest remote rank (of every rank for a one-process engine)."""
        return self.generations[min(self.generations)] if self.generations else 0

    @property
    def endpoints(self) -> list[str]:
        """The side-channel endpoints in ``address`` (comma-separated, one per process)."""
        return [a.strip() for a in self.address.split(",") if a.strip()]
