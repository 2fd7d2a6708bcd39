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
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .engine import U8, EngineConfig, RankCache, RequestState, new_generation
from .errors import DeadlineError, KvxferError, LayoutError, PeerLostError
from .nixl_backend import PreparedList, XferHandle, XferOp, XferState
from .pairing import PeerPlan, pair_layouts
from .pattern import relayout_bsr
from .plan import plan_request
from .schema import Abort, ReadDone, encode_msg, layout_from_record
from .side_channel import fetch_records
from .spec import LayoutSpec

__all__ = ["Consumer", "PeerInfo", "Transfer"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PeerInfo:
    """A producer engine this consumer has contacted (or is contacting).

    Attributes:
        address: the producer's side-channel endpoint.
        generation: the producer incarnation the prepared lists belong to.
        timings_s: first-contact phases: fetch, add_agent, build, prepare.
        num_rows, num_descriptors: strided rows prepared vs descriptors they stand for.
    """

    address: str
    ready: threading.Event = field(default_factory=threading.Event)
    error: KvxferError | None = None
    generation: int = 0
    plans: dict[int, PeerPlan] = field(default_factory=dict)
    lists: dict[tuple[int, int], tuple[PreparedList, PreparedList]] = field(default_factory=dict)
    agents: dict[int, str] = field(default_factory=dict)  # remote rank -> agent name
    timings_s: dict[str, float] = field(default_factory=dict)
    num_rows: int = 0
    num_descriptors: int = 0
    remote_spec_block_size: int = 0


@dataclass(slots=True, eq=False)
class Transfer:
    """One request read by every (selected) local rank. Poll or wait; never blocks forever."""

    request_id: str
    consumer: Consumer
    peer: PeerInfo
    deadline: float
    local_ids: npt.NDArray[np.int64]
    remote_ids: npt.NDArray[np.int64]
    kwargs: dict[str, object]
    ranks: tuple[int, ...]
    state: RequestState = RequestState.PENDING
    error: KvxferError | None = None
    started_at: float = field(default_factory=time.perf_counter)
    posted_at: float = 0.0
    finished_at: float = 0.0
    num_descriptors: int = 0
    num_bytes: int = 0
    xfers: list[tuple[int, XferHandle]] = field(default_factory=list)  # (local rank, handle)
    notify: list[tuple[int, str]] = field(default_factory=list)  # (local rank, agent)

    def poll(self) -> RequestState:
        """Advance the request and return its state (terminal states stay put)."""
        return self.consumer._advance(self)

    def wait(self, timeout_s: float | None = None) -> RequestState:
        """Poll until terminal or ``timeout_s`` (the request's own deadline always applies)."""
        until = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.poll().is_terminal:
            if until is not None and time.monotonic() >= until:
                break
            time.sleep(0.0002)
        return self.state

    def result(self, timeout_s: float | None = None) -> None:
        """Wait; raise the request's error unless it ended DONE."""
        state = self.wait(timeout_s)
        if state is RequestState.DONE:
            return
        if self.error is not None:
            raise self.error
        raise DeadlineError(f"request {self.request_id!r} still {state.value} after {timeout_s} s")

    @property
    def latency_s(self) -> float:
        return (self.finished_at or time.perf_counter()) - self.started_at


class Consumer:
    """A consumer engine hosting ``len(ranks)`` TP ranks in this process.

    Args:
        config: engine settings (deadline, handshake timeout, strided or dense lists).
        ranks: per TP rank, its spec and region buffers (which must outlive this).
    """

    def __init__(
        self, config: EngineConfig, ranks: Sequence[tuple[LayoutSpec, Sequence[U8]]]
    ) -> None:
        if not ranks:
            raise LayoutError("a consumer needs at least one rank")
        self.config = config
        self.generation = new_generation()
        self.compat_hash = config.compat_hash(ranks[0][0])
        self._lock = threading.Lock()
        self._peers: dict[str, PeerInfo] = {}
        self.ranks: dict[int, RankCache] = {}
        try:
            for spec, bufs in ranks:
                name = f"{config.engine_id}-d{spec.tp_rank}-{self.generation:x}"
                self.ranks[spec.tp_rank] = RankCache(spec, bufs, name, config)
        except BaseException:
            self.close()
            raise

    # -- first contact --------------------------------------------------------------

    def connect(self, address: str, timeout_s: float | None = None) -> PeerInfo:
        """Contact ``address`` now (blocking) unless already known; raise its error if it failed."""
        peer = self._peer(address)
        if not peer.ready.wait(
            self.config.handshake_timeout_s * 2 if timeout_s is None else timeout_s
        ):
            raise PeerLostError(f"first contact with {address} did not finish")
        if peer.error is not None:
            raise peer.error
        return peer

    def _peer(self, address: str) -> PeerInfo:
        with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                peer = self._peers[address] = PeerInfo(address)
                threading.Thread(
                    target=self._handshake, args=(peer,), name="kvxfer-handshake", daemon=True
                ).start()
            return peer

    def _handshake(self, peer: PeerInfo) -> None:
        t0 = time.perf_counter()
        try:
            recs = fetch_records(
                peer.address, None, self.compat_hash, self.config.handshake_timeout_s
            )
            t1 = time.perf_counter()
            layouts = {r.tp_rank: layout_from_record(r) for r in recs}
            gens = {r.generation for r in recs}
            if len(gens) != 1:
                raise LayoutError(f"{peer.address}: records of several generations {sorted(gens)}")
            peer.generation = gens.pop()
            names = {r.tp_rank: r.agent_name for r in recs}
            for cache in self.ranks.values():
                for rec in recs:
                    cache.backend.add_remote(rec.agent_metadata)
            peer.agents = names
            t2 = time.perf_counter()
            peer.plans = {d: pair_layouts(c.layout, layouts) for d, c in self.ranks.items()}
            t3 = time.perf_counter()
            for d, plan in peer.plans.items():
                backend = self.ranks[d].backend
                for src in plan.sources:
                    loc = backend.prepare(src.local_rows, strided=self.config.strided)
                    rem = backend.prepare(
                        src.remote_rows, names[src.rank], strided=self.config.strided
                    )
                    peer.lists[(d, src.rank)] = (loc, rem)
                    peer.num_rows += src.num_rows * 2
                    peer.num_descriptors += loc.num_descriptors + rem.num_descriptors
            t4 = time.perf_counter()
            peer.timings_s = {
                "fetch": t1 - t0,
                "add_agent": t2 - t1,
                "build": t3 - t2,
                "prepare": t4 - t3,
            }
        except KvxferError as e:
            peer.error = e
            with self._lock:
                if self._peers.get(peer.address) is peer:
                    del self._peers[peer.address]  # the next request tries again
        finally:
            peer.ready.set()

    def _drop_peer(self, peer: PeerInfo) -> None:
        """Forget a dead or restarted peer: its agents, lists and handles become invalid."""
        with self._lock:
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
        for cache in self.ranks.values():
            for agent in peer.agents.values():
                try:
                    cache.backend.remove_remote(agent)
                except KvxferError as e:
                    log.debug("remove_remote %s: %s", agent, e)

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
    ) -> Transfer:
        """Start reading a request's blocks from the producer at ``address`` (pull mode).

        Returns at once; ids are validated against both pools when the request is
        posted (a bad id ends the request FAILED with a LayoutError). ``ranks``
        selects local ranks (default: all hosted ranks).
        """
        chosen = tuple(self.ranks) if ranks is None else tuple(ranks)
        for d in chosen:
            if d not in self.ranks:
                raise LayoutError(f"local rank {d} is not hosted here (have {sorted(self.ranks)})")
        deadline = time.monotonic() + (self.config.deadline_s if deadline_s is None else deadline_s)
        kwargs: dict[str, object] = {"num_cached_blocks": num_cached_blocks}
        if local_state_ids is not None:
            kwargs["local_state_ids"] = np.asarray(local_state_ids)
        if remote_state_ids is not None:
            kwargs["remote_state_ids"] = np.asarray(remote_state_ids)
        return Transfer(
            request_id, self, self._peer(address), deadline,
            np.asarray(local_block_ids), np.asarray(remote_block_ids), kwargs, chosen,
        )  # fmt: skip

    def _advance(self, t: Transfer) -> RequestState:
        if t.state.is_terminal:
            return t.state
        try:
            if time.monotonic() >= t.deadline:
                raise DeadlineError(f"request {t.request_id!r} passed its deadline")
            if not t.posted_at:
                if not t.peer.ready.is_set():
                    return t.state
                if t.peer.error is not None:
                    raise t.peer.error
                self._post(t)
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

    def _post(self, t: Transfer) -> None:
        peer = t.peer
        t.posted_at = time.perf_counter()
        for d in t.ranks:
            plan = peer.plans[d]
            req = plan_request(plan, t.local_ids, t.remote_ids, **t.kwargs)  # type: ignore[arg-type]
            backend = self.ranks[d].backend
            msg = encode_msg(ReadDone(t.request_id, peer.generation, d, self.ranks[d].spec.tp_size))
            for ids in req.sources:
                if ids.num_descriptors == 0:
                    t.notify.append((d, peer.agents[ids.rank]))
                    continue
                loc, rem = peer.lists[(d, ids.rank)]
                x = backend.make_xfer(XferOp.READ, loc, ids.local_ids, rem, ids.remote_ids, msg)
                t.xfers.append((d, x))
                t.num_descriptors += ids.num_descriptors
                src = next(s for s in plan.sources if s.rank == ids.rank)
                lens = np.repeat(src.local_rows[:, 1], np.diff(src.local_starts))
                t.num_bytes += int(lens[ids.local_ids].sum())
                if backend.post(x) is XferState.DONE:
                    pass  # polled (and released) below
            t.notify.extend((d, peer.agents[r]) for r in req.notify_only)

    def _finish(self, t: Transfer) -> None:
        for d in t.ranks:  # tell ranks that were not read (MLA, GQA dedup, empty) to free
            msg = encode_msg(
                ReadDone(t.request_id, t.peer.generation, d, self.ranks[d].spec.tp_size)
            )
            for dd, agent in t.notify:
                if dd == d:
                    self.ranks[d].backend.send_notif(agent, msg)
            plan = t.peer.plans[d]
            if plan.kernel_bsr > 1:
                cached = int(t.kwargs.get("num_cached_blocks", 0))  # type: ignore[call-overload]
                cache = self.ranks[d]
                relayout_bsr(cache.spec, cache.bufs, t.local_ids[cached:], plan.kernel_bsr)
        t.finished_at = time.perf_counter()
        t.state = RequestState.DONE

    def _fail(self, t: Transfer, error: KvxferError) -> None:
        for _, x in t.xfers:
            try:
                x.release()  # cancels in-flight work; buffers stay registered
            except KvxferError as e:
                log.debug("release after failure: %s", e)
        t.xfers = []
        t.error = error
        t.finished_at = time.perf_counter()
        if isinstance(error, PeerLostError):
            t.state = RequestState.PEER_LOST
            self._drop_peer(t.peer)
            return
        t.state = RequestState.TIMEOUT if isinstance(error, DeadlineError) else RequestState.FAILED
        if t.posted_at and t.peer.agents:  # tell every producer rank it may free the blocks
            for d in t.ranks:
                msg = encode_msg(Abort(t.request_id, t.peer.generation, t.state.value))
                for agent in set(t.peer.agents.values()):
                    try:
                        self.ranks[d].backend.send_notif(agent, msg)
                    except KvxferError as e:
                        log.debug("abort notice to %s: %s", agent, e)

    def close(self) -> None:
        """Release every agent and deregister memory. Idempotent."""
        for cache in self.ranks.values():
            cache.close()
        self.ranks = {}

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
