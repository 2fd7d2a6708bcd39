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

One instance is used by vLLM's scheduler thread only (no locking).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvxfer.errors import KvxferError
from kvxfer.integrations.vllm.params import RemotePrefill, compose_params, parse_params

__all__ = ["HoldJob", "LoadJob", "ProducerRank", "SchedulerSide", "StepJobs"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProducerRank:
    """What one prefill worker published at start: where its producer listens."""

    tp_rank: int
    address: str
    generation: int


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Decode side: read ``remote_block_ids`` of the prefill into ``local_block_ids``."""

    request_id: str
    remote: RemotePrefill
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HoldJob:
    """Prefill side: hold ``block_ids`` of ``request_id`` until read or the lease ends."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(slots=True)
class StepJobs:
    """The jobs of one scheduler step, for every worker."""

    loads: list[LoadJob] = field(default_factory=list)
    holds: list[HoldJob] = field(default_factory=list)


@dataclass(slots=True)
class _Pending:
    remote: RemotePrefill
    num_local_tokens: int


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
    ) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.lease_s = lease_s
        self.producers: dict[int, ProducerRank] = {}
        self._pending: dict[str, _Pending] = {}  # matched, waiting for allocation
        self._loaded: set[str] = set()  # a load was started: never offered twice
        self._step = StepJobs()

    def set_producers(self, ranks: Sequence[ProducerRank]) -> None:
        """Record the producer addresses and generations the workers published."""
        self.producers = {r.tp_rank: r for r in ranks}

    def matched_tokens(
        self, request_id: str, prompt_len: int, params: Mapping[str, Any] | None, num_computed: int
    ) -> tuple[int, bool]:
        """``(tokens to load, load asynchronously)`` for a new request (vLLM's contract)."""
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
        if remote.block_size != self.block_size:
            log.warning("request %s: prefill block size %d != %d here; computing locally",
                        request_id, remote.block_size, self.block_size)  # fmt: skip
            return 0, False
        # the prefill computed ``num_tokens``; tokens past the prompt are not ours to take
        available = min(prompt_len, remote.num_tokens)
        count = max(0, available - num_computed)
        if count == 0:
            return 0, False
        self._pending[request_id] = _Pending(remote, num_computed)
        return count, True

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
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free_blocks, kv_transfer_params)`` for a finished request."""
        self._pending.pop(request_id, None)
        self._loaded.discard(request_id)
        if not (self.is_producer and params and params.get("do_remote_decode")):
            return False, None
        if not is_length_capped or not block_ids:
            return False, None  # aborted or failed: nothing for a decode to read
        if len(self.producers) != self.tp_size:
            log.warning("request %s: producer ranks unknown (%d of %d); not offering its KV",
                        request_id, len(self.producers), self.tp_size)  # fmt: skip
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
        )
        self._step.holds.append(HoldJob(request_id, remote.block_ids))
        return True, compose_params(remote)
