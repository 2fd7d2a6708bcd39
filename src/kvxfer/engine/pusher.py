"""Push mode on the producer: WRITE a request into blocks the consumer names.

A consumer rank sends a :class:`~kvxfer.wire.PushRequest` notification to each of
its source ranks. The producer's :class:`PushWorker` fetches the consumer engine's
records on first contact (over the consumer's side channel), pairs the layouts from
the consumer's point of view, prepares the two lists on the producer rank's agent and
posts one WRITE per (consumer rank, producer rank) with a ``WriteDone`` notification.
Failures are told to the consumer with ``Failed``; one that cannot be (the consumer's
agent was never loaded: its records could not be fetched or installed) is remembered
for the consumer's heartbeat to ask about over the side channel
(:meth:`PushWorker.failures`, :class:`~kvxfer.wire.GetPushStatus`). A push naming a hold ticket
(:mod:`kvxfer.engine.holds`) is refused if this rank has ended that hold, and its
completed WRITE does not free the hold: the consumer's ``ReadDone``, sent after it
checked the hold's slot word, does.

Deadlines and cancellation: a job carries its local deadline (see
:class:`~kvxfer.wire.PushRequest`); the worker never starts a WRITE past it, releases a
posted WRITE still running at it, and drops or releases a job on ``Abort``. Whenever
it gives up on an attempt it tells the consumer with ``Cancelled`` (nothing more of
that attempt will be written), which ends the consumer's quarantine of those blocks.
A job is bound to the agent that sent its PushRequest, and that agent must be the
consumer rank's agent in the records at ``consumer_address``; an Abort is obeyed only
from it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import cast

from kvxfer.engine.config import CLOSE_JOIN_S
from kvxfer.engine.holds import HoldVerdict, slot_of, verdict
from kvxfer.engine.push_peer import ConsumerPeer, PushJob, consumer_peer
from kvxfer.engine.rank import RankCache
from kvxfer.engine.threads import ThreadSet
from kvxfer.errors import (
    HoldEndedError,
    KvxferError,
    PeerLostError,
    TransferError,
)
from kvxfer.planning.request import RequestIds
from kvxfer.transport.handles import release_each
from kvxfer.transport.nixl import XferOp, XferState
from kvxfer.transport.side_client import fetch_records
from kvxfer.wire import (
    MAX_LEASE_IDS,
    Failed,
    LayoutRecord,
    ModelFacts,
    PushFailure,
    PushRequest,
    WriteDone,
    encode_msg,
)
from kvxfer.wire.messages import Cancelled

__all__ = ["PushWorker"]

log = logging.getLogger(__name__)


MAX_CANCELLED = 4096  # remembered cancelled attempts not queued here (a bounded LRU)
MAX_UNTOLD = 4096  # remembered failures no Failed could announce (a bounded LRU)
# a cancelled WRITE that NIXL still runs this long past its deadline is released (not
# confirmed: its consumer's quarantine ends at its own bound, deadline + lease_s)
CANCEL_LINGER_S = 60.0
MAX_FETCHES = 8  # consumer records fetched at once (each in its own short-lived thread)
MAX_PARKED = 256  # pushes waiting for one consumer's records
# consumer engines known at once; past it the least recently used idle one is forgotten
MAX_CONSUMERS = 1024


_Cmd = tuple[str, object] | None


class PushWorker:
    """Serves PushRequests for the ranks of one producer engine, in one thread.

    Thread-safety: :meth:`submit`, :meth:`cancel` and :meth:`close` may be called from
    any thread (they queue commands), and :meth:`failures` (the side channel's thread
    reads the untold failures under ``_lock``); every NIXL call of push mode runs on the
    push thread. The loop survives any exception: the one job fails with a typed error
    (``Failed`` to its consumer) and the first such error is logged.

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
        auth_key: bytes | None = None,
        held_ids: Callable[[str], frozenset[int] | None] = lambda _: None,
        facts: ModelFacts | None = None,
        is_bound: Callable[[str], bool] = lambda _: False,
    ) -> None:
        self._auth_key = auth_key
        self._facts = facts  # this engine's model facts: a mismatch names what differs
        self._ranks = ranks
        self._generation = generation
        self._hash = compat_hash
        self._timeout_s = timeout_s
        self._on_written = on_written
        self._held_ids = held_ids
        self._is_bound = is_bound
        self._strided = strided
        self._run_blocks = run_blocks
        self._jobs: queue.Queue[_Cmd] = queue.Queue()
        self._closing = threading.Event()  # set by close(): consumer fetches end at once
        self._fetchers = ThreadSet()  # kvxfer-push-fetch threads, joined by close()
        self._peers: dict[str, ConsumerPeer] = {}
        # address -> the incarnation a known consumer's announcement last refetched it for
        self._refetched: dict[str, int] = {}
        self._fetching: dict[str, list[PushJob]] = {}  # address -> jobs waiting for its records
        self._writes: list[PushJob] = []
        self._lock = threading.Lock()  # cancel marks and the untold failures
        self._cancelled: OrderedDict[tuple[int, str, int], None] = OrderedDict()
        # attempt -> (consumer rank, producer rank) -> a failure no Failed could announce
        self._untold: OrderedDict[int, dict[tuple[int, int], PushFailure]] = OrderedDict()
        # attempts queued or parked here (how many jobs), and those of them cancelled:
        # exact, so no flood of other Aborts pushes a queued job's cancel out of the LRU
        self._pending: Counter[tuple[int, str, int]] = Counter()
        self._cancelled_pending: set[tuple[int, str, int]] = set()
        self.num_failed = 0
        self.num_cancelled = 0
        self.num_errors = 0
        self._thread = threading.Thread(target=self._run, name="kvxfer-push", daemon=True)
        self._thread.start()

    def failures(self, attempts: tuple[int, ...]) -> tuple[PushFailure, ...]:
        """The remembered failures of these push attempts that no ``Failed`` could
        announce (any thread: the side channel's answers GetPushStatus from it)."""
        found: list[PushFailure] = []
        with self._lock:
            for a in dict.fromkeys(attempts):
                found.extend(self._untold.get(a, {}).values())
        return tuple(found[:MAX_LEASE_IDS])

    def submit(self, rank: int, sender: str, req: PushRequest, deadline: float) -> None:
        """Queue a push request received by producer rank ``rank`` from agent ``sender``;
        no WRITE of it starts after ``deadline`` (monotonic seconds)."""
        job = PushJob(rank, sender, req, deadline, key=(rank, sender, req.attempt))
        with self._lock:
            self._pending[job.key] += 1
        self._jobs.put(("push", job))

    def precontact(self, address: str, generation: int) -> None:
        """A consumer announced itself (``Heartbeat`` with its address): fetch its records
        and add its agents now, so its first push finds it contacted. Only an address
        not known, or known with another incarnation than ``generation`` (it restarted
        there; 0: any), and not being fetched is contacted, within the MAX_FETCHES
        bound; a fetch that finds the incarnation already known keeps it (with its
        WRITEs in flight); a failed fetch is only logged (its first push contacts it
        again)."""
        self._jobs.put(("precontact", (address, generation)))

    def cancel(self, rank: int, sender: str, request_id: str, attempt: int) -> None:
        """Abort from ``sender``: drop queued jobs of ``attempt`` at once, release its
        posted WRITE on the push thread, then confirm with ``Cancelled``."""
        key = (rank, sender, attempt)
        with self._lock:
            if key in self._pending:
                self._cancelled_pending.add(key)
            else:
                self._remember_cancelled(key)
        self._jobs.put(("cancel", (rank, sender, request_id, attempt)))

    def close(self) -> None:
        """Stop the push thread, then release its WRITEs in flight (each release that
        fails is logged; the others go on). A thread that did not stop within
        ``CLOSE_JOIN_S`` may still use them: they are left to the agent's teardown."""
        self._closing.set()
        self._jobs.put(None)
        end = time.monotonic() + CLOSE_JOIN_S
        self._thread.join(CLOSE_JOIN_S)
        # cancelled: each fetch ends within CANCEL_POLL_S
        if self._fetchers.join(max(0.0, end - time.monotonic())):
            log.error("close: a consumer fetch did not stop within %.0f s", CLOSE_JOIN_S)
        if self._thread.is_alive():
            log.error("push thread did not stop within %.0f s; its %d WRITEs in flight are "
                      "left to the agent's teardown", CLOSE_JOIN_S, len(self._writes))  # fmt: skip
            return
        writes = [job.xfer for job in self._writes if job.xfer is not None]
        release_each(writes, "a WRITE at close", logging.WARNING)
        self._writes = []

    def _run(self) -> None:
        while True:
            try:
                active = any(not j.cancelled for j in self._writes)
                cmd = self._jobs.get(timeout=0.0005 if active else 0.01 if self._writes else 0.05)
                if cmd is None:
                    return
                self._do(cmd)
            except queue.Empty:
                pass
            except Exception as e:  # never dies: the job already failed typed in _do
                self._log_error(e)
            try:
                self._poll()
            except Exception as e:
                self._log_error(e)

    def _log_error(self, e: Exception) -> None:
        self.num_errors += 1
        if self.num_errors == 1:
            log.exception("push worker error (logged once, counted after): %s", e)

    def _do(self, cmd: tuple[str, object]) -> None:
        kind, arg = cmd
        if kind == "fetched":
            address, out = cast(tuple[str, list[LayoutRecord] | Exception], arg)
            self._fetched(address, out)
            return
        if kind == "cancel":
            rank, sender, rid, attempt = cast(tuple[int, str, str, int], arg)
            self._cancel(rank, sender, rid, attempt)
            return
        if kind == "precontact":
            address, generation = cast(tuple[str, int], arg)
            peer = self._peers.get(address)
            # a known consumer is fetched again only when it names another incarnation
            # (it restarted there); the fetch goes to its address, and _install keeps an
            # entry whose agents did not change, so a false announcement costs one fetch
            known = peer is not None and generation in (0, peer.generation)
            if peer is not None and not known:  # one refetch per announced incarnation
                known = self._refetched.get(address) == generation
                self._refetched[address] = generation
                while len(self._refetched) > MAX_CONSUMERS:
                    del self._refetched[next(iter(self._refetched))]
            if not known and address not in self._fetching and len(self._fetching) < MAX_FETCHES:
                self._start_fetch(address, [])
            return
        assert isinstance(arg, PushJob)
        arg.parked = False
        try:
            self._start(arg)
        except KvxferError as e:
            self._fail(arg, e)
        except Exception as e:  # a non-kvxfer error fails this job only, typed, chained
            err = TransferError(f"push {arg.req.request_id!r}: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._fail(arg, err)
            raise
        finally:
            if not arg.parked:  # posted, confirmed or failed: a later Abort finds its WRITE
                self._unpend(arg)

    def _unpend(self, job: PushJob) -> None:
        if not job.pending:
            return
        job.pending = False
        key = job.key  # as submitted (a job bound to no one has its sender blanked since)
        with self._lock:
            self._pending[key] -= 1
            if self._pending[key] <= 0:
                del self._pending[key]
                if key in self._cancelled_pending:  # later jobs of it (none expected) too
                    self._cancelled_pending.discard(key)
                    self._remember_cancelled(key)

    def _remember_cancelled(self, key: tuple[int, str, int]) -> None:
        """Mark an attempt not queued here cancelled, in the bounded LRU (lock held)."""
        self._cancelled[key] = None
        while len(self._cancelled) > MAX_CANCELLED:
            self._cancelled.popitem(last=False)

    def _is_cancelled(self, job: PushJob) -> bool:
        with self._lock:
            return job.key in self._cancelled_pending or job.key in self._cancelled

    def _confirm(self, job: PushJob) -> None:
        """Tell the job's consumer rank nothing more of this attempt will be written."""
        self.num_cancelled += 1
        msg = Cancelled(job.req.request_id, self._generation, job.req.attempt, job.rank)
        self._notify(job.rank, job.sender, msg)

    def _notify(self, rank: int, agent: str, msg: Cancelled | Failed) -> None:
        if not self._known(agent):
            return  # never added: nothing was (or can be) written there
        try:
            self._ranks[rank].backend.send_notif(agent, encode_msg(msg))
        except KvxferError as e:
            log.debug("notice to %s: %s", agent, e)

    def _known(self, agent: str) -> bool:
        return any(agent in p.agents.values() for p in self._peers.values())

    def _cancel(self, rank: int, sender: str, request_id: str, attempt: int) -> None:
        """Abort of ``attempt``: a WRITE of it NIXL still runs is not released (that does
        not stop it) but marked; ``Cancelled`` goes once it ended (:meth:`_poll`).
        Otherwise ``Cancelled`` goes now (idempotent: also for jobs done or never seen)."""
        running = False
        for job in self._writes:
            if job.key == (rank, sender, attempt):
                job.cancelled = True
                running = True
        if not running:
            msg = Cancelled(request_id, self._generation, attempt, rank)
            self._notify(rank, sender, msg)

    def _release(self, job: PushJob) -> None:
        if job.xfer is not None:
            release_each([job.xfer], "a WRITE")
            job.xfer = None

    def _peer(self, address: str, generation: int) -> ConsumerPeer | None:
        """The consumer peer at ``address`` (of ``generation``, 0: any), or None when its
        records are still being fetched."""
        peer = self._peers.get(address)
        if peer is not None and generation in (0, peer.generation):
            self._peers[address] = self._peers.pop(address)  # most recently used last
            return peer
        return None

    def _park(self, job: PushJob) -> None:
        """Park a job until its consumer's records arrive; fetch them in another thread
        (bounded: MAX_FETCHES addresses at once, MAX_PARKED jobs per address)."""
        address = job.req.consumer_address
        parked = self._fetching.get(address)
        if parked is not None:
            if len(parked) >= MAX_PARKED:
                raise TransferError(f"{MAX_PARKED} pushes already wait for {address}")
            parked.append(job)
            job.parked = True
            return
        if len(self._fetching) >= MAX_FETCHES:
            raise TransferError(f"{MAX_FETCHES} consumer contacts already in progress")
        self._start_fetch(address, [job])
        job.parked = True

    def _start_fetch(self, address: str, jobs: list[PushJob]) -> None:
        self._fetching[address] = jobs
        self._fetchers.spawn(self._fetch, (address,), "kvxfer-push-fetch")

    def _fetch(self, address: str) -> None:
        try:
            out: list[LayoutRecord] | Exception = fetch_records(
                address, None, self._hash, self._timeout_s, auth_key=self._auth_key,
                facts=self._facts, cancel=self._closing,
            )  # fmt: skip
        except Exception as e:  # handed to the push thread, which fails the jobs typed
            out = e
        self._jobs.put(("fetched", (address, out)))

    def _fetched(self, address: str, out: list[LayoutRecord] | Exception) -> None:
        jobs = self._fetching.pop(address, [])
        try:
            if isinstance(out, Exception):
                if isinstance(out, KvxferError):
                    raise out
                raise TransferError(f"records of {address}: {type(out).__name__}: {out}") from out
            self._install(address, out)
        except KvxferError as e:
            if not jobs:
                log.info("contacting consumer %s ahead of its pushes failed: %s", address, e)
            for job in jobs:
                self._fail(job, e)
            return
        for job in jobs:
            try:
                self._do(("push", job))
            except Exception as e:  # that job already failed typed; the others go on
                self._log_error(e)

    def _install(self, address: str, recs: list[LayoutRecord]) -> None:
        old = self._peers.get(address)
        if old is not None:
            if set(old.agents.values()) == {r.agent_name for r in recs}:
                # the same incarnation (a request naming a stale generation had it fetched
                # again): keep its entry and the WRITEs in flight to it
                return
            self._drop(address)  # the consumer restarted at this address: forget the old one
        self._forget_idle(MAX_CONSUMERS - 1)
        self._peers[address] = consumer_peer(address, recs, self._ranks, self._run_blocks)

    def _forget_idle(self, keep: int) -> None:
        """Forget the least recently used consumers with no WRITE in flight until at most
        ``keep`` are known (a consumer restarted on a new port never comes back; its
        agents would stay on every rank). A forgotten one is contacted again if it pushes."""
        for address in list(self._peers):
            if len(self._peers) <= keep:
                return
            agents = set(self._peers[address].agents.values())
            if not any(j.sender in agents for j in self._writes):
                self._drop(address)

    def _drop(self, address: str) -> None:
        peer = self._peers.pop(address)
        for job in [j for j in self._writes if j.sender in peer.agents.values()]:
            self._release(job)
        self._writes = [j for j in self._writes if j.xfer is not None]
        # ours too: remove_remote releases only the lists naming the consumer's agent
        release_each([x for pair in peer.lists.values() for x in pair], f"{address}'s lists")
        peer.lists.clear()
        for cache in self._ranks.values():
            for agent in peer.agents.values():
                try:
                    cache.backend.remove_remote(agent)  # its prepared lists go with it
                except KvxferError as e:
                    log.debug("remove_remote %s: %s", agent, e)

    def _start(self, job: PushJob) -> None:
        req, rank = job.req, job.rank
        if req.generation != self._generation:
            raise TransferError(
                f"push for generation {req.generation:x}, this is {self._generation:x}"
            )
        if self._is_cancelled(job) or time.monotonic() >= job.deadline:
            self._confirm(job)  # never start a write past the deadline or after Abort
            return
        peer = self._peer(req.consumer_address, req.consumer_generation)
        if peer is None:
            if job.fetched:
                raise TransferError(
                    f"{req.consumer_address} does not run generation {req.consumer_generation}"
                )
            job.fetched = True
            self._park(job)
            return
        if peer.agents.get(req.consumer_rank) != job.sender:
            job.sender = ""  # not the consumer it names: tell no one, write nothing
            raise TransferError(
                f"push {req.request_id!r} for consumer rank {req.consumer_rank} of "
                f"{req.consumer_address} did not come from that rank's agent"
            )
        if req.ticket:
            self._check_hold(rank, req)
        elif self._is_bound(req.request_id):
            raise TransferError(
                f"push {req.request_id!r} names no hold ticket, but its hold is bound to its "
                "params (kvxfer.engine.holds): nothing was written"
            )
        held = self._held_ids(req.request_id)
        if held is not None and not held.issuperset(req.remote_block_ids):
            stray = sorted(set(req.remote_block_ids) - held)[:8]
            raise TransferError(f"push {req.request_id!r}: blocks {stray} are not held for it")
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
            mine = backend.prepare(
                src.remote_rows, strided=self._strided, mem_kind=self._ranks[rank].mem_kind
            )
            try:
                theirs = backend.prepare(src.local_rows, job.sender, strided=self._strided,
                                         mem_kind=peer.mem_kinds[req.consumer_rank])  # fmt: skip
            except BaseException:
                mine.release()
                raise
            peer.lists[key] = (mine, theirs)
        mine, theirs = peer.lists[key]
        rp = RequestIds.of(
            req.local_block_ids, req.remote_block_ids, local_state=req.local_state_ids,
            remote_state=req.remote_state_ids, num_cached_blocks=req.num_cached_blocks,
        ).plan(plan)  # fmt: skip
        ids = next(i for i in rp.sources if i.rank == rank)
        done = WriteDone(req.request_id, self._generation, rank, len(self._ranks), req.attempt)
        if self._is_cancelled(job) or time.monotonic() >= job.deadline:
            self._confirm(job)  # the fetch took the time that was left
            return
        job.wrote = True  # from here its consumer's agent may receive something of it
        if ids.num_descriptors == 0:
            backend.send_notif(job.sender, encode_msg(done))
            self._written(job)
            return
        job.xfer = backend.make_xfer(
            XferOp.WRITE, mine, ids.remote_ids, theirs, ids.local_ids, encode_msg(done)
        )
        self._writes.append(job)
        backend.post(job.xfer)

    def _check_hold(self, rank: int, req: PushRequest) -> None:
        """A ticketed push writes only from a hold this rank has not ended (one not
        started yet is written: the consumer checks it after the WRITE)."""
        words = self._ranks[rank].words
        if not len(words):
            raise TransferError(
                f"push {req.request_id!r} names hold {req.ticket}, but rank {rank} keeps no "
                "hold table"
            )
        word = int(words[slot_of(req.ticket, len(words)), 0])
        if verdict(word, req.ticket) is HoldVerdict.RELEASED:
            raise HoldEndedError(
                f"push {req.request_id!r}: rank {rank} had ended hold {req.ticket} (slot word "
                f"{word:#x}): another consumer took these params first, an abort or the "
                "lease freed the blocks; nothing was written"
            )

    def _written(self, job: PushJob) -> None:
        """A WRITE of ``job`` completed. Unticketed, it counts as the consumer rank's read;
        ticketed, the consumer's ReadDone after its hold check frees the hold."""
        req = job.req
        if not req.ticket:
            self._on_written(req.request_id, job.rank, req.consumer_rank, req.consumer_size)

    def _poll(self) -> None:
        still = []
        now = time.monotonic()
        for job in self._writes:
            x = job.xfer
            if x is None:
                continue
            try:
                running = self._ranks[job.rank].backend.poll(x) is XferState.IN_PROGRESS
            except KvxferError as e:
                self._release(job)
                if job.cancelled:
                    self._confirm(job)  # it failed: nothing more of it lands
                else:
                    self._fail(job, e)
                continue
            if running:
                # the consumer gave up: Cancelled only once the WRITE ended (releasing it
                # does not stop it; a WRITE of a push that gave up is never started)
                job.cancelled = job.cancelled or now >= job.deadline
                if job.cancelled and now >= job.deadline + CANCEL_LINGER_S:
                    # not confirmed: that would end the consumer's quarantine while this
                    # may still land; its own bound (deadline + lease_s) ends it
                    log.warning("push %s: WRITE still in progress %.0f s past its deadline; "
                                "released, not confirmed", job.req.request_id,
                                CANCEL_LINGER_S)  # fmt: skip
                    self._release(job)
                    continue
                still.append(job)
                continue
            self._release(job)
            if job.cancelled:
                self._confirm(job)
            else:
                self._written(job)
        self._writes = still

    def _fail(self, job: PushJob, error: KvxferError) -> None:
        self._unpend(job)
        self.num_failed += 1
        self._release(job)
        self._writes = [j for j in self._writes if j is not job]
        req = job.req
        log.warning("push %s from rank %d failed: %s", req.request_id, job.rank, error)
        peer = self._peers.get(req.consumer_address)
        if (
            isinstance(error, PeerLostError)
            and peer is not None
            and job.sender in peer.agents.values()
        ):
            self._drop(req.consumer_address)  # disconnected: forget it (no leak, no stale agent)
            return
        if not job.sender:
            return  # not the consumer it names (a forged sender): tell no one
        reason = f"{type(error).__name__}: {error}"[:1000]
        if not job.wrote and not self._known(job.sender):
            # its consumer's agent was never loaded (its records could not be fetched or
            # installed): no Failed can go, and nothing was written there. Its heartbeat
            # asks over the side channel (GetPushStatus) instead of waiting its deadline.
            # Not if another job of the same attempt and ranks writes (a forged sender
            # with a copied attempt id, naming another address): the pair is not settled
            pair = (req.consumer_rank, job.rank)
            if any(j.req.attempt == req.attempt and (j.req.consumer_rank, j.rank) == pair
                   for j in self._writes):  # fmt: skip
                return
            failure = PushFailure(req.request_id, req.attempt, self._generation, job.rank,
                                  req.consumer_rank, reason)  # fmt: skip
            with self._lock:
                self._untold.setdefault(req.attempt, {})[pair] = failure
                self._untold.move_to_end(req.attempt)
                while len(self._untold) > MAX_UNTOLD:
                    self._untold.popitem(last=False)
            return
        self._notify(
            job.rank, job.sender, Failed(req.request_id, self._generation, reason, req.attempt)
        )
