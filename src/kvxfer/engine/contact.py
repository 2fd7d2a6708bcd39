"""First contact of a consumer with producers (background threads, at most
``EngineConfig.max_contacts``; more new producers wait in a bounded queue),
peer drops, and the refetch that checks a request's generation pin (issue 9 item 10).

:class:`FirstContact` is the part of :class:`~kvxfer.engine.consumer.Consumer` that
owns :class:`PeerInfo` objects; the consumer supplies the attributes declared here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import NoReturn

import numpy as np

from kvxfer.engine.config import EngineConfig, RequestState, check_seconds
from kvxfer.engine.holds import SLOT_BYTES
from kvxfer.engine.inbox import Inbox
from kvxfer.engine.liveness import PeerMonitor
from kvxfer.engine.peer import PeerInfo
from kvxfer.engine.rank import RankCache
from kvxfer.engine.threads import ThreadSet
from kvxfer.engine.transfer import Transfer
from kvxfer.engine.waiting import Progress
from kvxfer.errors import ClosedError, ConfigError, KvxferError, LayoutError, PeerLostError
from kvxfer.layout.model import MemKind, region_places, single_place
from kvxfer.planning.pairing import pair_layouts
from kvxfer.transport.handles import release_each
from kvxfer.transport.side_client import fetch_records
from kvxfer.wire import Heartbeat, LayoutRecord, ModelFacts, encode_msg, layout_from_record

__all__ = ["FirstContact"]

log = logging.getLogger(__name__)

MAX_QUEUED_CONTACTS = 1024  # new producers waiting for a first contact; past it: failed
QUEUE_GRACE_S = 1.0  # a queued producer asked for this recently is contacted, waiter or not


class FirstContact:
    """Peers of a consumer: contact, drop, recheck. Thread-safe (see Consumer)."""

    config: EngineConfig
    facts: ModelFacts  # this engine's model facts (its compat hash is theirs)
    compat_hash: str
    ranks: dict[int, RankCache]
    _closed: bool
    _closing: threading.Event  # set first thing in close(): cuts side-channel waits short
    _helpers: ThreadSet  # contact, preconnect and recheck threads, joined by close()
    _lock: threading.Lock  # the peers dict
    _engine_lock: threading.RLock  # NIXL calls and peer bookkeeping
    _peers: dict[str, PeerInfo]
    _watched: dict[str, tuple[float, float]]  # preconnect addresses (under _lock)
    _contacting: int  # first-contact threads running (under _lock)
    _contact_queue: deque[PeerInfo]  # new producers waiting for one of them (under _lock)
    _agent_users: dict[str, set[int]]  # remote agent -> ids of peers using it (engine lock)
    _monitor: PeerMonitor
    _inbox: Inbox
    generation: int

    @property
    def address(self) -> str:
        raise NotImplementedError  # the consumer's side-channel endpoint

    def _generations_ended(self, generations: set[int]) -> None:
        raise NotImplementedError  # the consumer's: settle pushes, end blind quarantines

    _progress: Progress

    def connect(self, address: str, timeout_s: float | None = None) -> PeerInfo:
        """Contact ``address`` now (blocking) unless already known; raise its error if it failed."""
        if timeout_s is not None:
            check_seconds("timeout_s", timeout_s)
        peer = self._peer(address)
        if not peer.ready.wait(
            self.config.handshake_timeout_s * 2 if timeout_s is None else timeout_s
        ):
            raise PeerLostError(f"first contact with {address} did not finish")
        if peer.error is not None:
            raise peer.error
        return peer

    def preconnect(
        self, addresses: Sequence[str], *, retry_for_s: float = 600.0, interval_s: float = 1.0
    ) -> threading.Thread:
        """Contact producers before any request names them (a background thread).

        A producer that does not answer yet is tried again every ``interval_s`` for up to
        ``retry_for_s`` (it may start after this consumer); one whose layout cannot pair
        with ours is logged and not retried. Requests to an address contacted here skip
        first contact. The addresses stay watched: when a producer there is dropped (the
        heartbeat lost it, or a request found it restarted), the address is contacted
        again the same way, so its next incarnation is ready before a request names it.
        Returns the (daemon) thread; it ends when every address is connected, when
        ``retry_for_s`` has passed, or soon after :meth:`close`.
        """
        check_seconds("retry_for_s", retry_for_s)
        check_seconds("interval_s", interval_s)
        for a in addresses:
            if not isinstance(a, str) or not a.strip():
                raise ConfigError(f"preconnect: an address must be a non-empty string, got {a!r}")
        with self._lock:
            self._watched.update({a: (retry_for_s, interval_s) for a in addresses})
        return self._start_preconnect(list(addresses), retry_for_s, interval_s)

    def _start_preconnect(
        self, addresses: list[str], retry_for_s: float, interval_s: float
    ) -> threading.Thread:
        return self._helpers.spawn(self._preconnect_loop, (addresses, retry_for_s, interval_s),
                                   "kvxfer-preconnect")  # fmt: skip

    def _join_helpers(self, within_s: float) -> None:
        """Wait up to ``within_s`` in all for the helper threads (``_closing`` is set, so
        their side-channel waits end within ``CANCEL_POLL_S``); log those still running."""
        if getattr(self._engine_lock, "_is_owned", lambda: False)():
            # close() from a request's end callback (or any holder of the engine lock): a
            # cancelled contact needs that lock to end, so it is not waited for here
            log.debug("close under the engine lock: helper threads end on their own")
            return
        left = self._helpers.join(within_s)
        if left:
            log.error("close: %d helper thread(s) still running after %.0f s: %s",
                      len(left), within_s, left)  # fmt: skip

    def _preconnect_loop(self, pending: list[str], retry_for_s: float, interval_s: float) -> None:
        end = time.monotonic() + retry_for_s
        while pending and not self._closed:
            for address in list(pending):
                try:
                    self.connect(address)
                    pending.remove(address)
                    log.info("preconnect: %s ready", address)
                except LayoutError as e:  # incompatible: trying again cannot help
                    pending.remove(address)
                    log.warning("preconnect: %s refused: %s", address, e)
                except KvxferError as e:
                    log.debug("preconnect: %s not reachable yet: %s", address, e)
                if self._closed:
                    return
            now = time.monotonic()
            if pending and now >= end:
                log.warning("preconnect: gave up on %s after %g s", pending, retry_for_s)
                return
            stop = min(end, now + interval_s)
            while not self._closed and time.monotonic() < stop:
                time.sleep(min(0.1, interval_s))

    def _peer(self, address: str) -> PeerInfo:
        """The producer at ``address``: known, or new and contacted by one of at most
        ``config.max_contacts`` threads. A new one past that waits in a queue of
        ``MAX_QUEUED_CONTACTS``; past that, it comes back failed (not remembered)."""
        with self._lock:
            peer = self._peers.get(address)
            if peer is not None:
                peer.wanted_at = time.monotonic()
                return peer
            peer = PeerInfo(address, wanted_at=time.monotonic())
            start = self._contacting < self.config.max_contacts
            if start:
                self._contacting += 1
            elif len(self._contact_queue) < MAX_QUEUED_CONTACTS:
                peer.enter("queued")
                self._contact_queue.append(peer)
            else:
                peer.error = PeerLostError(
                    f"{address}: not contacted: {len(self._contact_queue)} first contacts are "
                    f"waiting behind {self.config.max_contacts} in flight (max_contacts)"
                )
                peer.ready.set()
                return peer
            self._peers[address] = peer
        if start:
            self._helpers.spawn(self._contact_loop, (peer,), "kvxfer-handshake")
        return peer

    def _contact_loop(self, peer: PeerInfo | None) -> None:
        """One first-contact thread: ``peer``, then queued producers until none is left."""
        try:
            while peer is not None:
                self._handshake(peer)
                peer = self._next_queued()
        except BaseException:  # pragma: no cover - _handshake catches; keep the count right
            with self._lock:
                self._contacting -= 1
            raise

    def _next_queued(self) -> PeerInfo | None:
        """The next queued producer a request still waits for (None: this thread ends).
        Queued producers nobody waits for any more (their requests ended; none asked in
        ``QUEUE_GRACE_S``) are dropped, failed, without a contact."""
        waited = {id(t.peer) for t in self._inbox.live() if not t.state.is_terminal}
        dropped = []
        closed: list[PeerInfo] = []
        with self._lock:
            if self._closed:  # nobody is contacted any more: those queued fail now
                closed.extend(self._contact_queue)
                self._contact_queue.clear()
                for peer in closed:
                    if self._peers.get(peer.address) is peer:
                        del self._peers[peer.address]
            while self._contact_queue:
                peer = self._contact_queue.popleft()
                recent = time.monotonic() - peer.wanted_at < QUEUE_GRACE_S
                if id(peer) in waited or recent:
                    return peer
                dropped.append(peer)
                if self._peers.get(peer.address) is peer:
                    del self._peers[peer.address]
            self._contacting -= 1
        for peer in closed:
            peer.error = ClosedError(f"{peer.address}: not contacted: the consumer closed")
            peer.ready.set()
        for peer in dropped:
            peer.error = PeerLostError(f"{peer.address}: not contacted: no request waits for it")
            peer.ready.set()
        if dropped:
            log.info("first contact: %d queued producer(s) dropped: no request waits for them",
                     len(dropped))  # fmt: skip
        return None

    def _fetch_records(self, peer: PeerInfo) -> dict[str, list[LayoutRecord]]:
        """Every rank's record from each of the peer's endpoints (this engine's hash, timeout
        and key); raises like :func:`fetch_records` (an IncompatibleError names the model
        facts that differ)."""
        return {
            ep: fetch_records(
                ep,
                None,
                self.compat_hash,
                self.config.handshake_timeout_s,
                auth_key=self.config.auth_key,
                facts=self.facts,
                cancel=self._closing,
            )
            for ep in peer.endpoints
        }

    def _handshake(self, peer: PeerInfo) -> None:
        t0 = time.perf_counter()
        try:
            # one endpoint per producer process: "tcp://a:1" or "tcp://a:1,tcp://b:1,..."
            by_endpoint = self._fetch_records(peer)
            recs = [r for rs in by_endpoint.values() for r in rs]
            if len({r.tp_rank for r in recs}) != len(recs):
                raise LayoutError(f"{peer.address}: several records claim the same TP rank")
            layouts = {r.tp_rank: layout_from_record(r) for r in recs}
            peer.generations = {r.tp_rank: r.generation for r in recs}
            peer.endpoint_generations = {
                ep: {r.generation for r in rs} for ep, rs in by_endpoint.items()
            }
            peer.holds = {r.tp_rank: (r.hold_addr, r.hold_slots) for r in recs}
            names = {r.tp_rank: r.agent_name for r in recs}
            t1 = time.perf_counter()  # fetched and decoded
            peer.enter("build")
            # plan before touching NIXL: an incompatible peer leaves no agent behind
            runs = self.config.run_blocks
            peer.plans = {
                d: pair_layouts(c.layout, layouts, max_run_blocks=runs)
                for d, c in self.ranks.items()
            }
            peer.mem_kinds = {
                r: single_place(region_places(lay.regions), f"{peer.address} rank {r} regions")[0]
                for r, lay in layouts.items()
            }
            for d, plan in peer.plans.items():
                if plan.kernel_bsr > 1 and self.ranks[d].mem_kind is not MemKind.DRAM:
                    raise ConfigError(
                        f"{peer.address}: its blocks ({plan.kernel_bsr}x smaller kernel "
                        f"blocks) need a relayout after the transfer, which runs on the host; "
                        f"rank {d}'s cache is device memory ({self.ranks[d].mem_kind.value})"
                    )
            t2 = time.perf_counter()
            peer.enter("add_agent")
            with self._engine_lock:
                if self._closed:
                    raise ClosedError("consumer closed during first contact")
                self._add_agents(peer, recs, names)
            t3 = time.perf_counter()
            peer.enter("prepare")
            with self._engine_lock:
                if self._closed:
                    raise ClosedError("consumer closed during first contact")
                self._prepare(peer, names)
            t4 = time.perf_counter()
            peer.enter("wire_up")
            with self._engine_lock:
                if self._closed:
                    raise ClosedError("consumer closed during first contact")
                self._wire_up(peer)
            t5 = time.perf_counter()
            peer.enter("ready")
            peer.timings_s = {
                "fetch": t1 - t0,
                "build": t2 - t1,
                "add_agent": t3 - t2,
                "prepare": t4 - t3,
                "wire_up": t5 - t4,
            }
            self._monitor.watch(peer.address, peer.endpoint_generations)
        except KvxferError as e:
            self._contact_failed(peer, e)
        except Exception as e:  # any other error (a ZMQ one too) fails this contact, typed
            log.warning("first contact with %s failed: %r", peer.address, e)
            err = PeerLostError(f"first contact with {peer.address}: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._contact_failed(peer, err)
        finally:
            peer.ready.set()
            self._progress.kick()  # requests waiting on this contact can post now

    def _contact_failed(self, peer: PeerInfo, error: KvxferError) -> None:
        peer.error = error
        with self._lock:
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]  # the next request tries again
        with self._engine_lock:
            if not self._closed:
                self._release_peer(peer)  # what it had added or prepared before it failed

    def _add_agents(
        self, peer: PeerInfo, recs: Sequence[LayoutRecord], names: dict[int, str]
    ) -> None:
        """Load each producer rank's agent on every local rank, unless another peer (the
        same producer under another spelling of its address: agent names carry the
        producer's generation) loaded it already; loading it again would release that
        peer's lists. Engine lock held."""
        peer.agents = dict(names)  # before loading: a failure below releases what was
        for rec in recs:
            users = self._agent_users.get(rec.agent_name)
            if not users:  # a user is counted only once every local rank has the agent
                loaded = []
                try:
                    for cache in self.ranks.values():
                        cache.backend.add_remote(rec.agent_metadata)
                        loaded.append(cache)
                except BaseException:
                    for cache in loaded:
                        with contextlib.suppress(KvxferError):
                            cache.backend.remove_remote(rec.agent_name)
                    raise
            self._agent_users.setdefault(rec.agent_name, set()).add(id(peer))

    def _release_peer(self, peer: PeerInfo) -> None:
        """Release a peer's prepared lists, and each of its agents no other peer uses
        (engine lock held; the peer is out of ``_peers``). Idempotent."""
        lists = [*(x for pair in peer.lists.values() for x in pair), *peer.hold_lists.values()]
        peer.lists, peer.hold_lists = {}, {}
        release_each(lists, f"{peer.address}'s lists")
        for agent in peer.agents.values():
            users = self._agent_users.get(agent)
            if users is None or id(peer) not in users:
                continue
            users.discard(id(peer))
            if users:
                continue  # another spelling of this producer's address still uses it
            del self._agent_users[agent]
            for cache in self.ranks.values():
                try:
                    cache.backend.remove_remote(agent)
                except KvxferError as e:
                    log.debug("remove_remote %s: %s", agent, e)

    def _prepare(self, peer: PeerInfo, names: dict[int, str]) -> None:
        for d, plan in peer.plans.items():
            backend, cache_kind = self.ranks[d].backend, self.ranks[d].mem_kind
            for src in plan.sources:
                strided, theirs = self.config.strided, peer.mem_kinds[src.rank]
                loc = backend.prepare(src.local_rows, strided=strided, mem_kind=cache_kind)
                rem = backend.prepare(
                    src.remote_rows, names[src.rank], strided=strided, mem_kind=theirs
                )
                peer.lists[(d, src.rank)] = (loc, rem)
                peer.num_rows += src.num_rows * 2
                peer.num_descriptors += loc.num_descriptors + rem.num_descriptors
                addr, slots = peer.holds.get(src.rank, (0, 0))
                if slots:  # its hold table: one strided row (kvxfer.engine.holds)
                    row = np.array([[addr, SLOT_BYTES, 0, SLOT_BYTES, slots]], np.uint64)
                    peer.hold_lists[(d, src.rank)] = backend.prepare(row, names[src.rank])
            self.ranks[d].words_list_ready()

    def _wire_up(self, peer: PeerInfo) -> None:
        """Send each producer rank one ``Heartbeat`` from each of our ranks: UCX wires a
        path on its first use (2-7 ms measured here, more under load), which then
        happens during first contact instead of in the first request's post. With
        ``push_contact`` it names this engine, and the producer contacts us back now."""
        me = self.address if self.config.push_contact else ""
        for cache in self.ranks.values():
            for rank, agent in peer.agents.items():
                hb = Heartbeat(peer.generations[rank], me, self.generation if me else 0)
                cache.backend.send_notif(agent, encode_msg(hb))

    def _drop_peer(self, peer: PeerInfo) -> None:
        """Forget a dead or restarted peer: its agents, lists and handles become invalid."""
        with self._engine_lock:
            with self._lock:
                if self._peers.get(peer.address) is not peer:
                    return  # already dropped (or replaced by a newer handshake)
                del self._peers[peer.address]
                self._monitor.forget(peer.address)
                watched = self._watched.get(peer.address)
            if peer.error is None:  # requests still naming it end PEER_LOST, saying why
                peer.error = PeerLostError(f"{peer.address}: dropped (restarted or lost)")
            for t in self._inbox.live():  # while its agents are loaded: a producer taken
                if t.peer is peer and not t.state.is_terminal:  # for lost may be alive
                    t.send_abort(RequestState.PEER_LOST)
            self._release_peer(peer)
        if watched is not None and not self._closed:
            log.info("preconnect: %s dropped; contacting it again", peer.address)
            self._start_preconnect([peer.address], *watched)

    def _recheck(self, t: Transfer) -> None:
        """A request pinned to another generation than the peer's: refetch the producer's
        records (in a thread) and compare before dropping anything. Same generations as
        known: the pin is wrong, only this request fails (the peer stays, so concurrent
        reads that pinned the right generation go on). Changed: the producer restarted
        unnoticed, so the peer is dropped and contacted again (once per request)."""
        if t.rechecked:  # already re-handshaken for this request: the pin is wrong
            self._wrong_pin(t)
        if t.recheck is None:
            t.recheck = Future()
            self._helpers.spawn(self._fetch_generations, (t.peer, t.recheck), "kvxfer-recheck")
            return
        if not t.recheck.done():
            return
        try:
            now = t.recheck.result()
        except KvxferError as e:
            t.keep_peer = True  # the heartbeat decides about the peer, not this request
            raise PeerLostError(
                f"request {t.request_id!r}: rechecking {t.peer.address}: {e}"
            ) from e
        if now == t.peer.generations:
            self._wrong_pin(t)
        # the incarnations replaced there are gone: pushes from them are settled, READs
        # of theirs released with the peer no longer quarantine their blocks
        self._generations_ended(set(t.peer.generations.values()) - set(now.values()))
        t.rechecked = True
        self._drop_peer(t.peer)
        t.peer = self._peer(t.peer.address)

    def _wrong_pin(self, t: Transfer) -> NoReturn:
        t.keep_peer = True
        raise PeerLostError(
            f"request {t.request_id!r} was prefilled by generation {t.generation}; "
            f"{t.peer.address} runs {t.peer.generations}"
        )

    def _fetch_generations(self, peer: PeerInfo, out: Future[dict[int, int]]) -> None:
        try:
            recs = [r for rs in self._fetch_records(peer).values() for r in rs]
            out.set_result({r.tp_rank: r.generation for r in recs})
        except KvxferError as e:
            out.set_exception(e)
        except Exception as e:  # typed, chained
            err = PeerLostError(f"{peer.address}: {type(e).__name__}: {e}")
            err.__cause__ = e
            out.set_exception(err)
