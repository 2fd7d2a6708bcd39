"""The scheduler side of the vLLM connector: which requests load, which hold (pure).

Runs in vLLM's engine-core process, next to its scheduler; it never touches KV
memory. It turns scheduler events into per-step jobs for the workers:

- decode side (``do_remote_prefill``): every prompt token the prefill computed is
  reported loadable (the scheduler then recomputes only the last token, for its
  logits); after allocation a :class:`LoadJob` pairs the newly allocated local blocks
  with the prefill's blocks at the same token positions;
- prefill side (``do_remote_decode``): a request that finished its prefill keeps its
  blocks (``delay_free``) under a :class:`HoldJob` until the decode read them or the
  lease ended; its ``kv_transfer_params`` name the producer ranks and generations.

A prefill's KV is read once: its producer frees the blocks at the first reader's
ReadDone, so a second reader would read blocks the prefill may have reused. Hence
params are single-use here: the first decode request that names a prefill request
(the same prompt, within the lease) claims it; any other request naming it (parallel
sampling's ``n > 1`` children share their parent's params; a resend of the same
params) computes its prompt locally. A request whose prompt differs from the one the
params were made for (one prefill's params sent with a list of prompts) computes
locally too. On the prefill side a request id that is still held (a client reusing
ids) is not offered again until vLLM reports the first one freed.

Single use within one decode engine is enforced here; across decode engines (the same
params sent to two of them) by the hold ticket each offer carries (handed out here, so
the params can name it before the workers' hold starts): a decode's READ is DONE only
if the prefill's hold was still alive after the bytes were copied
(:mod:`kvxfer.engine.holds`); a second reader after the first one's ReadDone fails its
load, and vLLM's ``kv_load_failure_policy`` recomputes the prompt (or fails it).

One instance is used by vLLM's scheduler thread only (no locking).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer.engine.holds import TicketBook
from kvxfer.errors import KvxferError
from kvxfer.integrations.vllm.allow import Allowed, refuse_address
from kvxfer.integrations.vllm.params import (
    RemotePrefill,
    compose_params,
    parse_params,
    prompt_hash,
)
from kvxfer.wire import MAX_REQUEST_ID_LEN

__all__ = ["HoldJob", "LoadJob", "ProducerRank", "SchedulerSide", "StepJobs"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProducerRank:
    """What one prefill worker published at start: where its producer listens."""

    tp_rank: int
    address: str
    generation: int
    hold_slots: int = 0  # its hold table's size (kvxfer.engine.holds); 0: none


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Decode side: read ``remote_block_ids`` of the prefill into ``local_block_ids``."""

    request_id: str
    remote: RemotePrefill
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HoldJob:
    """Prefill side: hold ``block_ids`` of ``request_id`` until read or the lease ends,
    under ``ticket`` (the params carry it), bound to ``prompt_hash`` (a decode's load is
    DONE only for params of this request, these blocks and this prompt)."""

    request_id: str
    block_ids: tuple[int, ...]
    ticket: int = 0
    prompt_hash: str = ""


@dataclass(slots=True)
class StepJobs:
    """The jobs of one scheduler step, for every worker."""

    loads: list[LoadJob] = field(default_factory=list)
    holds: list[HoldJob] = field(default_factory=list)


@dataclass(slots=True)
class _Pending:
    remote: RemotePrefill
    num_local_tokens: int


_ClaimKey = tuple[str, str, tuple[int, ...], str]  # prefill engine, request id, generations, prompt
MAX_CLAIMS = 1 << 17  # claims kept at once (each ends with its lease)


@dataclass(slots=True)
class _Claim:
    request_id: str  # the local request that may read it
    until: float  # wall-clock s: the prefill's lease end; no read is possible after it
    used: bool = False  # that request finished: nobody reads this KV any more


def _claim_key(remote: RemotePrefill) -> _ClaimKey:
    # with the prompt: params re-stamped with a forger's prompt hash (refused by the
    # hold binding) must not take the genuine request's claim on this engine
    return remote.engine_id, remote.request_id, remote.generations, remote.prompt_hash


class SchedulerSide:
    """Scheduler-side bookkeeping of the kvxfer vLLM connector.

    Args:
        engine_id: this engine's id (named in the params it returns).
        block_size: tokens per block of this engine.
        tp_size: this engine's tensor-parallel size.
        is_producer, is_consumer: the roles this engine takes.
        lease_s: the prefill workers' lease on held blocks (their ``lease_s``).
    """

    def __init__(
        self,
        *,
        engine_id: str,
        block_size: int,
        tp_size: int,
        is_producer: bool,
        is_consumer: bool,
        lease_s: float = 120.0,
        allowed: tuple[Allowed, ...] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.allowed = allowed  # decode: the prefills it may contact (None: any)
        self.block_size = block_size
        self.tp_size = tp_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.lease_s = lease_s
        self.producers: dict[int, ProducerRank] = {}
        self._pending: dict[str, _Pending] = {}  # matched, waiting for allocation
        self._loaded: set[str] = set()  # a load was started: never offered twice
        self._claims: dict[_ClaimKey, _Claim] = {}  # decode: who reads each prefill's KV
        self._claimed: dict[str, _ClaimKey] = {}  # decode: local request -> its claim
        self._held: dict[str, int] = {}  # prefill: offered, not yet freed by vLLM -> ticket
        self._tickets: TicketBook | None = None  # prefill: hold tickets (set_producers)
        self._step = StepJobs()

    def set_producers(self, ranks: Sequence[ProducerRank]) -> None:
        """Record the producer addresses, generations and hold tables the workers
        published; tickets are handed out from the smallest table."""
        self.producers = {r.tp_rank: r for r in ranks}
        slots = min((r.hold_slots for r in ranks), default=0)
        self._tickets = TicketBook(slots) if slots > 0 else None

    def matched_tokens(
        self,
        request_id: str,
        prompt: Sequence[int] | None,
        params: Mapping[str, Any] | None,
        num_computed: int,
        context: Sequence[Sequence[str]] = (),
    ) -> tuple[int, bool]:
        """``(tokens to load, load asynchronously)`` for a new request (vLLM's contract).

        ``prompt``: the request's prompt token ids (None for a prompt given as embeddings:
        never loaded, since no params can be checked against it); ``context``: what else
        decides its KV (:func:`~kvxfer.integrations.vllm.params.prompt_context`).
        """
        if not self.is_consumer:
            return 0, False
        try:
            remote = parse_params(params)
        except KvxferError as e:
            log.warning("request %s: ignoring bad kv_transfer_params (computing locally): %s",
                        request_id, e)  # fmt: skip
            return 0, False
        if remote is None:
            return 0, False
        if request_id in self._loaded:
            # asked again after its load: a failed load under the "recompute" policy, or
            # a preemption; offering the same KV again could loop, so compute locally
            return 0, False
        try:
            why = self._refusal(request_id, prompt, remote, context)
        except Exception as e:  # client input: a check that breaks must not stop vLLM's engine
            log.exception("request %s: checking its kv_transfer_params failed", request_id)
            why = f"its params could not be checked ({type(e).__name__})"
        if why:
            log.warning("request %s: not loading the KV of prefill request %s (%s); "
                        "computing locally", request_id, remote.request_id, why)  # fmt: skip
            return 0, False
        assert prompt is not None  # _refusal checked it
        # the prefill computed ``num_tokens``; tokens past the prompt are not ours to take
        available = min(len(prompt), remote.num_tokens)
        count = max(0, available - num_computed)
        if count == 0:
            return 0, False
        self._claim(request_id, remote)
        self._pending[request_id] = _Pending(remote, num_computed)
        return count, True

    def _refusal(self, request_id: str, prompt: Sequence[int] | None, remote: RemotePrefill,
                 context: Sequence[Sequence[str]]) -> str:  # fmt: skip
        """Why ``request_id`` may not read ``remote`` ("" if it may)."""
        if why := refuse_address(remote.address, self.allowed):
            return why  # first: nothing else about a prefill we may not contact matters
        if remote.block_size != self.block_size:
            return f"prefill block size {remote.block_size} != {self.block_size} here"
        now = time.time()
        if remote.lease_expires_at_ms is not None and now * 1000 >= remote.lease_expires_at_ms:
            return "its lease has ended: the prefill may have reused the blocks"
        if prompt is None or prompt_hash(prompt, context) != remote.prompt_hash:
            # other token ids, or the same ones under another LoRA, salt or image
            return "the params were made for another prompt"
        claim = self._claims.get(_claim_key(remote))
        if claim is not None and (claim.request_id != request_id or claim.used):
            return f"request {claim.request_id} already took it (params are single-use)"
        return ""

    def _claim(self, request_id: str, remote: RemotePrefill) -> None:
        key = _claim_key(remote)
        if key in self._claims:
            return  # asked again before its allocation: the same request's claim
        now = time.time()
        lease = remote.lease_expires_at_ms
        until = lease / 1000 if lease is not None else now + self.lease_s
        # forget claims whose lease ended (a read after it is refused anyway), oldest
        # first, and keep the count bounded
        while self._claims and (
            len(self._claims) >= MAX_CLAIMS or next(iter(self._claims.values())).until <= now
        ):
            del self._claims[next(iter(self._claims))]
        self._claims[key] = _Claim(request_id, until)
        self._claimed[request_id] = key

    def after_alloc(
        self, request_id: str, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Blocks are allocated for a request: queue its load (once, when tokens are external)."""
        pending = self._pending.pop(request_id, None)
        if pending is None or num_external_tokens == 0:
            return
        bs = self.block_size
        first = pending.num_local_tokens // bs  # local prefix-cache hit: whole blocks only
        last = -(-(pending.num_local_tokens + num_external_tokens) // bs)
        remote_ids = pending.remote.block_ids[first:last]
        local_ids = tuple(block_ids[first:last])
        if len(remote_ids) != len(local_ids):
            log.warning("request %s: %d local blocks for %d remote blocks", request_id,
                        len(local_ids), len(remote_ids))  # fmt: skip
            remote_ids = remote_ids[: len(local_ids)]
        self._loaded.add(request_id)
        self._step.loads.append(LoadJob(request_id, pending.remote, local_ids, tuple(remote_ids)))

    def take_step(self) -> StepJobs:
        """The jobs collected since the last step (resets them)."""
        step, self._step = self._step, StepJobs()
        return step

    def finished(
        self,
        request_id: str,
        params: Mapping[str, Any] | None,
        block_ids: Sequence[int],
        num_computed_tokens: int,
        is_length_capped: bool,
        prompt: Sequence[int] | None,
        context: Sequence[Sequence[str]] = (),
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free_blocks, kv_transfer_params)`` for a finished request
        (``context``: as for :meth:`matched_tokens`, stamped into the params' hash)."""
        self._pending.pop(request_id, None)
        self._loaded.discard(request_id)
        key = self._claimed.pop(request_id, None)
        if key is not None and (claim := self._claims.get(key)) is not None:
            claim.used = True  # read or not, this KV is nobody else's
        if not self.is_producer or not params:
            return False, None
        if not isinstance(params, Mapping):  # any JSON a client sent: not ours to offer
            log.warning("request %s: ignoring kv_transfer_params that are not an object: "
                        "%.80r", request_id, params)  # fmt: skip
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if not is_length_capped or not block_ids or prompt is None:
            return False, None  # aborted or failed (or embeddings): nothing to offer
        if len(request_id) > MAX_REQUEST_ID_LEN:  # vLLM takes it from X-Request-Id
            log.warning("request %.60s...: its id is longer than the %d characters the wire "
                        "carries; not offering its KV", request_id, MAX_REQUEST_ID_LEN)  # fmt: skip
            return False, None
        if len(self.producers) != self.tp_size:
            log.warning("request %s: producer ranks unknown (%d of %d); not offering its KV",
                        request_id, len(self.producers), self.tp_size)  # fmt: skip
            return False, None
        if request_id in self._held:
            log.warning("request %s: a request with this id still holds blocks for a decode "
                        "(a reused request id); not offering its KV", request_id)  # fmt: skip
            return False, None
        if self._tickets is None:
            log.warning("request %s: the producer ranks publish no hold table; not offering "
                        "its KV", request_id)  # fmt: skip
            return False, None
        try:
            ticket = self._tickets.take()
        except KvxferError as e:  # every slot is held: the decode computes the prompt
            log.warning("request %s: not offering its KV: %s", request_id, e)
            return False, None
        ranks = [self.producers[r] for r in range(self.tp_size)]
        remote = RemotePrefill(
            engine_id=self.engine_id,
            request_id=request_id,
            address=",".join(r.address for r in ranks),
            generations=tuple(r.generation for r in ranks),
            block_ids=tuple(int(b) for b in block_ids),
            block_size=self.block_size,
            tp_size=self.tp_size,
            num_tokens=min(num_computed_tokens, len(block_ids) * self.block_size),
            # the workers' hold starts later than now, so its lease ends later than this
            lease_expires_at_ms=time.time_ns() // 1_000_000 + int(self.lease_s * 1000),
            prompt_hash=prompt_hash(prompt, context),
            hold_ticket=ticket,
        )
        self._held[request_id] = ticket
        self._step.holds.append(HoldJob(request_id, remote.block_ids, ticket, remote.prompt_hash))
        return True, compose_params(remote)

    def freed(self, request_ids: Iterable[str]) -> None:
        """vLLM reports these held requests' blocks freed (every worker released them)."""
        for rid in request_ids:
            ticket = self._held.pop(rid, None)
            if ticket is not None and self._tickets is not None:
                self._tickets.free(ticket)
