"""The producer (prefill) side: registers its cache, serves records, frees read blocks."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np

from kvxfer.engine.config import Buffer, EngineConfig, check_lease, check_request_id
from kvxfer.engine.holds import (
    DIGEST,
    TicketBook,
    check_binding,
    held_word,
    hold_digest,
    released_word,
    slot_of,
    unbound_digest,
)
from kvxfer.engine.leases import FreeReason, Lease, LeaseTable
from kvxfer.engine.pusher import PushWorker
from kvxfer.engine.rank import (
    RankCache,
    close_after_failed_start,
    close_each,
    encode_records,
    new_generation,
    serve_records,
)
from kvxfer.errors import ClosedError, ConfigError, KvxferError
from kvxfer.layout.spec import LayoutSpec
from kvxfer.transport.backend import BackendFactory
from kvxfer.wire import (
    Abort,
    Failed,
    Heartbeat,
    LeaseRenew,
    PushRequest,
    ReadDone,
    compat_hash,
    decode_msg,
)

__all__ = ["Producer"]

log = logging.getLogger(__name__)

BUSY_S = 0.0005  # drain interval while push mode is in use: a PushRequest starts a WRITE
IDLE_S = 0.002  # otherwise: ReadDone, LeaseRenew and Abort only free or extend holds
PUSH_ACTIVE_S = 10.0  # push mode counts as in use this long after its last PushRequest
EARLY_NOTICE_S = 10.0  # a ticketed ReadDone/Abort that overtook its hold waits this long for it
MAX_EARLY_NOTICES = 4096  # holds with such notices remembered at once (oldest forgotten first)
MAX_NOTICES_PER_HOLD = 64  # notices kept for one of them (a ReadDone or Abort per consumer rank)


class Producer:
    """A producer engine hosting ``len(ranks)`` TP ranks in this process.

    Args:
        config: engine settings (``side_channel_addr`` is bound here).
        ranks: per TP rank, its spec and its region buffers (which must outlive this): host
            ``uint8`` arrays, or :class:`~kvxfer.layout.model.DeviceBuffer` per region for
            memory given by address (a GPU's cache: VRAM), one kind and device per rank.
        backend_factory: builds each rank's transfer backend from its agent name
            (default: a NIXL agent); ``kvxfer.testing.MemoryBackend`` runs in one process.

    Blocks of a request are held from :meth:`hold` until every expected consumer has
    read them (a ``ReadDone`` notification per consumer rank), a consumer aborts, or
    the lease expires; :meth:`pop_freed` reports released requests.

    Thread-safety: :meth:`hold`, :meth:`pop_freed`, :meth:`wait_freed`,
    :attr:`held_blocks`, :attr:`num_held` and :meth:`close` may be called from any
    thread (the lease tables are under one lock).
    The engine thread alone drains notifications; the push thread alone posts, polls
    and releases WRITEs (see docs/architecture.md, "Threads and locks").
    """

    def __init__(
        self,
        config: EngineConfig,
        ranks: Sequence[tuple[LayoutSpec, Sequence[Buffer]]],
        *,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        if not ranks:
            raise ConfigError("a producer needs at least one rank")
        config.check()
        self.config = config
        self.generation = new_generation()
        self.facts = config.facts(ranks[0][0])  # what its compat hash covers
        self.compat_hash = compat_hash(self.facts)
        self._tp_size = ranks[0][0].tp_size
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._push_until = 0.0  # monotonic; owned by the engine thread (see _drain_interval)
        self.ranks: list[RankCache] = []
        try:
            for spec, bufs in ranks:
                name = f"{config.engine_id}-p{spec.tp_rank}-{self.generation:x}"
                self.ranks.append(
                    RankCache(spec, bufs, name, config, backend_factory, words=config.hold_slots)
                )
            self._tables = {r.rank: LeaseTable(config.lease_s) for r in self.ranks}
            self._book = TicketBook(config.hold_slots)  # hold tickets (kvxfer.engine.holds)
            self._tickets: dict[str, int] = {}  # held request -> its ticket
            # held request -> (its binding digest, whether made with a binding)
            self._digests: dict[str, tuple[bytes, bool]] = {}
            # (request, ticket) -> ticketed ReadDone/Abort notices that came before that
            # hold started: (rank, notice, monotonic arrival); applied when it starts
            self._early: dict[tuple[str, int], list[tuple[int, ReadDone | Abort, float]]] = {}
            self._pending_free: dict[str, set[int]] = {}
            self._held_ids: dict[str, frozenset[int]] = {}
            self._freed: list[tuple[str, FreeReason]] = []
            self._freed_ready = threading.Event()  # set while _freed is not empty
            self.num_rejected = 0
            self.num_errors = 0
            records = encode_records(self.ranks, self.generation, self.compat_hash, holds=True)
            self.server = serve_records(config, records, self.facts)
            self._pusher = PushWorker(
                {r.rank: r for r in self.ranks},
                self.generation,
                self.compat_hash,
                config.handshake_timeout_s,
                self._on_written,
                held_ids=self.held_block_ids,
                is_bound=self.is_bound,
                strided=config.strided,
                run_blocks=config.run_blocks,
                auth_key=config.auth_key,
                facts=self.facts,
            )
            self.server.set_push_status(self._pusher.failures)  # GetPushStatus
        except BaseException as e:
            close_after_failed_start(self.close, e, f"producer {config.engine_id!r}")
            raise
        self._thread = threading.Thread(target=self._run, name="kvxfer-producer", daemon=True)
        self._thread.start()
        self.warmed_up = threading.Event()  # set when the background warm-up has ended
        blobs = [(r, r.backend.metadata()) for r in self.ranks]
        self._warm = threading.Thread(
            target=self._warm_up, args=(blobs,), name="kvxfer-warm-up", daemon=True
        )
        self._warm.start()

    def _warm_up(self, blobs: list[tuple[RankCache, bytes]]) -> None:
        """Pay each rank's first-incoming-peer cost (:meth:`RankCache.warm_up_incoming`)
        in the background; owns nothing of the producer's but the ``warmed_up`` event."""
        try:
            for rank, blob in blobs:
                if self._stop.is_set():
                    return
                rank.warm_up_incoming(self.config, blob)
        except Exception as e:  # a warm-up never takes the producer down
            log.warning("producer warm-up failed: %r", e)
        finally:
            self.warmed_up.set()

    @property
    def address(self) -> str:
        """The side-channel endpoint consumers connect to (``advertise_addr`` if set)."""
        return self.config.advertise_addr or self.server.address

    @property
    def held_blocks(self) -> int:
        """Blocks held across all ranks (each rank holds its own copy of a request's blocks)."""
        with self._lock:
            return sum(t.held_blocks for t in self._tables.values())

    def hold(
        self,
        request_id: str,
        num_blocks: int | None = None,
        lease_s: float | None = None,
        *,
        block_ids: Sequence[int] | None = None,
        ticket: int | None = None,
        binding: bytes = b"",
    ) -> Lease:
        """Hold ``num_blocks`` blocks of ``request_id`` on every rank until read or expired.

        Args:
            request_id: the request (unique among held ones).
            num_blocks: blocks held (default: ``len(block_ids)``).
            lease_s: lease (default ``config.lease_s``); finite, > 0.
            block_ids: the producer's (logical) block ids of the request: a push naming
                other remote blocks for this request is refused (FAILED). Pull reads
                are one-sided, so for pull this is bookkeeping only.
            ticket: the hold's ticket (:mod:`kvxfer.engine.holds`), when the caller
                handed it out before the hold (e.g. with the params of a request whose
                hold starts later); default: the next free one. It must be newer than
                every ticket its slot had, in a slot no live hold uses.
            binding: opaque bytes the readers must name too (in vLLM: the prompt's hash).
                With ``block_ids``, the hold's slot carries a digest of the ticket,
                ``request_id``, the block ids and ``binding``; a reader whose params
                differ in any of them never reports its bytes
                (:func:`kvxfer.engine.holds.hold_digest`). Without ``block_ids`` the
                hold binds nothing: readers are checked by ticket alone.

        Returns:
            The lease: hand ``expires_at_ns``, ``generation`` and ``ticket`` to the
            consumer with the block ids, so it never reads after the lease ended and
            never reports bytes read after the hold ended.

        Raises:
            ConfigError: the request is held already, a bad count or lease, a ticket
                that cannot be used, or every hold slot in use (nothing is held then).
            ClosedError: close() was called (nothing is held).
        """
        check_request_id(request_id)
        lease = self.config.lease_s if lease_s is None else check_lease("lease_s", lease_s)
        ordered = None if block_ids is None else [int(b) for b in block_ids]
        held = None if ordered is None else frozenset(ordered)
        try:  # before any bookkeeping: an id past int64 is refused, nothing held
            ids = None if ordered is None else np.asarray(ordered, dtype=np.int64)
        except OverflowError:
            raise ConfigError(f"block_ids of {request_id!r} must fit int64") from None
        if num_blocks is None:
            if held is None:
                raise ConfigError("hold needs num_blocks or block_ids")
            num_blocks = len(held)
        if num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {num_blocks}")
        check_binding("binding", binding)
        now, wall_ns = time.monotonic(), time.time_ns()
        with self._lock:
            if self._stop.is_set():  # nothing would free it: no lease expiry, no ReadDone
                raise ClosedError(f"producer closed: request {request_id!r} not held")
            if request_id in self._pending_free:
                raise ConfigError(f"request {request_id!r} is already held")
            if ticket is None:
                ticket = self._book.take()
            else:
                self._book.claim(ticket)
            for t in self._tables.values():  # a bound hold counts no unticketed early ack
                t.hold(request_id, num_blocks, now, lease, early=not binding)
            self._pending_free[request_id] = set()
            if held is not None:
                self._held_ids[request_id] = held
            self._tickets[request_id] = ticket
            slot = slot_of(ticket, self._book.num_slots)
            if ids is None:  # binds nothing
                bound = unbound_digest(self.config.auth_key, ticket)
            else:
                bound = hold_digest(self.config.auth_key, ticket, request_id, ids, binding)
                self._digests[request_id] = (bound, bool(binding))
            digest = np.frombuffer(bound, np.uint64)
            for r in self.ranks:
                r.words[slot, DIGEST] = digest  # before the word: a reader judges both
                r.words[slot, 0] = held_word(ticket)
            for rank, notice, seen in self._early.pop((request_id, ticket), []):
                if now - seen <= EARLY_NOTICE_S:
                    self._apply(rank, notice, now)
        return Lease(request_id, wall_ns + int(lease * 1e9), self.generation, ticket)

    def _apply(self, rank: int, msg: ReadDone | Abort, now: float) -> None:
        """A ReadDone or Abort for a request held now, on ``rank`` (lock held)."""
        table = self._tables[rank]
        if not self._bound_to(msg.request_id, msg.ticket, msg.digest):
            return
        if isinstance(msg, ReadDone):
            # with ``now``: a read that overtook its hold counts when the hold comes
            table.ack(msg.request_id, msg.consumer_rank,
                      max(1, msg.consumer_size // self._tp_size), now)  # fmt: skip
        else:
            table.abort(msg.request_id, now)

    def _bound_to(self, request_id: str, ticket: int, digest: bytes) -> bool:
        """Whether a ReadDone, Abort or LeaseRenew may act on ``request_id``'s hold: the
        hold names no blocks; or the notice names its ticket and the digest of the params
        it was made for; or, unticketed, the hold was made without a ``binding`` (an
        engine caller's own bookkeeping). A forged request's notice (its check failed, or
        it was cancelled or timed out before it) would free or pin the genuine reader's
        blocks. Lock held."""
        entry = self._digests.get(request_id)
        if entry is None:
            return True
        bound, strict = entry
        if (ticket and hmac.compare_digest(bound, digest)) or (not ticket and not strict):
            return True
        self.num_rejected += 1
        log.info("request %r: notice for hold %d not made with its params: ignored",
                 request_id, ticket)  # fmt: skip
        return False

    def is_bound(self, request_id: str) -> bool:
        """Whether ``request_id``'s hold was made with a ``binding``: only ticketed
        requests with its params may read, push, free or renew it."""
        with self._lock:
            entry = self._digests.get(request_id)
            return entry is not None and entry[1]

    def _remember_early(self, rank: int, msg: ReadDone | Abort, now: float) -> None:
        """Keep a ticketed notice for a hold that is not (yet) held, bounded (lock held):
        a notice for an ended hold names a ticket no later hold has, and is forgotten
        ``EARLY_NOTICE_S`` after the first notice for that hold came (holds are kept in
        that order, so the expired ones are at the front: no scan of the rest)."""
        notices = self._early.setdefault((msg.request_id, msg.ticket), [])
        notices.append((rank, msg, now))
        if len(notices) > MAX_NOTICES_PER_HOLD:  # the newest are kept: (its first one's
            del notices[1]  # time, at [0], dates the entry; a flood ends with the genuine)
        while self._early:
            first = next(iter(self._early))
            if (
                len(self._early) <= MAX_EARLY_NOTICES
                and now - self._early[first][0][2] <= EARLY_NOTICE_S
            ):
                break
            del self._early[first]

    def _end_hold(self, request_id: str) -> None:
        """The hold ended: say so in its slot (before the caller may reuse the blocks) and
        give the slot back (lock held)."""
        ticket = self._tickets.pop(request_id, None)
        self._digests.pop(request_id, None)
        if ticket is None:
            return
        slot = slot_of(ticket, self._book.num_slots)
        for r in self.ranks:
            r.words[slot, 0] = released_word(ticket)
        self._book.free(ticket)

    def refuse_ticket(self, ticket: int) -> bool:
        """Say, in its slot, that ``ticket``'s hold has ended: for a ticket handed out
        (with params) whose hold failed to start and never will. A reader with it then
        fails at its first check instead of waiting for the hold until its deadline.
        Nothing is written while a live hold uses the slot, or once the slot had this
        ticket or a newer one (words only grow: :meth:`TicketBook.refuse`). True if the
        slot now says so."""
        with self._lock:
            if not self._book.refuse(ticket):
                return False
            slot = slot_of(ticket, self._book.num_slots)
            for r in self.ranks:
                r.words[slot, 0] = released_word(ticket)
            return True

    def release(self, request_id: str) -> bool:
        """Stop holding ``request_id`` now, on every rank (the caller frees its blocks; it
        is not reported by :meth:`pop_freed`). False if it was not held."""
        with self._lock:
            if self._pending_free.pop(request_id, None) is None:
                return False
            self._end_hold(request_id)
            self._held_ids.pop(request_id, None)
            for t in self._tables.values():
                # not reported: a freed entry left behind would be taken for a new hold
                # of the same id made before the engine thread collected it
                t.forget(request_id, time.monotonic())
            return True

    def held_block_ids(self, request_id: str) -> frozenset[int] | None:
        """The block ids given to :meth:`hold` for a held request (None: not given)."""
        with self._lock:
            return self._held_ids.get(request_id) if request_id in self._pending_free else None

    @property
    def num_held(self) -> int:
        """Requests held and not yet released on every rank."""
        with self._lock:
            return len(self._pending_free)

    def pop_freed(self) -> list[tuple[str, FreeReason]]:
        """Requests released on every rank since the last call: the caller frees their blocks."""
        with self._lock:
            out, self._freed = self._freed, []
            self._freed_ready.clear()
        return out

    def wait_freed(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until a request is released on every rank (one that
        :meth:`pop_freed` would report); True if one is."""
        return self._freed_ready.wait(timeout_s)

    def _drain_interval(self) -> float:
        """How long the engine thread sleeps between drains: ``BUSY_S`` while push mode
        is in use (a PushRequest within ``PUSH_ACTIVE_S``: the next one starts at once),
        else ``IDLE_S`` (an idle producer does not spin; measured before: 10.5% of a
        core at 2,000 drains a second). Pull reads never wait on this thread."""
        return BUSY_S if time.monotonic() < self._push_until else IDLE_S

    def _run(self) -> None:
        while not self._stop.wait(self._drain_interval()):
            # pushes are queued after the whole batch: an Abort that arrived with its
            # PushRequest (a producer resumed after SIGSTOP) cancels it before it starts
            pushes: list[tuple[int, str, PushRequest, float]] = []
            for r in self.ranks:
                try:
                    notifs = r.backend.get_notifs()
                except Exception as e:  # this thread also ends leases: it never dies
                    log.warning("rank %d: notifications failed: %s: %s", r.rank,
                                type(e).__name__, e)  # fmt: skip
                    continue
                for agent, msgs in notifs.items():
                    for raw in msgs:
                        try:
                            self._on_msg(r.rank, agent, raw, pushes)
                        except Exception as e:  # one bad notice never stops the engine
                            self._log_error("notification", e)
            for push in pushes:
                self._pusher.submit(*push)
            with self._lock:
                now = time.monotonic()
                for t in self._tables.values():  # the margin covers clock skew and latency
                    t.expire(now - self.config.lease_margin_s)
                self._collect()

    def _log_error(self, what: str, e: Exception) -> None:
        self.num_errors += 1
        if self.num_errors == 1:  # logged once (with its traceback), then counted
            log.exception("%s handling failed (logged once, counted after): %s", what, e)

    def _on_msg(
        self, rank: int, agent: str, raw: bytes, pushes: list[tuple[int, str, PushRequest, float]]
    ) -> None:
        try:
            msg = decode_msg(raw)
        except KvxferError as e:
            self.num_rejected += 1
            if self.num_rejected <= 10 or self.num_rejected % 1000 == 0:  # bounded log volume
                log.warning(
                    "rank %d: rejected notification (%d so far): %s", rank, self.num_rejected, e
                )
            return
        if getattr(msg, "generation", self.generation) != self.generation:
            self.num_rejected += 1
            log.info("rank %d: notification for old generation dropped", rank)
            return
        table, now = self._tables[rank], time.monotonic()
        with self._lock:
            if (
                isinstance(msg, ReadDone | Abort)
                and msg.ticket
                and self._tickets.get(msg.request_id) != msg.ticket
            ):  # about another hold of this request id: one that ended (the id may be
                # held again since: it must not free that one), or one not started yet
                # (vLLM hands out its ticket first): kept until that hold starts
                self._remember_early(rank, msg, now)
                if isinstance(msg, Abort):  # a push job of that attempt and agent stops
                    self._pusher.cancel(rank, agent, msg.request_id, msg.attempt)
                log.debug("rank %d: notice for hold %d of %r, not held now, kept", rank,
                          msg.ticket, msg.request_id)  # fmt: skip
                return
            if isinstance(msg, ReadDone):
                self._apply(rank, msg, now)
            elif isinstance(msg, Abort):
                self._apply(rank, msg, now)
                self._pusher.cancel(rank, agent, msg.request_id, msg.attempt)
            elif isinstance(msg, Failed):  # producers send it, to consumers only
                self.num_rejected += 1
            elif isinstance(msg, PushRequest):
                self._push_until = now + PUSH_ACTIVE_S
                # the local deadline: the relative budget bounds it; time the message
                # spent queued (by the sender's wall clock) can only shorten it
                queued_s = max(0.0, (time.time_ns() - msg.sent_at_ns) / 1e9)
                pushes.append((rank, agent, msg, now + msg.budget_ms / 1e3 - queued_s))
            elif isinstance(msg, LeaseRenew):
                cover = msg.budget_ms / 1e3  # the reader's deadline; a hold's own lease at least
                for i, rid in enumerate(msg.request_ids):
                    ticket = msg.tickets[i] if i < len(msg.tickets) else 0
                    if ticket and self._tickets.get(rid) != ticket:
                        self.num_rejected += 1  # a renew of an ended hold of this id
                        continue
                    digest = msg.digests[i] if i < len(msg.digests) else b""
                    if self._bound_to(rid, ticket, digest):
                        table.renew(rid, now, cover_s=cover)
            elif isinstance(msg, Heartbeat):
                if msg.consumer_address:  # a consumer that will push: contact it now
                    self._pusher.precontact(msg.consumer_address, msg.consumer_generation)
            else:
                self.num_rejected += 1

    def _on_written(
        self, request_id: str, rank: int, consumer_rank: int, consumer_size: int
    ) -> None:
        """A push WRITE completed: it counts as that consumer rank's read (unticketed:
        not for a hold made with a binding, which may have started during the WRITE)."""
        with self._lock:
            if not self._bound_to(request_id, 0, b""):
                return
            expected = max(1, consumer_size // self._tp_size)
            self._tables[rank].ack(request_id, consumer_rank, expected)

    def _collect(self) -> None:
        """Move requests released on every rank to the freed list (lock held)."""
        for rank, t in self._tables.items():
            for rid, reason in t.pop_freed():
                seen = self._pending_free.get(rid)
                if seen is None:
                    continue
                seen.add(rank)
                if len(seen) == len(self._tables):
                    del self._pending_free[rid]
                    self._end_hold(rid)
                    self._held_ids.pop(rid, None)
                    self._freed.append((rid, reason))
                    self._freed_ready.set()

    def close(self) -> None:
        """Stop serving, release agents and deregister memory. Idempotent.

        A rank that fails to close is kept (its error raised once the other ranks are
        closed) and the side channel stays up, since consumers take a refused connection
        as proof that this process writes no more; the next call closes what is left.
        """
        self._stop.set()
        for t in (getattr(self, "_thread", None), getattr(self, "_warm", None)):
            if t is not None:
                t.join()
        pusher = getattr(self, "_pusher", None)
        if pusher is not None:
            pusher.close()
        # the agents first: nothing of this process lands after them. A rank that fails
        # to close is kept for the next close(), the others are closed all the same
        errors: list[Exception] = []
        left = close_each(dict(enumerate(self.ranks)), errors)
        self.ranks = list(left.values())
        if errors:  # the side channel stays up: an agent may still write
            raise errors[0]
        server = getattr(self, "server", None)
        if server is not None:  # last: consumers take a refused connection as proof that
            server.stop()  # this process can write no more (their quarantines end)

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
