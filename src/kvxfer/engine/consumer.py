"""The consumer (decode) side: first contact with producers, per-request reads, deadlines.

A :class:`Consumer` hosts the TP ranks of one decode engine in this process. Its
:meth:`Consumer.read` returns a :class:`Transfer` at once; first contact with an
unknown producer runs in a background thread, so requests to known producers keep
flowing. Progress happens in :meth:`Transfer.poll` (or :meth:`Transfer.wait`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.engine.config import (
    CLOSE_JOIN_S,
    Buffer,
    EngineConfig,
    check_deadline,
    check_request_id,
)
from kvxfer.engine.contact import FirstContact
from kvxfer.engine.holds import (
    CHECK_SLOTS,
    check_binding,
    check_ticket,
    hold_digest,
    unbound_digest,
)
from kvxfer.engine.inbox import Inbox
from kvxfer.engine.liveness import PeerMonitor
from kvxfer.engine.peer import PeerInfo
from kvxfer.engine.rank import (
    RankCache,
    close_after_failed_start,
    close_each,
    encode_records,
    new_generation,
    serve_records,
)
from kvxfer.engine.stats import EngineStats, StatsRecorder
from kvxfer.engine.threads import ThreadSet
from kvxfer.engine.transfer import RequestContext, Transfer
from kvxfer.engine.waiting import Progress
from kvxfer.errors import ClosedError, ConfigError, PeerLostError
from kvxfer.layout.spec import LayoutSpec
from kvxfer.planning.pairing import pair_layouts
from kvxfer.planning.request import RequestIds, plan_request
from kvxfer.transport.backend import BackendFactory
from kvxfer.transport.nixl import XferOp
from kvxfer.transport.side_channel import SideChannelServer
from kvxfer.wire import PushFailure, compat_hash

__all__ = ["Consumer", "PeerInfo", "Transfer"]  # the handles live in peer.py, transfer.py

log = logging.getLogger(__name__)

MAX_ENDED_GENERATIONS = 4096  # producer generations remembered as proven ended


class Consumer(FirstContact):
    """A consumer engine hosting ``len(ranks)`` TP ranks in this process.

    Args:
        config: engine settings (deadline, handshake timeout, strided or dense lists).
        ranks: per TP rank, its spec and region buffers (which must outlive this): host
            ``uint8`` arrays, or :class:`~kvxfer.layout.model.DeviceBuffer` per region for
            memory given by address (a GPU's cache: VRAM), one kind and device per rank.

    Thread-safety: :meth:`read`, :meth:`push`, :meth:`connect` and :meth:`close` may be
    called from any thread; every NIXL call of the engine that touches its bookkeeping
    (post, poll, release, add/remove agents, prepare) runs under one engine lock, which
    the handshake and heartbeat threads take too (see docs/architecture.md, "Threads
    and locks"). One :class:`Transfer` is driven by one thread at a time. After
    :meth:`close`, new requests raise :class:`~kvxfer.errors.ClosedError` and live
    ones end ABORTED.
    """

    def __init__(
        self,
        config: EngineConfig,
        ranks: Sequence[tuple[LayoutSpec, Sequence[Buffer]]],
        *,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        if not ranks:
            raise ConfigError("a consumer needs at least one rank")
        config.check()
        self.config = config
        self._closed = False
        self._close_busy = False  # a close() call is under way (under the engine lock)
        self._agents_gone = False  # set by close() once its agents are closed
        self._closing = threading.Event()
        self._helpers = ThreadSet()
        self._ended_gens: OrderedDict[int, None] = OrderedDict()  # proven ended (under _lock)
        self._engine_lock = threading.RLock()  # NIXL calls + peer bookkeeping (see class doc)
        self.generation = new_generation()
        self.facts = config.facts(ranks[0][0])
        self.compat_hash = compat_hash(self.facts)
        self._lock = threading.Lock()
        self._peers: dict[str, PeerInfo] = {}
        self._watched: dict[str, tuple[float, float]] = {}
        self._contacting = 0
        self._contact_queue: deque[PeerInfo] = deque()
        self._agent_users: dict[str, set[int]] = {}
        self._stats = StatsRecorder()
        self.ranks: dict[int, RankCache] = {}
        try:
            for spec, bufs in ranks:
                name = f"{config.engine_id}-d{spec.tp_rank}-{self.generation:x}"
                self.ranks[spec.tp_rank] = RankCache(
                    spec, bufs, name, config, backend_factory, words=CHECK_SLOTS
                )
            records = encode_records(self.ranks.values(), self.generation, self.compat_hash)
            # push mode: producers fetch this engine's records here
            self.server: SideChannelServer | None = serve_records(config, records, self.facts)
        except BaseException as e:
            close_after_failed_start(self.close, e, f"consumer {config.engine_id!r}")
            raise
        self._inbox = Inbox(self.ranks, on_quarantine=self._watch_quarantine)
        self._progress = Progress()  # drives the requests someone waits on
        self._context = RequestContext(
            config=config,
            ranks=self.ranks,
            lock=self._engine_lock,
            generation=self.generation,
            address=lambda: self.address,
            is_closed=lambda: self._closed,
            agents_gone=lambda: self._agents_gone,
            push_status=self._inbox.status,
            record=self._stats.record,
            drop_peer=self._drop_peer,
            recheck=self._recheck,
            watch=self._progress.watch,
            ended=self._is_ended,
            watch_end=self._watch_quarantine,
        )  # what each Transfer's state machine needs from this engine
        self._monitor = PeerMonitor(
            self.compat_hash,
            config.heartbeat_s,
            self._on_peer_lost,
            auth_key=config.auth_key,
            on_gone=self._generations_ended,
            silence_s=config.silence_s,
            pending_pushes=self._inbox.pending_pushes,
            on_push_failed=self._push_failed,
        )
        self._warm_up()

    def _push_failed(self, address: str, failures: tuple[PushFailure, ...]) -> None:
        """The heartbeat heard from ``address`` of pushes it failed unannounced: those
        requests end FAILED at their next step, instead of at their deadline."""
        if self._inbox.push_failed(address, failures):
            log.warning("%s failed pushes it could not announce over NIXL: %s", address,
                        "; ".join(f"{f.request_id!r}: {f.reason}" for f in failures)[:2000])  # fmt: skip
            self._progress.kick()

    def _warm_up(self) -> None:
        """Pay one-time costs at start, not on the first request's time-to-first-token:
        the transport's (each rank's agent against a loopback agent, see
        :meth:`RankCache.warm_up_transport`) and NumPy's in the planner (~0.5 ms here)."""
        for cache in self.ranks.values():
            cache.warm_up_transport(self.config)
        cache = next(iter(self.ranks.values()))
        lay, spec = cache.layout, cache.spec
        is_hybrid = spec.state is not None and spec.num_layers > 0
        if is_hybrid and spec.num_blocks < 2:
            return  # a hybrid pool of one block: no request fits it
        peer = pair_layouts(lay, {lay.tp_rank: lay}, max_run_blocks=self.config.run_blocks)
        state = [1] if is_hybrid else None  # a hybrid request names its state block apart
        plan_request(peer, [0], [0], local_state_ids=state, remote_state_ids=state)

    @property
    def num_rejected(self) -> int:
        """Notifications dropped: malformed, stale attempts, or from the wrong agent."""
        i = self._inbox
        return i.num_rejected + i.num_stale + i.num_forged

    def _on_peer_lost(self, address: str, reason: str, generations: set[int]) -> None:
        """Heartbeat verdict: the producer at ``address`` (running ``generations``) died
        or restarted. A peer re-handshaken meanwhile (other generations) is kept."""
        with self._lock:
            peer = self._peers.get(address)
        if peer is not None and set(peer.generations.values()) == generations:
            peer.error = PeerLostError(f"{address}: {reason}")
            self._drop_peer(peer)

    def _generations_ended(self, generations: set[int]) -> None:
        """Producer incarnations proven ended (their process exited or was replaced):
        pushes from them are settled, and READs of theirs released with their peer
        (which cannot be polled any more) no longer quarantine their blocks."""
        with self._lock:
            for g in generations:
                self._ended_gens[g] = None
                self._ended_gens.move_to_end(g)
            while len(self._ended_gens) > MAX_ENDED_GENERATIONS:
                self._ended_gens.popitem(last=False)
        self._inbox.settle_generations(generations)

    def _is_ended(self, generation: int) -> bool:
        with self._lock:
            return generation in self._ended_gens

    def _watch_quarantine(self, t: Transfer) -> None:
        """A request ended without DONE and bytes may still land (a push whose producer
        may still write, or a READ released with its dropped peer): probe the
        producer's endpoints until its process is proven gone (which ends the
        quarantine at once) or the quarantine's time bound passes."""
        for ep, gens in t.peer.endpoint_generations.items():
            self._monitor.watch_end(ep, gens, t.quarantine_until)

    @property
    def address(self) -> str:
        """This engine's side-channel endpoint (producers fetch its records for push)."""
        if self.config.advertise_addr:
            return self.config.advertise_addr
        return self.server.address if self.server is not None else ""

    # -- requests -------------------------------------------------------------------

    def read(
        self,
        request_id: str,
        address: str,
        *,
        local_block_ids: npt.ArrayLike,
        remote_block_ids: npt.ArrayLike,
        local_state_ids: npt.ArrayLike | None = None,
        remote_state_ids: npt.ArrayLike | None = None,
        num_cached_blocks: int = 0,
        ranks: Sequence[int] | None = None,
        deadline_s: float | None = None,
        generation: int | Mapping[int, int] | None = None,
        lease_expires_at_ns: int | None = None,
        hold_ticket: int | None = None,
        hold_block_ids: npt.ArrayLike | None = None,
        hold_binding: bytes = b"",
    ) -> Transfer:
        """Start reading a request's blocks from the producer at ``address`` (pull mode).

        Returns at once; ids are validated against both pools when the request is
        posted (a bad id ends the request FAILED with a LayoutError). ``ranks``
        selects local ranks (default: all hosted ranks). ``generation`` (the
        producer's :attr:`~kvxfer.engine.producer.Producer.generation` when it prefilled the
        request; a ``{rank: generation}`` map for a producer engine spread over several
        processes) pins the request to that incarnation: after a producer restart it
        ends PEER_LOST instead of reading another process's blocks. ``address`` is one
        side-channel endpoint, or several separated by commas when the producer's
        ranks live in several processes (one endpoint each). ``lease_expires_at_ns``
        (:attr:`~kvxfer.engine.leases.Lease.expires_at_ns` from the producer's ``hold``):
        the READ is never posted within ``lease_margin_s`` of it (the request ends
        FAILED with :class:`~kvxfer.errors.LeaseExpiredError`), and posting it asks the
        producer to extend the lease over the request's deadline. ``hold_ticket``
        (:attr:`~kvxfer.engine.leases.Lease.ticket`): after the READ, the producer's
        hold table is read too, and the request is DONE only if the hold was still alive
        after the blocks were copied (else FAILED with
        :class:`~kvxfer.errors.HoldEndedError`; a hold that has not started yet is
        checked again until the deadline); the producer is told it was read only then.
        Without it, bytes read after the hold ended (a second reader of the same
        params, say) cannot be told from the held ones. The hold must also have been
        made for these params: ``request_id``, ``hold_block_ids`` (every block id the
        hold named, as the params carry them; default: the remote ids read, state ids
        included, which must all be among them) and ``hold_binding`` (the ``binding``
        given to ``hold``; in vLLM, the prompt's hash), else the request ends FAILED
        with :class:`~kvxfer.errors.HoldMismatchError` and the producer is not told
        (forged or mixed-up params; :mod:`kvxfer.engine.holds`).
        """
        return self._request(
            XferOp.READ, request_id, address, local_block_ids, remote_block_ids,
            local_state_ids, remote_state_ids, num_cached_blocks, ranks, deadline_s, generation,
            lease_expires_at_ns=lease_expires_at_ns,
            hold=(hold_ticket, hold_block_ids, hold_binding),
        )  # fmt: skip

    def push(
        self,
        request_id: str,
        address: str,
        *,
        local_block_ids: npt.ArrayLike,
        remote_block_ids: npt.ArrayLike,
        local_state_ids: npt.ArrayLike | None = None,
        remote_state_ids: npt.ArrayLike | None = None,
        num_cached_blocks: int = 0,
        ranks: Sequence[int] | None = None,
        deadline_s: float | None = None,
        generation: int | Mapping[int, int] | None = None,
        hold_ticket: int | None = None,
        hold_block_ids: npt.ArrayLike | None = None,
        hold_binding: bytes = b"",
    ) -> Transfer:
        """Ask the producer at ``address`` to WRITE a request into these local blocks (push).

        Same arguments and handle as :meth:`read`; the request is DONE when every
        source rank's ``WriteDone`` notification arrived (WRITE data is complete then).
        ``hold_ticket``: the producer writes only from a hold it has not ended (else the
        request ends FAILED naming the hold), and the request is DONE only if the hold
        was still alive after the WRITEs completed (the consumer READs its slot word,
        as :meth:`read` does); the producer frees the hold at the consumer's
        ``ReadDone``, not when it wrote. Without it, a second push of the same params
        is written from blocks the producer may have reused. ``hold_block_ids`` and
        ``hold_binding``: as for :meth:`read` (the request is DONE only if the hold was
        made for these params).
        """
        return self._request(
            XferOp.WRITE, request_id, address, local_block_ids, remote_block_ids,
            local_state_ids, remote_state_ids, num_cached_blocks, ranks, deadline_s, generation,
            hold=(hold_ticket, hold_block_ids, hold_binding),
        )  # fmt: skip

    def _request(
        self,
        op: XferOp,
        request_id: str,
        address: str,
        local_block_ids: npt.ArrayLike,
        remote_block_ids: npt.ArrayLike,
        local_state_ids: npt.ArrayLike | None,
        remote_state_ids: npt.ArrayLike | None,
        num_cached_blocks: int,
        ranks: Sequence[int] | None,
        deadline_s: float | None,
        generation: int | Mapping[int, int] | None,
        *,
        lease_expires_at_ns: int | None = None,
        hold: tuple[int | None, npt.ArrayLike | None, bytes] = (None, None, b""),
    ) -> Transfer:
        if self._closed:
            raise ClosedError(f"consumer closed: request {request_id!r} refused")
        check_request_id(request_id)
        if deadline_s is not None:
            check_deadline("deadline_s", deadline_s)
        chosen = tuple(self.ranks) if ranks is None else tuple(ranks)
        for d in chosen:
            if d not in self.ranks:
                raise ConfigError(f"local rank {d} is not hosted here (have {sorted(self.ranks)})")
        deadline = time.monotonic() + (self.config.deadline_s if deadline_s is None else deadline_s)
        ids = RequestIds.of(
            local_block_ids, remote_block_ids, local_state=local_state_ids,
            remote_state=remote_state_ids, num_cached_blocks=num_cached_blocks,
        )  # fmt: skip
        hold_ticket = 0 if hold[0] is None else check_ticket(hold[0])
        digest = self._hold_digest(request_id, hold_ticket, ids, *hold[1:])
        unbound = unbound_digest(self.config.auth_key, hold_ticket) if hold_ticket else b""
        t = Transfer(
            request_id, self._context, self._peer(address), deadline, ids, chosen, op,
            generation=generation, lease_expires_at_ns=lease_expires_at_ns,
            hold_ticket=hold_ticket, hold_digest=digest, unbound_digest=unbound,
        )  # fmt: skip
        self._inbox.add(t)  # close() aborts it; push notices find it by attempt
        return t

    def _hold_digest(
        self,
        request_id: str,
        ticket: int,
        ids: RequestIds,
        hold_block_ids: npt.ArrayLike | None,
        binding: bytes,
    ) -> bytes:
        """The binding digest a ticketed request's hold must carry (b"": no ticket).

        ``hold_block_ids``: the held list as the params carry it, in its order (default:
        the remote ids read, then the remote state ids). The ids read (and, apart, the
        state ids) must appear in it in the same order: reading the held blocks in
        another order would put the right bytes in the wrong places.
        """
        check_binding("hold_binding", binding)
        if not ticket:
            return b""
        named = [np.asarray(a) for a in (ids.remote, ids.remote_state) if a is not None]
        if any(a.size and a.dtype.kind not in "iu" for a in named):
            return b""  # ids that are not integers: the plan refuses them at post
        named = [a.astype(np.int64) for a in named]
        held = np.concatenate(named) if hold_block_ids is None else np.asarray(hold_block_ids)
        if held.size and held.dtype.kind not in "iu":
            raise ConfigError(f"request {request_id!r}: hold_block_ids must be integers")
        held = held.astype(np.int64).ravel()
        order = np.argsort(held, kind="stable")
        ranked = held[order]
        if np.any(ranked[1:] == ranked[:-1]):
            raise ConfigError(f"request {request_id!r}: hold_block_ids repeats block ids")
        for a in named:
            at = np.minimum(np.searchsorted(ranked, a), max(len(ranked) - 1, 0))
            found = ranked[at] == a if len(ranked) else np.zeros(a.shape, bool)
            if not np.all(found):
                raise ConfigError(
                    f"request {request_id!r}: remote blocks {a[~found][:8].tolist()} are "
                    "not in hold_block_ids"
                )
            if np.any(np.diff(order[at]) <= 0):
                raise ConfigError(
                    f"request {request_id!r}: remote blocks {a[:8].tolist()} are not in the "
                    "order of hold_block_ids"
                )
        return hold_digest(self.config.auth_key, ticket, request_id, held, binding)

    def stats(self) -> EngineStats:
        """A snapshot: requests by end state, bytes, descriptors, latency histogram and
        each contacted producer's first-contact figures. Thread-safe."""
        pending = sum(not t.state.is_terminal for t in self._inbox.live())
        with self._lock:
            peers = list(self._peers.values())
        return self._stats.snapshot(pending, peers)

    def close(self) -> None:
        """Abort live requests, release every agent and deregister memory. Idempotent.

        Live requests end ABORTED (their producers are told); later calls of
        :meth:`read`/:meth:`push` raise :class:`~kvxfer.errors.ClosedError`. A part that
        fails to close (its error is raised once the others are closed) stays for the
        next call, which closes what is left.
        """
        closing = getattr(self, "_closing", None)
        if closing is not None:  # side-channel waits of contacts and rechecks end now
            closing.set()
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:  # first, outside the lock: its thread may wait for it
            monitor.close()
        lock = getattr(self, "_engine_lock", None)
        if lock is None:  # __init__ failed before the lock existed
            self._close_resources()
            return
        with lock:
            if self._closed:
                left = getattr(self, "ranks", None) or getattr(self, "server", None)
                if self._close_busy or not left:
                    return  # another call is closing it, or it is closed, all of it
                # else a close that failed part way: the steps below are idempotent,
                # and _close_resources closes only what is still open
            else:
                inbox = getattr(self, "_inbox", None)
                for t in inbox.live() if inbox is not None else []:
                    if not t.state.is_terminal:
                        t._fail_surely(ClosedError(f"consumer closed: request {t.request_id!r}"))
                self._closed = True
            self._close_busy = True  # cleared under the lock, when this call ends
        try:
            progress = getattr(self, "_progress", None)
            if progress is not None:  # outside the lock: its sweep may be waiting for it
                progress.close()
            self._join_helpers(CLOSE_JOIN_S)  # outside the lock: a contact may wait for it
        finally:
            with lock:
                try:
                    inbox = getattr(self, "_inbox", None)
                    if inbox is not None:
                        inbox.close()
                    self._close_resources()
                finally:
                    self._close_busy = False

    def _close_resources(self) -> None:
        """Stop the side channel and close every rank; a part that raises is kept for the
        next close() and the others are still closed; the first error is raised after.
        The agents count as gone (ending quarantines) only once every rank closed."""
        errors: list[Exception] = []
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:
            monitor.close()
        server = getattr(self, "server", None)
        if server is not None:
            try:
                server.stop()
                self.server = None
            except Exception as e:
                errors.append(e)
        self.ranks = close_each(getattr(self, "ranks", {}), errors)
        self._agents_gone = not self.ranks
        if errors:
            raise errors[0]

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
