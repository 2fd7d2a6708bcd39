"""One request in flight on the consumer side: the :class:`Transfer` handle and its state
machine (PENDING until first contact, post and completion; then one terminal state),
driven through the narrow :class:`RequestContext` its consumer hands it. The producer it
names is a :class:`~kvxfer.engine.peer.PeerInfo`; waiting on its end is
:class:`~kvxfer.engine.request_end.RequestEnd`'s."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxfer.engine.config import EngineConfig, RequestState
from kvxfer.engine.holds import DIGEST, HoldVerdict, binding_matches, slot_of, verdict
from kvxfer.engine.peer import PeerInfo
from kvxfer.engine.rank import RankCache
from kvxfer.engine.relayout import relayout_bsr
from kvxfer.engine.request_end import RequestEnd
from kvxfer.errors import (
    CancelledError,
    ClosedError,
    DeadlineError,
    HoldEndedError,
    HoldMismatchError,
    KvxferError,
    LeaseExpiredError,
    PeerLostError,
    TransferError,
)
from kvxfer.planning.plans import PeerPlan
from kvxfer.planning.request import RequestIds
from kvxfer.transport.backend import XferHandleLike
from kvxfer.transport.nixl import XferOp, XferState
from kvxfer.wire import Abort, LeaseRenew, PushRequest, ReadDone, encode_msg

__all__ = ["RequestContext", "Transfer", "new_attempt", "num_bytes"]

log = logging.getLogger(__name__)

CHECK_AGAIN_S = 0.001  # a hold not started yet: its slot is read again this much later
CHECK_QUARANTINE_S = 60.0  # a check slot whose READ was released in flight: not reused


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What a :class:`Transfer`'s state machine needs from the consumer that owns it (a
    narrow context, so requests do not import the consumer). One per consumer, shared
    by all its transfers; every step of the machine runs under ``lock``."""

    config: EngineConfig
    ranks: Mapping[int, RankCache]  # the consumer's local ranks by TP rank
    lock: threading.RLock  # the consumer's engine lock (NIXL calls + peer bookkeeping)
    generation: int  # the consumer's incarnation (push requests name it)
    address: Callable[[], str]  # its side-channel endpoint (producers fetch records there)
    is_closed: Callable[[], bool]
    agents_gone: Callable[[], bool]  # close() has closed the agents: nothing lands any more
    push_status: Callable[[Transfer], tuple[bool, str | None, bool]]  # Inbox.status
    record: Callable[[Transfer], None]  # count an ended request in the consumer's stats
    drop_peer: Callable[[PeerInfo], None]  # forget a dead or restarted producer
    recheck: Callable[[Transfer], None]  # refetch generations for a request pinned elsewhere
    watch: Callable[[Transfer], None]  # the progress thread drives it until it ends
    ended: Callable[[int], bool]  # whether a producer generation is proven ended
    watch_end: Callable[[Transfer], None]  # probe its producer until proven gone (quarantine)


def _wire_ids(ids: npt.NDArray[np.int64]) -> tuple[int, ...]:
    """Block ids as a PushRequest carries them."""
    return tuple(int(i) for i in ids)


def _pinned_ok(pin: int | Mapping[int, int], generations: Mapping[int, int]) -> bool:
    """Whether the producer ranks still run the generation(s) a request was pinned to."""
    if isinstance(pin, int):
        return set(generations.values()) == {pin}
    return all(generations.get(rank) == gen for rank, gen in pin.items())


def new_attempt() -> int:
    """A random nonzero 63-bit id for one request attempt (0 means "none" on the wire)."""
    return secrets.randbits(63) or 1


@dataclass(slots=True, eq=False)
class Transfer(RequestEnd):
    """One request attempt moved by every (selected) local rank. Poll or wait; never
    blocks forever.

    Thread-safety: one Transfer is driven by one caller thread at a time (poll, wait,
    result, cancel); each step of its state machine (:meth:`poll`, :meth:`cancel`) runs
    under the consumer's engine lock (``context.lock``); the consumer's notification
    thread only adds to ``written``, ``settled`` and ``failed_reason`` under the
    consumer's inbox lock.

    ``attempt`` is unique per read()/push() call and carried by every notification
    about it; a notice for another attempt of the same request id is dropped.
    """

    request_id: str
    context: RequestContext
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
    xfers: list[tuple[int, XferHandleLike]] = field(default_factory=list)  # (local rank, handle)
    notify: list[tuple[int, int]] = field(default_factory=list)  # (local rank, remote rank)
    expected: set[tuple[int, int]] = field(default_factory=set)  # push: (local, producer rank)
    generation: int | Mapping[int, int] | None = None  # the producer incarnation(s) holding it
    rechecked: bool = False
    recheck: Future[dict[int, int]] | None = None  # refetched generations (wrong pin?)
    keep_peer: bool = False  # a failure of this request alone: do not drop the peer
    abort_sent: bool = False  # its producer was told to free the blocks (send_abort)
    attempt: int = field(default_factory=new_attempt)
    written: set[tuple[int, int]] = field(default_factory=set)  # push: WriteDone seen
    settled: set[tuple[int, int]] = field(default_factory=set)  # push: Cancelled seen
    failed_reason: str | None = None  # push: the producer's Failed notice
    lease_expires_at_ns: int | None = None  # pull: the producer's lease end (its wall clock)
    hold_ticket: int = 0  # the hold's ticket, checked after the READ / WRITEs (0: none)
    hold_digest: bytes = b""  # the binding digest of these params (kvxfer.engine.holds)
    unbound_digest: bytes = b""  # the ticket's marker of a hold that binds nothing
    binding_rechecks: int = 0  # checks read again after a digest that differed
    read_pairs: list[tuple[int, int]] = field(default_factory=list)  # (local, remote rank)
    checks: list[tuple[int, int, int]] = field(default_factory=list)  # (local, remote, word)
    check_after: float = 0.0  # monotonic: a hold not started yet is checked again then
    num_checks: int = 0  # hold checks posted (a hold not started yet costs more than one)
    quarantine_until: float = 0.0  # monotonic bound of the quarantine (see RequestState)
    # READs still in progress when the request ended: not released (that does not stop
    # them), polled by `quarantined` until they end; one released by someone else (a
    # dropped peer's remove_remote) cannot be polled and counts until quarantine_until
    lingering: list[tuple[int, XferHandleLike]] = field(default_factory=list)
    end_watched: bool = False  # its producer is probed until proven gone (a lost READ)
    linger_warned: bool = False  # a lingering READ's poll failure was logged as a warning
    _ended: threading.Event = field(default_factory=threading.Event, repr=False)
    _on_end: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def _engine_lock(self) -> threading.RLock:
        return self.context.lock

    def _watch(self) -> None:
        self.context.watch(self)

    @property
    def quarantined(self) -> bool:
        """True while bytes may still land in this request's local blocks after it ended
        without DONE: a READ of ours NIXL still runs (pull, and a push's hold check), or
        a push whose producer has not confirmed cancellation yet. Do not reuse the
        blocks until it turns False (the design is on :class:`RequestState`). Each call
        polls the READs left running, and releases those that ended."""
        if self.state is RequestState.DONE:
            return False
        lingering = self._linger_poll()
        if self.op is not XferOp.WRITE or not self.expected:
            return lingering
        if not self.state.is_terminal:
            return True
        _, _, settled = self.context.push_status(self)
        return lingering or (not settled and time.monotonic() < self.quarantine_until)

    def _linger_poll(self, blocking: bool = True) -> bool:
        """Whether a READ of this ended request may still land; releases those that ended.
        ``blocking=False`` (the inbox thread): if the engine lock is busy, poll nothing
        and answer as last known (close() holds that lock while it joins the inbox)."""
        if not self.lingering:
            return False
        ctx = self.context
        if not ctx.lock.acquire(blocking=blocking):
            return bool(self.lingering)
        try:
            if ctx.agents_gone():  # and their workers: nothing lands (not merely closing:
                self.lingering = []  # close() closes the agents last)
                return False
            gone = all(ctx.ended(g) for g in self.peer.generations.values())
            running = []
            for d, x in self.lingering:
                if x.is_lost:  # released with its dropped peer: cannot be polled
                    if gone:
                        continue  # its producer's process is proven gone
                    if not self.end_watched:  # probe the producer until it is proven gone
                        self.end_watched = True
                        ctx.watch_end(self)
                elif x.is_released or not self._still_running(d, x):
                    continue  # ended (released by this request, or now)
                running.append((d, x))
            if running and time.monotonic() >= self.quarantine_until:
                log.warning(
                    "request %r: %d READ(s) still in progress at the bound of its "
                    "quarantine (deadline + lease_s); released, its blocks are free "
                    "(see RequestState)", self.request_id, len(running),
                )  # fmt: skip
                for _, x in running:
                    try:
                        x.release()
                    except Exception as e:  # left to the agent's teardown
                        log.warning("request %r: release at the bound: %r", self.request_id, e)
                running = []
            self.lingering = running
            return bool(running)
        finally:
            ctx.lock.release()

    def _quarantine_to_bound(self) -> None:
        """Bytes may land after the end: the blocks stay quarantined until, at the latest,
        ``deadline + lease_s`` (see :class:`RequestState`)."""
        self.quarantine_until = self.deadline + self.context.config.lease_s

    def _still_running(self, d: int, x: XferHandleLike) -> bool:
        """Poll a READ of this request; release it if it ended (done or failed). A release
        NIXL refuses (it could not cancel it) keeps it running. Engine lock held."""
        try:
            if self.context.ranks[d].backend.poll(x) is XferState.IN_PROGRESS:
                return True
        except KvxferError:
            pass  # it failed: nothing more of it lands
        except Exception as e:  # a binding bug: no verdict, so running until the bound
            self._warn_once("polling a READ left running", e)
            return True
        try:
            x.release()
        except Exception as e:  # NIXL kept it (could not cancel): still running
            self._warn_once("release of an ended READ", e)
            return True
        return False

    def _warn_once(self, what: str, e: BaseException) -> None:
        """Log a lingering READ's poll or release failure: once as a warning, then at
        debug (it is polled every 10 ms until its bound)."""
        level = logging.DEBUG if self.linger_warned else logging.WARNING
        self.linger_warned = True
        log.log(level, "request %r: %s: %r (polled again until the quarantine's bound)",
                self.request_id, what, e)  # fmt: skip

    def cancel(self) -> RequestState:
        """Give up on the request: it ends ABORTED (unless already terminal) and the
        producer is told (it frees the blocks; a push stops writing, see
        :attr:`quarantined`). Returns the final state."""
        with self.context.lock:
            if not self.state.is_terminal:
                self._fail_surely(
                    CancelledError(f"request {self.request_id!r} cancelled by the caller")
                )
        return self.state

    def poll(self) -> RequestState:
        """Advance the request's state machine and return its state (terminal states stay
        put)."""
        if self.state.is_terminal:
            return self.state
        ctx = self.context
        with ctx.lock:
            if self.state.is_terminal:  # another thread ended it while this one waited
                return self.state  # (a second _finish relaid its bytes out again)
            if ctx.is_closed():
                self._fail_surely(
                    ClosedError(f"consumer closed: request {self.request_id!r} aborted")
                )
                return self.state
            return self._step()

    @property
    def latency_s(self) -> float:
        return (self.finished_at or time.perf_counter()) - self.started_at

    # -- the state machine (every step under the engine lock) ------------------------

    def _step(self) -> RequestState:
        """One step of the state machine (the engine lock held, the consumer open)."""
        ctx = self.context
        try:
            if self.abort_sent:  # its producer was told to free the blocks: never DONE
                raise self.peer.error or PeerLostError(
                    f"request {self.request_id!r}: {self.peer.address} was dropped"
                )
            if time.monotonic() >= self.deadline:
                raise DeadlineError(
                    f"request {self.request_id!r} passed its deadline {self._where()}"
                )
            if not self.posted_at:
                if not self.peer.ready.is_set():
                    return self.state
                pinned_elsewhere = self.generation is not None and not _pinned_ok(
                    self.generation, self.peer.generations
                )
                if self.peer.error is not None:
                    if pinned_elsewhere and isinstance(self.peer.error, PeerLostError):
                        # the incarnation that was lost is not the one this request is
                        # pinned to (a heartbeat saw the restart first): contact it again
                        ctx.recheck(self)
                        return self.state
                    raise self.peer.error
                if pinned_elsewhere:
                    ctx.recheck(self)  # raises, or re-handshakes a restarted producer
                    return self.state
                if self.lease_expires_at_ns is not None and time.time_ns() >= (
                    self.lease_expires_at_ns - int(ctx.config.lease_margin_s * 1e9)
                ):
                    raise LeaseExpiredError(
                        f"request {self.request_id!r}: the producer's lease ended; not read"
                    )
                self._post()
            if self.op is XferOp.WRITE:
                done, reason, settled = ctx.push_status(self)
                if reason is not None:
                    raise TransferError(f"producer failed to push {self.request_id!r}: {reason}")
                if not done:
                    if self.peer.error is not None:  # the heartbeat saw the producer die
                        raise self.peer.error
                    if settled:  # every rank wrote, confirmed a cancel or is gone: no WRITE
                        raise TransferError(  # comes (its deadline, on its clock, passed)
                            f"producer cancelled the push of {self.request_id!r} before "
                            "writing it all (its deadline, counted on its clock, passed "
                            "first), or its process is gone"
                        )
                    return self.state
                if not self.hold_ticket:
                    self._finish()
                    return self.state
                if not self.read_pairs:  # every WRITE landed: check the ranks that wrote
                    self.read_pairs = sorted(self.expected)
            else:
                self._renew()
            self._poll_xfers()
            if not self.xfers and self.hold_ticket:
                if not self.checks:
                    self._post_checks()  # the data has landed: was the hold still alive?
                    self._poll_xfers()
                if self.checks and not self.xfers:
                    self._judge_checks()
            if not self.xfers and not self.checks and not self.check_after:
                self._finish()
        except KvxferError as e:
            self._fail_surely(e)
        except Exception as e:  # a half-done step (some sources posted, some
            # ranks relaid out) must never be finished by a later poll: the request fails
            log.exception("request %r: unexpected error in its step", self.request_id)
            self._fail_surely(TransferError(f"request {self.request_id!r}: internal error: {e!r}"))
        return self.state

    def _fail_surely(self, error: KvxferError) -> None:
        """:meth:`_fail`, and if failing raises (a bug, MemoryError), end anyway: FAILED if
        it was not terminal yet (a later poll must never finish a half-done step DONE;
        what was posted then counts as running, quarantined until its bound), and its
        end event and callbacks in any case (waiters would sleep until the deadline)."""
        try:
            self._fail(error)
        except Exception as e:
            log.exception("request %r: error while failing it", self.request_id)
            if not self.state.is_terminal:
                self.state = RequestState.FAILED  # first: nothing below may leave it PENDING
                self.finished_at = time.perf_counter()
                self._quarantine_to_bound()
                self.lingering = self.lingering or [
                    (d, x) for d, x in self.xfers if x.is_lost or not x.is_released
                ]  # fmt: skip
                self.xfers = []
                try:
                    self.error = TransferError(f"{error}; then failing it raised {e!r}")
                except Exception:  # a repr that raises (MemoryError)
                    self.error = TransferError(f"request {self.request_id!r} failed")
            if not self._ended.is_set():
                self._ended_now()

    def _poll_xfers(self) -> None:
        backends = self.context.ranks
        pending = []
        for d, x in self.xfers:
            if backends[d].backend.poll(x) is XferState.IN_PROGRESS:
                pending.append((d, x))
            else:
                x.release()
        self.xfers = pending

    def _post_checks(self) -> None:
        """READ the hold's slot word from every producer rank this request read
        (:mod:`kvxfer.engine.holds`), each into a word of our own."""
        if time.monotonic() < self.check_after:
            return
        self.check_after = 0.0
        ctx, peer = self.context, self.peer
        for d, r in self.read_pairs:
            cache = ctx.ranks[d]
            table = peer.hold_lists.get((d, r))
            if table is None:  # dropped while this check waited (a hold not started yet)
                raise PeerLostError(
                    f"request {self.request_id!r}: {peer.address} was dropped before its hold check"
                )
            _, slots = peer.holds[r]
            i = cache.next_word()
            try:
                x = cache.backend.make_xfer(
                    XferOp.READ, cache.words_list_ready(), np.array([i], np.int32),
                    table, np.array([slot_of(self.hold_ticket, slots)], np.int32),
                )  # fmt: skip
            except BaseException:
                cache.free_word(i)  # nothing was posted into it
                raise
            self.xfers.append((d, x))
            self.checks.append((d, r, i))
            self.num_checks += 1
            cache.backend.post(x)

    def _judge_checks(self) -> None:
        """Every slot has landed: DONE only if each says the hold is alive, and was made
        for these params (its binding digest, :mod:`kvxfer.engine.holds`)."""
        ctx, ticket = self.context, self.hold_ticket
        words, strangers = [], []
        for d, r, i in self.checks:
            slot = ctx.ranks[d].words[i]
            word, digest = int(slot[0]), slot[DIGEST].tobytes()
            ctx.ranks[d].free_word(i)
            words.append((r, word))
            if verdict(word, ticket) is HoldVerdict.HELD and not binding_matches(
                digest, self.hold_digest, self.unbound_digest
            ):
                strangers.append(r)
        self.checks = []
        if strangers and self.binding_rechecks < len(self.read_pairs):
            # again before failing (once per rank read, at most): a check that raced the
            # hold's start can see its new word beside the slot's previous digest (a
            # false failure, never a false DONE; the producer writes the digest first)
            self.binding_rechecks += 1
            self.check_after = time.monotonic() + CHECK_AGAIN_S
            return
        if strangers:
            raise HoldMismatchError(
                f"request {self.request_id!r}: hold {ticket} at {self.peer.address} (rank "
                f"{strangers[0]}) was made for other params: its request id, block ids or "
                "binding (in vLLM: the prompt) do not match these (forged or mixed-up "
                f"params); the bytes of the {self.op.value} are not reported, and the "
                "producer is not told (the hold is someone else's)"
            )
        verdicts = {verdict(w, ticket): (r, w) for r, w in words}
        if HoldVerdict.RELEASED in verdicts:
            r, w = verdicts[HoldVerdict.RELEASED]
            raise HoldEndedError(
                f"request {self.request_id!r}: {self.peer.address} rank {r} had ended hold "
                f"{ticket} (slot word {w:#x}) when its {self.op.value} was checked: another "
                "reader read these params first, an abort or the lease freed the blocks, "
                f"which may have been reused under the {self.op.value}; its bytes are not "
                "reported"
            )
        if HoldVerdict.NOT_YET in verdicts:  # the producer has not started the hold yet
            self.check_after = time.monotonic() + CHECK_AGAIN_S
            return
        self._send_read_done(self.read_pairs)  # only now may the producer free the blocks

    def _send_read_done(self, pairs: list[tuple[int, int]]) -> None:
        """Tell each producer rank in ``pairs`` (local, remote rank) that it was read."""
        ctx, peer = self.context, self.peer
        for d, r in pairs:
            size = ctx.ranks[d].spec.tp_size
            done = ReadDone(
                self.request_id, peer.generations[r], d, size, self.attempt, self.hold_ticket,
                self.hold_digest,
            )  # fmt: skip
            ctx.ranks[d].backend.send_notif(peer.agents[r], encode_msg(done))

    def _where(self) -> str:
        """Where the request stood: the first-contact phase, or its transfers in flight."""
        now, peer = time.perf_counter(), self.peer
        if not self.posted_at:
            if not peer.ready.is_set():
                return (f"in first contact with {peer.address}: phase {peer.phase!r} "
                        f"under way for {now - peer.phase_at:.3f} s")  # fmt: skip
            return f"before its {self.op.value} from {peer.address} was posted"
        since = f"posted {now - self.posted_at:.3f} s before"
        if self.op is XferOp.WRITE:
            waiting = len(self.expected - self.written)
            return (f"waiting for the push from {peer.address} ({since}): {waiting} of "
                    f"{len(self.expected)} producer rank(s) had not confirmed")  # fmt: skip
        if self.check_after or self.checks:
            return (f"checking hold {self.hold_ticket} at {peer.address} after its READ "
                    f"({since}, {self.num_checks} checks: the producer had not started "
                    "the hold)")  # fmt: skip
        return (f"with {len(self.xfers)} READ(s) from {peer.address} still in flight "
                f"({self.num_descriptors} descriptors, {since})")  # fmt: skip

    def _renew(self, force: bool = False) -> None:
        """Renew the producer's lease on a request still in flight (every heartbeat_s), to
        cover what is left of the request's deadline."""
        ctx = self.context
        now = time.perf_counter()
        if not force and now - max(self.posted_at, self.renewed_at) < ctx.config.heartbeat_s:
            return
        self.renewed_at = now
        budget_ms = self._budget_ms()
        tickets = (self.hold_ticket,) if self.hold_ticket else ()
        digests = (self.hold_digest,) if self.hold_ticket else ()
        for rank, agent in self.peer.agents.items():
            gen = self.peer.generations[rank]
            msg = encode_msg(
                LeaseRenew((self.request_id,), gen, (self.attempt,), budget_ms, tickets, digests)
            )
            for d in self.ranks:
                ctx.ranks[d].backend.send_notif(agent, msg)

    def _post(self) -> None:
        ctx = self.context
        peer = self.peer
        self.posted_at = time.perf_counter()
        if self.hold_ticket:
            self._check_hold_tables()
        if self.op is XferOp.WRITE:
            self._post_push()
            return
        self._renew(force=True)  # first: the producer's lease now covers the deadline
        for d in self.ranks:
            plan = peer.plans[d]
            req = self.ids.plan(plan)
            backend = ctx.ranks[d].backend
            size = ctx.ranks[d].spec.tp_size
            for ids in req.sources:
                if ids.num_descriptors == 0:
                    self.notify.append((d, ids.rank))
                    continue
                loc, rem = peer.lists[(d, ids.rank)]
                gen = peer.generations[ids.rank]
                msg = b""  # with a ticket, ReadDone goes after the hold check
                if not self.hold_ticket:
                    msg = encode_msg(ReadDone(self.request_id, gen, d, size, self.attempt))
                self.read_pairs.append((d, ids.rank))
                x = backend.make_xfer(XferOp.READ, loc, ids.local_ids, rem, ids.remote_ids, msg)
                self.xfers.append((d, x))
                self.num_descriptors += ids.num_descriptors
                self.num_bytes += num_bytes(plan, ids.rank, ids.local_ids)
                if backend.post(x) is XferState.DONE:
                    pass  # polled (and released) below
            self.notify.extend((d, r) for r in req.notify_only)

    def _check_hold_tables(self) -> None:
        peer = self.peer
        for d in self.ranks:
            for src in peer.plans[d].sources:
                if (d, src.rank) not in peer.hold_lists:
                    raise TransferError(
                        f"request {self.request_id!r} has hold ticket {self.hold_ticket}, but "
                        f"{peer.address} rank {src.rank} publishes no hold table (an older "
                        "kvxfer?): the read could not be checked, so it is not made"
                    )

    def _post_push(self) -> None:
        ctx = self.context
        peer = self.peer
        self._quarantine_to_bound()
        for d in self.ranks:
            req = self.ids.plan(peer.plans[d])
            ls, rs = self.ids.local_state, self.ids.remote_state  # None: none named
            backend = ctx.ranks[d].backend
            for ids in req.sources:
                msg = PushRequest(
                    self.request_id, peer.generations[ids.rank], ctx.address(), d,
                    ctx.ranks[d].spec.tp_size,
                    _wire_ids(self.ids.local), _wire_ids(self.ids.remote),
                    local_state_ids=None if ls is None else _wire_ids(ls),
                    remote_state_ids=None if rs is None else _wire_ids(rs),
                    num_cached_blocks=int(self.ids.num_cached_blocks),
                    attempt=self.attempt,
                    budget_ms=self._budget_ms(),
                    sent_at_ns=time.time_ns(),
                    consumer_generation=ctx.generation,
                    ticket=self.hold_ticket,
                )  # fmt: skip
                backend.send_notif(peer.agents[ids.rank], encode_msg(msg))
                self.expected.add((d, ids.rank))
                self.num_descriptors += ids.num_descriptors
                self.num_bytes += num_bytes(peer.plans[d], ids.rank, ids.local_ids)
            self.notify.extend((d, r) for r in req.notify_only)

    def _budget_ms(self) -> int:
        """What is left of the deadline, in ms (within the wire's hour: deadlines are
        checked against it, :func:`~kvxfer.engine.config.check_deadline`)."""
        return max(0, int((self.deadline - time.monotonic()) * 1000))

    def _finish(self) -> None:
        ctx = self.context
        self._send_read_done(self.notify)  # ranks not read (MLA, GQA dedup, empty) may free
        for d in self.ranks:
            plan = self.peer.plans[d]
            if plan.kernel_bsr > 1:
                cached = int(self.ids.num_cached_blocks)
                cache = ctx.ranks[d]
                relayout_bsr(
                    cache.spec, cache.host_bufs(), self.ids.local[cached:], plan.kernel_bsr
                )
        self.finished_at = time.perf_counter()
        self.state = RequestState.DONE
        ctx.record(self)
        self._ended_now()

    def _fail(self, error: KvxferError) -> None:
        ctx = self.context
        # READs that ended are released; one still in progress is kept and polled until it
        # ends (`quarantined`): releasing it does not stop it (UCX over TCP serves it when
        # the producer runs again, and its bytes land in blocks the caller reused)
        self.lingering = [
            (d, x)
            for d, x in self.xfers
            if x.is_lost or (not x.is_released and self._still_running(d, x))
        ]  # (one released with a dropped peer cannot be polled: see _linger_poll)
        if self.lingering:
            self._quarantine_to_bound()
        held_for = max(CHECK_QUARANTINE_S, self.quarantine_until - time.monotonic())
        for d, _, i in self.checks:  # a check READ still in flight may land later
            self.context.ranks[d].free_word(i, held_for if self.lingering else 0.0)
        self.checks = []
        self.xfers = []
        if (
            isinstance(self.peer.error, PeerLostError)
            and error is not self.peer.error
            and not self.keep_peer
            and not isinstance(error, DeadlineError | ClosedError | CancelledError)
        ):  # a heartbeat drop surfaced as a NIXL error or a stale handle: PEER_LOST, with
            # the heartbeat's reason (why the peer was dropped), not the handle's
            error = self.peer.error
        self.error = error
        self.finished_at = time.perf_counter()
        if isinstance(error, PeerLostError):
            self.state = RequestState.PEER_LOST
            ctx.record(self)
            if not self.keep_peer:  # (keep_peer: a request never posted to this peer)
                self.send_abort(self.state)  # skipped if its agents are gone (a drop sent it)
                ctx.drop_peer(self.peer)
            self._ended_now()
            return
        if isinstance(error, ClosedError | CancelledError):
            self.state = RequestState.ABORTED
        elif isinstance(error, DeadlineError):
            self.state = RequestState.TIMEOUT
        else:
            self.state = RequestState.FAILED
        ctx.record(self)
        if isinstance(error, HoldMismatchError):
            self._ended_now()  # the hold is not this request's: its abort would free it
            return
        self.send_abort(self.state)  # tell every producer rank it may free the blocks
        self._ended_now()

    def send_abort(self, state: RequestState) -> None:
        """Tell every producer rank of a posted request that it may free the blocks
        (``Abort``, naming ``state``); best effort: a rank whose agent is gone is skipped.
        Engine lock held. Also called as its peer is dropped, before its agents go: a
        producer the heartbeat took for lost may be alive, and would hold them until
        their lease."""
        if not (self.posted_at and self.peer.agents) or self.abort_sent:
            return
        self.abort_sent = True  # from here on, _step ends it PEER_LOST (never DONE)
        ranks = self.context.ranks
        for rank, agent in self.peer.agents.items():
            gen = self.peer.generations[rank]
            abort = Abort(
                self.request_id, gen, state.value, self.attempt, self.hold_ticket,
                self.hold_digest,
            )  # fmt: skip
            try:
                msg = encode_msg(abort)
            except KvxferError as e:  # never stops the caller (a request's end, a drop)
                log.warning("request %r: abort notice not sent: %s", self.request_id, e)
                return
            for d in self.ranks:
                try:
                    ranks[d].backend.send_notif(agent, msg)
                except KvxferError as e:
                    log.debug("abort notice to %s: %s", agent, e)


def num_bytes(plan: PeerPlan, rank: int, local_ids: npt.NDArray[np.int32]) -> int:
    """Bytes moved by descriptors ``local_ids`` of source ``rank``'s local list."""
    src = next(s for s in plan.sources if s.rank == rank)
    starts = np.searchsorted(src.local_starts, local_ids, side="right") - 1  # row of each id
    return int(src.local_rows[starts, 1].sum())
