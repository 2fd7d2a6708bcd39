"""One request in flight on the consumer side (:class:`Transfer`); the producer it names
is a :class:`~kvxfer.engine.peer.PeerInfo`."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvxfer.engine.config import RequestState, check_seconds
from kvxfer.engine.peer import PeerInfo
from kvxfer.errors import KvxferError, WaitTimeout
from kvxfer.planning.pairing import PeerPlan
from kvxfer.planning.request import RequestIds
from kvxfer.transport.nixl import XferHandle, XferOp


class RequestDriver(Protocol):
    """What a :class:`Transfer` needs from the engine that owns it (a narrow context,
    so requests do not import the consumer)."""

    def advance(self, transfer: Transfer) -> RequestState:
        """Advance ``transfer``'s state machine one step and return its state."""
        ...

    def cancel(self, transfer: Transfer) -> None:
        """End ``transfer`` ABORTED (unless terminal) and tell its producer."""
        ...

    def is_quarantined(self, transfer: Transfer) -> bool:
        """Whether a producer may still write into ``transfer``'s local blocks."""
        ...


__all__ = ["Transfer", "new_attempt", "num_bytes"]


def new_attempt() -> int:
    """A random nonzero 63-bit id for one request attempt (0 means "none" on the wire)."""
    return secrets.randbits(63) or 1


@dataclass(slots=True, eq=False)
class Transfer:
    """One request attempt moved by every (selected) local rank. Poll or wait; never
    blocks forever.

    Thread-safety: one Transfer is driven by one caller thread at a time (poll, wait,
    result, cancel); the consumer's notification thread only adds to ``written``,
    ``settled`` and ``failed_reason`` under the consumer's inbox lock.

    ``attempt`` is unique per read()/push() call and carried by every notification
    about it; a notice for another attempt of the same request id is dropped.
    """

    request_id: str
    consumer: RequestDriver
    peer: PeerInfo
    deadline: float
    ids: RequestIds  # local/remote (and state) block ids, cached count; validated when posted
    ranks: tuple[int, ...]
    op: XferOp = XferOp.READ
    state: RequestState = RequestState.PENDING
    error: KvxferError | None = None
    started_at: float = field(default_factory=time.perf_counter)
    posted_at: float = 0.0
    renewed_at: float = 0.0
    finished_at: float = 0.0
    num_descriptors: int = 0
    num_bytes: int = 0
    xfers: list[tuple[int, XferHandle]] = field(default_factory=list)  # (local rank, handle)
    notify: list[tuple[int, int]] = field(default_factory=list)  # (local rank, remote rank)
    expected: set[tuple[int, int]] = field(default_factory=set)  # push: (local, producer rank)
    generation: int | Mapping[int, int] | None = None  # the producer incarnation(s) holding it
    rechecked: bool = False
    recheck: Future[dict[int, int]] | None = None  # refetched generations (wrong pin?)
    keep_peer: bool = False  # a failure of this request alone: do not drop the peer
    attempt: int = field(default_factory=new_attempt)
    written: set[tuple[int, int]] = field(default_factory=set)  # push: WriteDone seen
    settled: set[tuple[int, int]] = field(default_factory=set)  # push: Cancelled seen
    failed_reason: str | None = None  # push: the producer's Failed notice
    lease_expires_at_ns: int | None = None  # pull: the producer's lease end (its wall clock)
    quarantine_until: float = 0.0  # push: monotonic bound of the quarantine (see RequestState)

    @property
    def quarantined(self) -> bool:
        """True while a producer may still write into this request's local blocks (a push
        that did not end DONE and whose producer has not confirmed cancellation yet):
        do not reuse the blocks until it turns False. Always False for pull."""
        return self.consumer.is_quarantined(self)

    def cancel(self) -> RequestState:
        """Give up on the request: it ends ABORTED (unless already terminal) and the
        producer is told (it frees the blocks; a push stops writing, see
        :attr:`quarantined`). Returns the final state."""
        self.consumer.cancel(self)
        return self.state

    def poll(self) -> RequestState:
        """Advance the request and return its state (terminal states stay put)."""
        return self.consumer.advance(self)

    def _wait_until(self, timeout_s: float | None) -> float:
        """When a wait of ``timeout_s`` ends (never past the request's own deadline)."""
        if timeout_s is None:
            return self.deadline
        check_seconds("timeout_s", timeout_s, allow_zero=True)
        return min(self.deadline, time.monotonic() + timeout_s)

    def wait(self, timeout_s: float | None = None) -> RequestState:
        """Poll until terminal or ``timeout_s`` (the request's own deadline always applies).

        Raises:
            LayoutError (a ValueError): ``timeout_s`` is NaN, infinite or negative.
        """
        until = self._wait_until(timeout_s)
        while not self.poll().is_terminal:
            now = time.monotonic()
            if now >= until and timeout_s is not None:
                break
            if not self.posted_at:  # first contact runs in another thread: sleep, do not spin
                self.peer.ready.wait(max(0.0, until - now) + 0.001)
            else:
                time.sleep(0.0002)
        return self.state

    def result(self, timeout_s: float | None = None) -> None:
        """Wait; raise the request's error unless it ended DONE.

        Raises:
            WaitTimeout: the caller's ``timeout_s`` ran out first (the request goes on).
            DeadlineError: the request's own deadline passed (it ended TIMEOUT).
        """
        state = self.wait(timeout_s)
        if state is RequestState.DONE:
            return
        if self.error is not None:
            raise self.error
        raise WaitTimeout(f"request {self.request_id!r} still {state.value} after {timeout_s} s")

    async def wait_async(self, timeout_s: float | None = None) -> RequestState:
        """:meth:`wait` for asyncio code: yields to the event loop between polls (first
        contact and the transfer run in other threads), never blocks it."""
        until = self._wait_until(timeout_s)
        pause = 0.0002
        while not self.poll().is_terminal and (timeout_s is None or time.monotonic() < until):
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.005)  # back off: a long first contact costs no CPU
        return self.state

    @property
    def latency_s(self) -> float:
        return (self.finished_at or time.perf_counter()) - self.started_at


def num_bytes(plan: PeerPlan, rank: int, local_ids: npt.NDArray[np.int32]) -> int:
    """Bytes moved by descriptors ``local_ids`` of source ``rank``'s local list."""
    src = next(s for s in plan.sources if s.rank == rank)
    starts = np.searchsorted(src.local_starts, local_ids, side="right") - 1  # row of each id
    return int(src.local_rows[starts, 1].sum())
