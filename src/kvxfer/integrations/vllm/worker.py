"""The worker side of the vLLM connector: kvxfer engines over vLLM's KV tensors.

Runs in each vLLM worker process (one TP rank). A prefill worker hosts a
:class:`~kvxfer.engine.Producer` (blocks held per request until read); a decode
worker hosts a :class:`~kvxfer.engine.Consumer` (one pull READ per request, or with
``transfer_mode`` "push" one request to the prefill to WRITE it, started without
blocking the forward pass and polled once per step; a step that runs no tokens waits
up to ``idle_wait_s`` for a transfer to end, see :meth:`WorkerSide.finished`). An
engine with ``kv_both`` hosts both. A load that did not end DONE is reported (failed)
only once nothing more can land in its blocks
(:attr:`~kvxfer.engine.Transfer.quarantined`: a late WRITE of a push, or a pull READ
NIXL still runs), so vLLM never recomputes into, or reuses, blocks a late transfer
could still overwrite.

State is owned by vLLM's worker thread (it calls every method here); the engines'
own threads are behind their public, thread-safe methods.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, Transfer
from kvxfer.integrations.vllm.extra import ExtraConfig
from kvxfer.integrations.vllm.layouts import spec_from_vllm_tensors
from kvxfer.integrations.vllm.scheduler import HoldJob, LoadJob
from kvxfer.integrations.vllm.stats import StatsTally

__all__ = ["WorkerSettings", "WorkerSide", "kv_cache_dtype"]

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.0005  # how often an idle step polls READs in flight (no event for them)
MAX_CONTACTS_SEEN = 4096  # peers remembered so that a first contact is counted once


@contextmanager
def threads_on_every_cpu() -> Iterator[None]:
    """Threads started inside may run on every CPU the process may use.

    vLLM's CPU worker pins its thread to the cores of its OpenMP team, and a thread
    inherits the affinity of the thread that starts it: without this, the engines'
    threads (side channel, heartbeat, NIXL's progress) would share those cores with
    the forward pass and wait for it. The calling thread's own affinity is restored.
    """
    if not hasattr(os, "sched_setaffinity"):  # not Linux
        yield
        return
    own = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError as e:  # a cpuset that refuses: keep the pinning, say so once
        log.warning("kvxfer threads stay on CPUs %s: %s", sorted(own), e)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What a worker needs to build its engines (from vLLM's config)."""

    engine_id: str
    tp_rank: int
    tp_size: int
    block_size: int
    num_kv_heads: int
    backend: str
    is_producer: bool
    is_consumer: bool
    model_name: str
    dtype: str
    extra: ExtraConfig = field(default_factory=ExtraConfig)  # the user's keys, checked
    kv_dtype: str = ""  # the KV cache's own dtype (kv_cache_dtype); "": the model's


def kv_cache_dtype(model_dtype: str, cache_dtype: str) -> str:
    """The dtype of a vLLM instance's KV bytes, for the compatibility hash: the model's
    when ``cache_dtype`` (vLLM's ``--kv-cache-dtype``) is ``"auto"`` or empty, else the
    cache's, with vLLM's alias ``"fp8"`` written as the ``"fp8_e4m3"`` it means. vLLM's
    fp8 caches are one byte an element under any model dtype, so layouts cannot tell
    ``fp8_e4m3`` from ``fp8_e5m2``: only this name keeps a decode from reading the
    other format's bytes as its own."""
    if cache_dtype in ("", "auto"):
        return model_dtype
    return "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype


def model_identity(model: str, revision: str | None = None) -> str:
    """The default ``model_name`` of the compatibility hash: what vLLM loaded the weights
    from (``--model``, a Hub id or a path) and its ``--revision``. Not the architecture's
    ``model_type``: two fine-tunes of one base model have KV of the same shapes, and a
    decode of one would decode from the other's KV. Instances that load the same
    weights from different paths set ``model_name`` to one name on both sides."""
    return f"{model}@{revision}" if revision else model


@dataclass(slots=True)
class _Load:
    job: LoadJob
    transfer: Transfer | None
    error: str = ""
    contacting: bool = False  # its producer was being contacted when it started
    aborted: bool = False  # vLLM finished the request meanwhile: the load was cancelled


class WorkerSide:
    """One worker's engines and the requests in flight through them."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self._loads: dict[str, _Load] = {}
        self._load_errors: set[int] = set()
        self._unheld: dict[str, float] = {}  # hold failed to start: request -> monotonic release
        self.stats = StatsTally()  # for vLLM's stats path (get_kv_connector_stats)
        # counted first contacts, by (address, when the contact ended): a peer's id could
        # be reused by the next incarnation's PeerInfo once a dropped one is collected
        self._contacts_seen: dict[tuple[str, float], None] = {}

    def register(self, tensors: Sequence[Any]) -> None:
        """Build the engines over this rank's per-layer KV tensors (layer order)."""
        s, x = self.settings, self.settings.extra
        spec, bufs = spec_from_vllm_tensors(
            tensors, backend=s.backend, block_size=s.block_size, num_kv_heads=s.num_kv_heads,
            tp_rank=s.tp_rank, tp_size=s.tp_size,
        )  # fmt: skip
        port = f"{x.side_channel_port + s.tp_rank}" if x.side_channel_port else "0"

        def config(role: str, addr: str) -> EngineConfig:
            return EngineConfig(
                f"{s.engine_id}-{role}", side_channel_addr=addr, model_name=s.model_name,
                dtype=s.dtype, kv_dtype=s.kv_dtype or s.dtype, deadline_s=x.deadline_s, lease_s=x.lease_s,
                heartbeat_s=x.heartbeat_s, silence_s=x.silence_s, hold_slots=x.hold_slots,
                auth_key=x.auth_key,
                # a push decode asks each prefill to contact it back at first contact
                push_contact=role == "d" and x.transfer_mode == "push",
            )  # fmt: skip

        with threads_on_every_cpu():
            if s.is_producer:
                self.producer = Producer(config("p", f"tcp://{x.side_channel_host}:{port}"),
                                         [(spec, bufs)])  # fmt: skip
            if s.is_consumer:
                self.consumer = Consumer(
                    config("d", f"tcp://{x.side_channel_host}:0"), [(spec, bufs)]
                )
                if x.prefill_peers:  # first contact now, off every request's path
                    self.consumer.preconnect(x.prefill_peers, retry_for_s=x.preconnect_s)
        log.info("kvxfer worker rank %d: %s, %d layers x %d blocks, producer %s",
                 s.tp_rank, spec.kind.value, spec.num_layers, spec.num_blocks,
                 self.producer.address if self.producer else "-")  # fmt: skip

    def handshake(self) -> tuple[str, int, int] | None:
        """``(address, generation, hold slots)`` of this rank's producer, for the
        scheduler side (which hands out the hold tickets)."""
        if self.producer is None:
            return None
        return self.producer.address, self.producer.generation, self.producer.config.hold_slots

    def start(self, loads: Iterable[LoadJob], holds: Iterable[HoldJob]) -> None:
        """Start this step's loads (non-blocking READs) and holds.

        One job that fails to start never stops the others (nor vLLM's step): a load
        that cannot start is reported failed at the next :meth:`finished`; a hold that
        cannot start keeps its blocks (vLLM frees them when this rank reports the
        request finished) until the lease its params promised has passed, since a
        decode may read them until then.
        """
        for h in holds:
            if self.producer is None:
                continue
            try:
                self.producer.hold(h.request_id, block_ids=h.block_ids, ticket=h.ticket or None,
                                   binding=h.prompt_hash.encode())  # fmt: skip
            except Exception as e:  # one bad job must not stop the step
                if h.ticket:  # its params are out: their readers fail now, not at deadline
                    self.producer.refuse_ticket(h.ticket)
                if self.producer.held_block_ids(h.request_id) is not None:
                    # its id is held already (the scheduler side never offers that):
                    # that hold's release reports the id; reporting it twice would not do
                    log.error("request %s: already held; not held again (%s)", h.request_id, e)
                    continue
                log.error("request %s: could not hold its blocks (%s: %s); kept until the "
                          "lease ends", h.request_id, type(e).__name__, e)  # fmt: skip
                self._unheld[h.request_id] = time.monotonic() + self.settings.extra.lease_s
        loads = list(loads)
        if loads:  # a load may start a first contact's thread
            with threads_on_every_cpu():
                for job in loads:
                    self._start_load(job)

    def _start_load(self, job: LoadJob) -> None:
        if self.consumer is None:
            self._loads[job.request_id] = _Load(job, None, "this engine is not a kv consumer")
            return
        r = job.remote
        local, remote = list(job.local_block_ids), list(job.remote_block_ids)
        try:
            if self.settings.extra.transfer_mode == "push":
                t = self.consumer.push(
                    r.request_id, r.address, local_block_ids=local, remote_block_ids=remote,
                    generation=r.generation_map, deadline_s=self.settings.extra.deadline_s,
                    hold_ticket=r.hold_ticket or None, hold_block_ids=r.block_ids,
                    hold_binding=r.prompt_hash.encode(),
                )  # fmt: skip
            else:
                lease_ns = None if r.lease_expires_at_ms is None else r.lease_expires_at_ms * 10**6
                t = self.consumer.read(
                    r.request_id, r.address, local_block_ids=local, remote_block_ids=remote,
                    generation=r.generation_map, deadline_s=self.settings.extra.deadline_s,
                    lease_expires_at_ns=lease_ns, hold_ticket=r.hold_ticket or None,
                    hold_block_ids=r.block_ids, hold_binding=r.prompt_hash.encode(),
                )  # fmt: skip
        except Exception as e:  # reported as this load's failure
            self._loads[job.request_id] = _Load(job, None, f"{type(e).__name__}: {e}")
            return
        self._loads[job.request_id] = _Load(job, t, contacting=not t.peer.ready.is_set())

    def finished(
        self, idle_wait_s: float = 0.0, aborted: Iterable[str] = ()
    ) -> tuple[set[str], set[str]]:
        """``(finished sending, finished receiving)`` request ids since the last call.

        ``aborted``: requests vLLM finished since the last step (its
        ``finished_req_ids``); a load of one still in flight is cancelled and reported
        now, failed, instead of pinning the request's blocks until its deadline (a
        client that went away; params naming a host that never answers). A load whose
        transfer may still land (a push the prefill has not confirmed stopped, a READ
        NIXL still runs) is reported later, once nothing more can land in its blocks.

        A load that ended in any state but DONE is reported finished too, with its
        blocks in :meth:`take_load_errors`, so vLLM recomputes them (never decodes
        from partial KV).

        ``idle_wait_s`` > 0 (a step that ran no tokens): while nothing has ended but a
        load or a hold is in flight, wait for one to end, up to ``idle_wait_s``, instead
        of returning at once: vLLM steps without pause while a request waits for its KV
        or for its blocks to be read, so each empty step returned at once spins the
        worker's thread on a core the transfer needs. The wait ends as soon as a hold is
        released (the producer's event), a first contact finishes or a READ ends (polled
        every ``IDLE_POLL_S``); it delays only requests that arrive meanwhile.
        """
        for rid in aborted:
            load = self._loads.get(rid)
            if load is not None and load.transfer is not None:
                load.aborted = not load.transfer.poll().is_terminal
                load.transfer.cancel()  # no-op once it ended
        if idle_wait_s <= 0:
            self._yield_to_first_contact()
            return self._collect()
        sending, recving = self._collect()  # the wait below waits on first contacts too
        end = time.monotonic() + idle_wait_s
        while not (sending or recving) and (left := end - time.monotonic()) > 0:
            if not self._wait_a_little(min(IDLE_POLL_S, left)):
                break  # nothing in flight: nothing to wait for
            sending, recving = self._collect()
        return sending, recving

    def _collect(self) -> tuple[set[str], set[str]]:
        sending: set[str] = set()
        if self._unheld:
            now = time.monotonic()
            for rid in [r for r, t in self._unheld.items() if t <= now]:
                del self._unheld[rid]
                sending.add(rid)
        if self.producer is not None:
            for rid, reason in self.producer.pop_freed():  # only ids this worker held
                sending.add(rid)
                self.stats.record_release(reason.value)
                log.debug("request %s: blocks released (%s)", rid, reason)
        recving: set[str] = set()
        for rid, load in list(self._loads.items()):
            t = load.transfer
            state = t.poll() if t is not None else RequestState.FAILED
            if not state.is_terminal or (t is not None and t.quarantined):
                continue  # quarantined: a late WRITE or READ may still land there
            del self._loads[rid]
            recving.add(rid)
            self._count(load, state)
            if state is not RequestState.DONE and load.aborted:
                # vLLM frees a finished request's blocks: no failure policy applies
                log.info("request %s: finished by vLLM during its KV load; the load was "
                         "cancelled", rid)  # fmt: skip
            elif state is not RequestState.DONE:
                e = load.transfer.error if load.transfer is not None else None
                err = load.error or (f"{type(e).__name__}: {e}" if e is not None else "")
                log.warning("request %s: KV load ended %s (%s); %d blocks go to kv_load_failure_policy",
                            rid, state.value, err, len(load.job.local_block_ids))  # fmt: skip
                self._load_errors.update(load.job.local_block_ids)
        return sending, recving

    def _count(self, load: _Load, state: RequestState) -> None:
        """Tally one ended load, and the first contact it waited for (once per peer)."""
        t = load.transfer
        if t is None:
            self.stats.record_load(state.value, 0.0, 0)
            return
        self.stats.record_load(state.value, t.latency_s, t.num_bytes)
        peer = t.peer
        if not (load.contacting and peer.error is None and peer.timings_s):
            return
        key = (peer.address, peer.phase_at)  # phase_at: when it entered "ready"
        if key not in self._contacts_seen:
            self._contacts_seen[key] = None
            if len(self._contacts_seen) > MAX_CONTACTS_SEEN:
                del self._contacts_seen[next(iter(self._contacts_seen))]
            self.stats.record_contact(sum(peer.timings_s.values()))

    def take_stats(self) -> dict[str, Any] | None:
        """What this worker counted since the last call (None: nothing), for vLLM's
        ``get_kv_connector_stats`` (:mod:`kvxfer.integrations.vllm.stats`)."""
        return self.stats.take()

    def _wait_a_little(self, seconds: float) -> bool:
        """Sleep up to ``seconds`` on whatever is in flight (False: nothing is)."""
        if self._loads:
            for load in self._loads.values():
                t = load.transfer
                if t is not None and not t.peer.ready.is_set():
                    t.peer.ready.wait(seconds)  # a first contact: woken when it ends
                    return True
            time.sleep(seconds)  # READs in flight: NIXL has no completion event; poll
            return True
        if self.producer is not None and self.producer.num_held:
            self.producer.wait_freed(seconds)
            return True
        return False

    def _yield_to_first_contact(self) -> None:
        """While a load waits on a first contact, wait on it up to 2 ms, without the GIL.

        vLLM's step loop runs without pause while a request waits for its KV, so a
        handshake thread gets the GIL only when the interpreter's switch interval (5 ms)
        forces a hand-off, at each of its many GIL re-acquisitions: measured here, first
        contact took 49-162 ms inside vLLM vs 13-20 ms in an idle process. Costs the step
        at most 2 ms, and only while a first contact does CPU work: not while it fetches
        records (a wait on the network, without the GIL; a client's params naming a host
        that never answers would tax every step for the fetch's timeout) or is queued.
        """
        for load in self._loads.values():
            t = load.transfer
            if t is None or t.peer.ready.is_set() or t.peer.phase in ("fetch", "queued"):
                continue
            t.peer.ready.wait(0.002)
            return

    def take_load_errors(self) -> set[int]:
        """Local block ids whose load failed since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        """Close the engines (live loads end ABORTED; held blocks are released). One whose
        close raised is logged and kept, the other is closed all the same, and the next
        call tries the kept one again (what it had closed stays closed)."""
        for name in ("consumer", "producer"):
            engine = getattr(self, name)
            if engine is None:
                continue
            try:
                engine.close()
            except Exception:  # shutdown goes on: the other engine still closes
                log.exception("kvxfer close of the %s failed (a later close tries again)", name)
                continue
            setattr(self, name, None)
