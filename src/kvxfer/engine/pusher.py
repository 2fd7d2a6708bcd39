"""Push mode on the producer: WRITE a request into blocks the consumer names.

A consumer rank sends a :class:`~kvxfer.wire.PushRequest` notification to each of
its source ranks. The producer's :class:`PushWorker` fetches the consumer engine's
records on first contact (over the consumer's side channel), pairs the layouts from
the consumer's point of view, prepares the two lists on the producer rank's agent and
posts one WRITE per (consumer rank, producer rank) with a ``WriteDone`` notification.
Failures are told to the consumer with ``Failed``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvxfer.engine.rank import RankCache
from kvxfer.errors import KvxferError, TransferError
from kvxfer.planning.pairing import PeerPlan, pair_layouts
from kvxfer.planning.request import plan_request
from kvxfer.transport.nixl import PreparedList, XferHandle, XferOp, XferState
from kvxfer.transport.side_channel import fetch_records
from kvxfer.wire import Failed, PushRequest, WriteDone, encode_msg, layout_from_record

__all__ = ["PushWorker"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _ConsumerPeer:
    agents: dict[int, str]  # consumer rank -> agent name
    plans: dict[int, PeerPlan]  # consumer rank -> its pairing with this producer engine
    lists: dict[tuple[int, int], tuple[PreparedList, PreparedList]] = field(default_factory=dict)


class PushWorker:
    """Serves PushRequests for the ranks of one producer engine, in one thread.

    Args:
        ranks: the producer's ranks by TP rank.
        generation: the producer's incarnation id (requests of others are refused).
        compat_hash: expected hash of consumer records.
        timeout_s: side-channel fetch timeout.
        on_written: called with ``(request_id, producer_rank, consumer_rank, consumer_size)``
            after a WRITE completed (the producer counts it as a read).
    """

    def __init__(
        self,
        ranks: dict[int, RankCache],
        generation: int,
        compat_hash: str,
        timeout_s: float,
        on_written: Callable[[str, int, int, int], None],
        strided: bool = True,
        run_blocks: int = 1,
    ) -> None:
        self._ranks = ranks
        self._generation = generation
        self._hash = compat_hash
        self._timeout_s = timeout_s
        self._on_written = on_written
        self._strided = strided
        self._run_blocks = run_blocks
        self._jobs: queue.Queue[tuple[int, PushRequest] | None] = queue.Queue()
        self._peers: dict[str, _ConsumerPeer] = {}
        self._writes: list[tuple[int, PushRequest, XferHandle, str]] = []
        self.num_failed = 0
        self._thread = threading.Thread(target=self._run, name="kvxfer-push", daemon=True)
        self._thread.start()

    def submit(self, rank: int, req: PushRequest) -> None:
        """Queue a push request received by producer rank ``rank``."""
        self._jobs.put((rank, req))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)
        for _, _, x, _ in self._writes:
            x.release()
        self._writes = []

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=0.0005 if self._writes else 0.05)
                if job is None:
                    return
                self._start(*job)
            except queue.Empty:
                pass
            self._poll()

    def _peer(self, address: str) -> _ConsumerPeer:
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        recs = fetch_records(address, None, self._hash, self._timeout_s)
        layouts = {r.tp_rank: layout_from_record(r) for r in recs}
        mine = {p: c.layout for p, c in self._ranks.items()}
        for cache in self._ranks.values():
            for rec in recs:
                cache.backend.add_remote(rec.agent_metadata)
        runs = self._run_blocks
        plans = {  # this process may host only some producer ranks: plan those
            d: pair_layouts(lay, mine, max_run_blocks=runs, require_all=False)
            for d, lay in layouts.items()
        }
        peer = self._peers[address] = _ConsumerPeer({r.tp_rank: r.agent_name for r in recs}, plans)
        return peer

    def _start(self, rank: int, req: PushRequest) -> None:
        agent = ""
        try:
            if req.generation != self._generation:
                raise TransferError(
                    f"push for generation {req.generation:x}, this is {self._generation:x}"
                )
            peer = self._peer(req.consumer_address)
            agent = peer.agents[req.consumer_rank]
            plan = peer.plans.get(req.consumer_rank)
            if plan is None:
                raise TransferError(f"unknown consumer rank {req.consumer_rank}")
            src = next((s for s in plan.sources if s.rank == rank), None)
            if src is None:
                raise TransferError(
                    f"consumer rank {req.consumer_rank} does not read producer rank {rank}"
                )
            backend = self._ranks[rank].backend
            key = (req.consumer_rank, rank)
            if key not in peer.lists:  # producer memory = the plan's remote side
                mine = backend.prepare(src.remote_rows, strided=self._strided)
                theirs = backend.prepare(src.local_rows, agent, strided=self._strided)
                peer.lists[key] = (mine, theirs)
            mine, theirs = peer.lists[key]
            rp = plan_request(
                plan,
                req.local_block_ids,
                req.remote_block_ids,
                local_state_ids=req.local_state_ids,
                remote_state_ids=req.remote_state_ids,
                num_cached_blocks=req.num_cached_blocks,
            )
            ids = next(i for i in rp.sources if i.rank == rank)
            done = encode_msg(WriteDone(req.request_id, self._generation, rank, len(self._ranks)))
            if ids.num_descriptors == 0:
                backend.send_notif(agent, done)
                self._on_written(req.request_id, rank, req.consumer_rank, req.consumer_size)
                return
            x = backend.make_xfer(XferOp.WRITE, mine, ids.remote_ids, theirs, ids.local_ids, done)
            backend.post(x)
            self._writes.append((rank, req, x, agent))
        except KvxferError as e:
            self._fail(rank, req, agent, e)

    def _poll(self) -> None:
        still = []
        for rank, req, x, agent in self._writes:
            try:
                if self._ranks[rank].backend.poll(x) is XferState.IN_PROGRESS:
                    still.append((rank, req, x, agent))
                    continue
                x.release()
                self._on_written(req.request_id, rank, req.consumer_rank, req.consumer_size)
            except KvxferError as e:
                x.release()
                self._fail(rank, req, agent, e)
        self._writes = still

    def _fail(self, rank: int, req: PushRequest, agent: str, error: KvxferError) -> None:
        self.num_failed += 1
        log.warning("push %s from rank %d failed: %s", req.request_id, rank, error)
        if not agent:
            return  # the consumer is unknown: it learns by its deadline
        try:
            msg = Failed(
                req.request_id, self._generation, f"{type(error).__name__}: {error}"[:1000]
            )
            self._ranks[rank].backend.send_notif(agent, encode_msg(msg))
        except KvxferError as e:
            log.debug("failure notice to %s: %s", agent, e)
