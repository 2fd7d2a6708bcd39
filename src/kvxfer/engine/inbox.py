"""The consumer's notification inbox: a background thread that drains every local rank's
NIXL notifications (bounded: nothing piles up, even on a pull-only consumer) and hands
push notices to the live request attempt they name.

A notice is obeyed only when all of these hold: its ``attempt`` is live here, its
request id matches that attempt's, it came from the agent of the producer rank the
attempt is bound to (the sender name comes with the NIXL notification), and it names
that rank's generation. Anything else is counted and dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from kvxfer.engine.rank import RankCache
from kvxfer.engine.transfer import Transfer
from kvxfer.errors import KvxferError
from kvxfer.transport.nixl import XferOp
from kvxfer.wire import Failed, PushFailure, WriteDone, decode_msg
from kvxfer.wire.messages import Cancelled

__all__ = ["Inbox"]

log = logging.getLogger(__name__)

BUSY_S = 0.0005  # drain interval while push attempts are live (they wait for notices)
IDLE_S = 0.01  # otherwise (unsolicited notices still drain: bounded memory)


class Inbox:
    """Live push attempts by attempt id, and the thread that drains notifications.

    Thread-safe: :meth:`add`, :meth:`discard`, :meth:`status`, :meth:`live`,
    :meth:`pending_pushes`, :meth:`push_failed` and :meth:`settle_generations` may be
    called from any thread; the attempt sets of a
    Transfer are read and written under the inbox lock only.

    Args:
        ranks: the consumer's local ranks (whose notifications are drained).
        on_quarantine: called (from the drain thread, outside the lock) once for each
            push attempt that ended without DONE while its producer may still write:
            the consumer then watches for proof that the producer process is gone.
    """

    def __init__(
        self,
        ranks: Mapping[int, RankCache],
        on_quarantine: Callable[[Transfer], None] | None = None,
    ) -> None:
        self._ranks = dict(ranks)
        self._on_quarantine = on_quarantine
        self._live: dict[int, Transfer] = {}
        self._quarantined: set[int] = set()  # attempts reported to on_quarantine
        self._num_push = 0  # live push attempts (pull ones need no fast drain)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.num_rejected = 0  # malformed or unexpected notices
        self.num_stale = 0  # attempts not live here (late, retried, or forged ids)
        self.num_forged = 0  # from an agent the attempt is not bound to
        self._logged_error = False
        self._thread = threading.Thread(target=self._run, name="kvxfer-inbox", daemon=True)
        self._thread.start()

    def add(self, t: Transfer) -> None:
        with self._lock:
            self._live[t.attempt] = t
            self._num_push += t.op is XferOp.WRITE

    def discard(self, t: Transfer) -> None:
        with self._lock:
            self._quarantined.discard(t.attempt)
            if self._live.pop(t.attempt, None) is not None:
                self._num_push -= t.op is XferOp.WRITE

    def live(self) -> list[Transfer]:
        with self._lock:
            return list(self._live.values())

    def pending_pushes(self, address: str, posted_before: float) -> tuple[int, ...]:
        """The attempts of pushes to the producer at ``address``, posted before
        ``posted_before`` (``time.perf_counter``), with a producer rank that has neither
        written nor settled: ended ones too (FAILED by one rank's failure, a TIMEOUT),
        whose blocks stay quarantined until every rank settled."""
        with self._lock:
            if not self._num_push:  # a pull-only consumer: nothing to scan each heartbeat
                return ()
            return tuple(
                a for a, t in self._live.items()
                if t.op is XferOp.WRITE and 0 < t.posted_at < posted_before
                and t.peer.address == address and not t.expected <= (t.written | t.settled)
            )  # fmt: skip

    def push_failed(self, address: str, failures: tuple[PushFailure, ...]) -> int:
        """Failures the producer at ``address`` reported over its side channel (it could
        not send ``Failed``: this consumer's agent was never loaded there, so nothing of
        the attempt was written). Each is obeyed as ``Failed`` is, if it names a live
        push to ``address`` and a rank and generation that push is bound to. Returns
        how many were obeyed."""
        n = 0
        with self._lock:
            for f in failures:
                t = self._live.get(f.attempt)
                if (
                    t is None or t.request_id != f.request_id or t.op is not XferOp.WRITE
                    or t.peer.address != address
                ):  # fmt: skip
                    self.num_stale += 1
                    continue
                if t.peer.generations.get(f.producer_rank) != f.generation:
                    self.num_forged += 1
                    continue
                if (f.consumer_rank, f.producer_rank) not in t.expected:
                    continue  # not (yet) asked of that rank: asked again next heartbeat
                if t.failed_reason is None:
                    t.failed_reason = (
                        f"{f.reason} (said over its side channel: its push could not "
                        "reach this consumer's agent, so nothing was written)"
                    )
                t.settled.add((f.consumer_rank, f.producer_rank))
                n += 1
        return n

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    def status(self, t: Transfer) -> tuple[bool, str | None, bool]:
        """``(every expected rank wrote, the producer's failure reason, every expected
        rank wrote or confirmed cancellation)`` of a push attempt."""
        with self._lock:
            done = t.expected <= t.written
            return done, t.failed_reason, t.expected <= (t.written | t.settled)

    def settle_generations(self, generations: set[int]) -> int:
        """Producer incarnations ``generations`` are proven ended (their process exited
        or was replaced): nothing of theirs can land any more, so the ranks running them
        count as settled in every live push attempt (not as written: such an attempt
        never becomes DONE). Returns how many (local, remote) rank pairs were settled."""
        n = 0
        if not generations:
            return n
        with self._lock:
            for t in self._live.values():
                if t.op is not XferOp.WRITE:
                    continue
                gens = t.peer.generations
                for d, r in t.expected - t.written - t.settled:
                    if gens.get(r) in generations:
                        t.settled.add((d, r))
                        n += 1
        if n:
            log.info("settled %d push rank(s) of ended producers %s", n, sorted(generations))
        return n

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(BUSY_S if self._num_push else IDLE_S):
            try:
                self.drain()
            except Exception as e:  # the loop survives anything; say so once
                if not self._logged_error:
                    self._logged_error = True
                    log.exception("notification drain failed (logged once): %s", e)

    def drain(self) -> None:
        """Take every rank's notifications and dispatch them; prune settled attempts."""
        for d, cache in self._ranks.items():
            if self._stop.is_set():
                return
            try:
                notifs = cache.backend.get_notifs()
            except KvxferError as e:
                log.debug("rank %d: notifications: %s", d, e)
                continue
            for agent, msgs in notifs.items():
                for raw in msgs:
                    self._dispatch(d, agent, raw)
        now = time.monotonic()
        fresh: list[Transfer] = []
        lingering: list[Transfer] = []
        with self._lock:
            for a, t in list(self._live.items()):
                if not t.state.is_terminal:
                    continue
                if t.lingering:  # READs left running at its end: polled below, kept
                    lingering.append(t)
                    continue
                if t.expected <= (t.written | t.settled) or now >= t.quarantine_until:
                    del self._live[a]
                    self._quarantined.discard(a)
                    self._num_push -= t.op is XferOp.WRITE
                elif a not in self._quarantined:
                    self._quarantined.add(a)
                    fresh.append(t)
        if self._on_quarantine is not None:
            for t in fresh:
                self._on_quarantine(t)
        for t in lingering:  # outside our lock; the engine lock only if free (close()
            if self._stop.is_set():  # holds it while it joins this thread)
                return
            t._linger_poll(blocking=False)  # releases the READs that ended (pruned next round)

    def _dispatch(self, d: int, agent: str, raw: bytes) -> None:
        try:
            msg = decode_msg(raw)
        except KvxferError:
            self.num_rejected += 1
            return
        if not isinstance(msg, WriteDone | Failed | Cancelled):
            self.num_rejected += 1
            return
        with self._lock:
            t = self._live.get(msg.attempt)
            if t is None or t.request_id != msg.request_id:
                self.num_stale += 1
                return
            agents, gens = t.peer.agents, t.peer.generations
            rank = next((r for r, name in agents.items() if name == agent), None)
            if rank is None or gens.get(rank) != msg.generation:
                self.num_forged += 1
                return
            if isinstance(msg, Failed):
                if t.failed_reason is None:
                    t.failed_reason = msg.reason or "failed"
                t.settled.add((d, rank))  # sent after its WRITE was released: no more lands
                return
            if msg.producer_rank != rank:
                self.num_forged += 1
                return
            (t.written if isinstance(msg, WriteDone) else t.settled).add((d, rank))
