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
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.engine.config import U8, EngineConfig, RequestState, check_seconds
from kvxfer.engine.contact import FirstContact
from kvxfer.engine.inbox import Inbox
from kvxfer.engine.liveness import PeerMonitor
from kvxfer.engine.peer import PeerInfo
from kvxfer.engine.rank import RankCache, encode_records, new_generation, serve_records
from kvxfer.engine.relayout import relayout_bsr
from kvxfer.engine.stats import EngineStats, StatsRecorder
from kvxfer.engine.transfer import Transfer, num_bytes
from kvxfer.errors import (
    CancelledError,
    ClosedError,
    ConfigError,
    DeadlineError,
    KvxferError,
    LeaseExpiredError,
    PeerLostError,
    TransferError,
)
from kvxfer.layout.spec import LayoutSpec
from kvxfer.planning.pairing import pair_layouts
from kvxfer.planning.request import RequestIds, plan_request
from kvxfer.transport.backend import BackendFactory
from kvxfer.transport.nixl import XferOp, XferState
from kvxfer.transport.side_channel import SideChannelServer
from kvxfer.wire import (
    Abort,
    LeaseRenew,
    PushRequest,
    ReadDone,
    encode_msg,
)

__all__ = ["Consumer", "PeerInfo", "Transfer"]  # the handles live in peer.py, transfer.py

log = logging.getLogger(__name__)


def _wire_ids(ids: npt.NDArray[np.int64]) -> tuple[int, ...]:
    """Block ids as a PushRequest carries them."""
    return tuple(int(i) for i in ids)


def _pinned_ok(pin: int | Mapping[int, int], generations: Mapping[int, int]) -> bool:
    """Whether the producer ranks still run the generation(s) a request was pinned to."""
    if isinstance(pin, int):
        return set(generations.values()) == {pin}
    return all(generations.get(rank) == gen for rank, gen in pin.items())


class Consumer(FirstContact):
    """A consumer engine hosting ``len(ranks)`` TP ranks in this process.

    Args:
        config: engine settings (deadline, handshake timeout, strided or dense lists).
        ranks: per TP rank, its spec and region buffers (which must outlive this).

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
        ranks: Sequence[tuple[LayoutSpec, Sequence[U8]]],
        *,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        if not ranks:
            raise ConfigError("a consumer needs at least one rank")
        config.check()
        self.config = config
        self._closed = False
        self._engine_lock = threading.RLock()  # NIXL calls + peer bookkeeping (see class doc)
        self.generation = new_generation()
        self.compat_hash = config.compat_hash(ranks[0][0])
        self._lock = threading.Lock()
        self._peers: dict[str, PeerInfo] = {}
        self._watched: dict[str, tuple[float, float]] = {}
        self._stats = StatsRecorder()
        self.ranks: dict[int, RankCache] = {}
        try:
            for spec, bufs in ranks:
                name = f"{config.engine_id}-d{spec.tp_rank}-{self.generation:x}"
                self.ranks[spec.tp_rank] = RankCache(spec, bufs, name, config, backend_factory)
            records = encode_records(self.ranks.values(), self.generation, self.compat_hash)
            # push mode: producers fetch this engine's records here
            self.server: SideChannelServer | None = serve_records(config, records)
        except BaseException:
            self.close()
            raise
        self._inbox = Inbox(self.ranks)
        self._monitor = PeerMonitor(
            self.compat_hash, config.heartbeat_s, self._on_peer_lost, auth_key=config.auth_key
        )
        self._warm_up()

    def _warm_up(self) -> None:
        """Run the planner once on our own layout, so first contact does not pay NumPy's
        cold-start costs (~0.5 ms on this machine) on the time-to-first-token path."""
        lay = next(iter(self.ranks.values())).layout
        peer = pair_layouts(lay, {lay.tp_rank: lay}, max_run_blocks=self.config.run_blocks)
        plan_request(peer, [0], [0])

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
        producer to extend the lease over the request's deadline.
        """
        t = self._request(
            XferOp.READ, request_id, address, local_block_ids, remote_block_ids,
            local_state_ids, remote_state_ids, num_cached_blocks, ranks, deadline_s, generation,
        )  # fmt: skip
        t.lease_expires_at_ns = lease_expires_at_ns
        return t

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
    ) -> Transfer:
        """Ask the producer at ``address`` to WRITE a request into these local blocks (push).

        Same arguments and handle as :meth:`read`; the request is DONE when every
        source rank's ``WriteDone`` notification arrived (WRITE data is complete then).
        """
        return self._request(
            XferOp.WRITE, request_id, address, local_block_ids, remote_block_ids,
            local_state_ids, remote_state_ids, num_cached_blocks, ranks, deadline_s, generation,
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
    ) -> Transfer:
        if self._closed:
            raise ClosedError(f"consumer closed: request {request_id!r} refused")
        if deadline_s is not None:
            check_seconds("deadline_s", deadline_s)
        chosen = tuple(self.ranks) if ranks is None else tuple(ranks)
        for d in chosen:
            if d not in self.ranks:
                raise ConfigError(f"local rank {d} is not hosted here (have {sorted(self.ranks)})")
        deadline = time.monotonic() + (self.config.deadline_s if deadline_s is None else deadline_s)
        ids = RequestIds.of(
            local_block_ids, remote_block_ids, local_state=local_state_ids,
            remote_state=remote_state_ids, num_cached_blocks=num_cached_blocks,
        )  # fmt: skip
        t = Transfer(
            request_id, self, self._peer(address), deadline, ids, chosen, op,
            generation=generation,
        )  # fmt: skip
        self._inbox.add(t)  # close() aborts it; push notices find it by attempt
        return t

    def is_quarantined(self, t: Transfer) -> bool:
        """See :attr:`Transfer.quarantined` (the design is on :class:`RequestState`)."""
        if t.op is not XferOp.WRITE or not t.expected or t.state is RequestState.DONE:
            return False
        if not t.state.is_terminal:
            return True
        _, _, settled = self._inbox.status(t)
        return not settled and time.monotonic() < t.quarantine_until

    def cancel(self, t: Transfer) -> None:
        """See :meth:`Transfer.cancel`."""
        with self._engine_lock:
            if not t.state.is_terminal:
                self._fail(t, CancelledError(f"request {t.request_id!r} cancelled by the caller"))

    def advance(self, t: Transfer) -> RequestState:
        """Advance one request's state machine (what :meth:`Transfer.poll` calls)."""
        if t.state.is_terminal:
            return t.state
        with self._engine_lock:
            if self._closed:
                self._fail(t, ClosedError(f"consumer closed: request {t.request_id!r} aborted"))
                return t.state
            return self._advance(t)

    def _advance(self, t: Transfer) -> RequestState:
        try:
            if time.monotonic() >= t.deadline:
                raise DeadlineError(f"request {t.request_id!r} passed its deadline")
            if not t.posted_at:
                if not t.peer.ready.is_set():
                    return t.state
                pinned_elsewhere = t.generation is not None and not _pinned_ok(
                    t.generation, t.peer.generations
                )
                if t.peer.error is not None:
                    if pinned_elsewhere and isinstance(t.peer.error, PeerLostError):
                        # the incarnation that was lost is not the one this request is
                        # pinned to (a heartbeat saw the restart first): contact it again
                        self._recheck(t)
                        return t.state
                    raise t.peer.error
                if pinned_elsewhere:
                    self._recheck(t)  # raises, or re-handshakes a restarted producer
                    return t.state
                if t.lease_expires_at_ns is not None and time.time_ns() >= (
                    t.lease_expires_at_ns - int(self.config.lease_margin_s * 1e9)
                ):
                    raise LeaseExpiredError(
                        f"request {t.request_id!r}: the producer's lease ended; not read"
                    )
                self._post(t)
            if t.op is XferOp.WRITE:
                done, reason, _ = self._inbox.status(t)
                if reason is not None:
                    raise TransferError(f"producer failed to push {t.request_id!r}: {reason}")
                if done:
                    self._finish(t)
                elif t.peer.error is not None:  # the heartbeat saw the producer die
                    raise t.peer.error
                return t.state
            self._renew(t)
            pending = []
            for d, x in t.xfers:
                if self.ranks[d].backend.poll(x) is XferState.IN_PROGRESS:
                    pending.append((d, x))
                else:
                    x.release()
            t.xfers = pending
            if not pending:
                self._finish(t)
        except KvxferError as e:
            self._fail(t, e)
        return t.state

    def _renew(self, t: Transfer, force: bool = False) -> None:
        """Renew the producer's lease on a request still in flight (every heartbeat_s), to
        cover what is left of the request's deadline."""
        now = time.perf_counter()
        if not force and now - max(t.posted_at, t.renewed_at) < self.config.heartbeat_s:
            return
        t.renewed_at = now
        budget_ms = max(0, int((t.deadline - time.monotonic()) * 1000))
        for rank, agent in t.peer.agents.items():
            gen = t.peer.generations[rank]
            msg = encode_msg(LeaseRenew((t.request_id,), gen, (t.attempt,), budget_ms))
            for d in t.ranks:
                self.ranks[d].backend.send_notif(agent, msg)

    def _post(self, t: Transfer) -> None:
        peer = t.peer
        t.posted_at = time.perf_counter()
        if t.op is XferOp.WRITE:
            self._post_push(t)
            return
        self._renew(t, force=True)  # first: the producer's lease now covers the deadline
        for d in t.ranks:
            plan = peer.plans[d]
            req = t.ids.plan(plan)
            backend = self.ranks[d].backend
            size = self.ranks[d].spec.tp_size
            for ids in req.sources:
                if ids.num_descriptors == 0:
                    t.notify.append((d, ids.rank))
                    continue
                loc, rem = peer.lists[(d, ids.rank)]
                gen = peer.generations[ids.rank]
                msg = encode_msg(ReadDone(t.request_id, gen, d, size, t.attempt))
                x = backend.make_xfer(XferOp.READ, loc, ids.local_ids, rem, ids.remote_ids, msg)
                t.xfers.append((d, x))
                t.num_descriptors += ids.num_descriptors
                t.num_bytes += num_bytes(plan, ids.rank, ids.local_ids)
                if backend.post(x) is XferState.DONE:
                    pass  # polled (and released) below
            t.notify.extend((d, r) for r in req.notify_only)

    def _post_push(self, t: Transfer) -> None:
        peer = t.peer
        t.quarantine_until = t.deadline + self.config.lease_s
        for d in t.ranks:
            req = t.ids.plan(peer.plans[d])
            ls, rs = t.ids.local_state, t.ids.remote_state  # None: the attention ids
            backend = self.ranks[d].backend
            for ids in req.sources:
                msg = PushRequest(
                    t.request_id, peer.generations[ids.rank], self.address, d,
                    self.ranks[d].spec.tp_size,
                    _wire_ids(t.ids.local), _wire_ids(t.ids.remote),
                    local_state_ids=None if ls is None else _wire_ids(ls),
                    remote_state_ids=None if rs is None else _wire_ids(rs),
                    num_cached_blocks=int(t.ids.num_cached_blocks),
                    attempt=t.attempt,
                    budget_ms=max(0, int((t.deadline - time.monotonic()) * 1000)),
                    sent_at_ns=time.time_ns(),
                    consumer_generation=self.generation,
                )  # fmt: skip
                backend.send_notif(peer.agents[ids.rank], encode_msg(msg))
                t.expected.add((d, ids.rank))
                t.num_descriptors += ids.num_descriptors
                t.num_bytes += num_bytes(peer.plans[d], ids.rank, ids.local_ids)
            t.notify.extend((d, r) for r in req.notify_only)

    def _finish(self, t: Transfer) -> None:
        peer = t.peer
        for d, r in t.notify:  # tell ranks that were not read (MLA, GQA dedup, empty) to free
            size = self.ranks[d].spec.tp_size
            done = ReadDone(t.request_id, peer.generations[r], d, size, t.attempt)
            self.ranks[d].backend.send_notif(peer.agents[r], encode_msg(done))
        for d in t.ranks:
            plan = t.peer.plans[d]
            if plan.kernel_bsr > 1:
                cached = int(t.ids.num_cached_blocks)
                cache = self.ranks[d]
                relayout_bsr(cache.spec, cache.bufs, t.ids.local[cached:], plan.kernel_bsr)
        t.finished_at = time.perf_counter()
        t.state = RequestState.DONE
        self._stats.record(t)

    def _fail(self, t: Transfer, error: KvxferError) -> None:
        for _, x in t.xfers:
            try:
                x.release()  # cancels in-flight work; buffers stay registered
            except KvxferError as e:
                log.debug("release after failure: %s", e)
        t.xfers = []
        if (
            isinstance(t.peer.error, PeerLostError)
            and error is not t.peer.error
            and not t.keep_peer
            and not isinstance(error, DeadlineError | ClosedError | CancelledError)
        ):  # a heartbeat drop surfaced as a NIXL error or a stale handle: PEER_LOST, with
            # the heartbeat's reason (why the peer was dropped), not the handle's
            error = t.peer.error
        t.error = error
        t.finished_at = time.perf_counter()
        if isinstance(error, PeerLostError):
            t.state = RequestState.PEER_LOST
            self._stats.record(t)
            if not t.keep_peer:
                self._drop_peer(t.peer)
            return
        if isinstance(error, ClosedError | CancelledError):
            t.state = RequestState.ABORTED
        elif isinstance(error, DeadlineError):
            t.state = RequestState.TIMEOUT
        else:
            t.state = RequestState.FAILED
        self._stats.record(t)
        if t.posted_at and t.peer.agents:  # tell every producer rank it may free the blocks
            for rank, agent in t.peer.agents.items():
                gen = t.peer.generations[rank]
                msg = encode_msg(Abort(t.request_id, gen, t.state.value, t.attempt))
                for d in t.ranks:
                    try:
                        self.ranks[d].backend.send_notif(agent, msg)
                    except KvxferError as e:
                        log.debug("abort notice to %s: %s", agent, e)

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
        :meth:`read`/:meth:`push` raise :class:`~kvxfer.errors.ClosedError`.
        """
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:  # first, outside the lock: its thread may wait for it
            monitor.close()
        lock = getattr(self, "_engine_lock", None)
        if lock is None:  # __init__ failed before the lock existed
            self._close_resources()
            return
        with lock:
            if self._closed:
                return
            inbox = getattr(self, "_inbox", None)
            for t in inbox.live() if inbox is not None else []:
                if not t.state.is_terminal:
                    self._fail(t, ClosedError(f"consumer closed: request {t.request_id!r}"))
            self._closed = True
            if inbox is not None:
                inbox.close()
            self._close_resources()

    def _close_resources(self) -> None:
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:
            monitor.close()
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()
            self.server = None
        for cache in self.ranks.values():
            cache.close()
        self.ranks = {}

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
