"""kvxfer as a vLLM v1 KV connector (imports vLLM; load it by module path).

Configure both instances with::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer.integrations.vllm",
                           "kv_role": "kv_both"}'

vLLM builds one instance per process: the SCHEDULER role in the engine core (see
:class:`~kvxfer.integrations.vllm.scheduler.SchedulerSide`) and the WORKER role in
each TP worker (see :class:`~kvxfer.integrations.vllm.worker.WorkerSide`). Metadata
passes from scheduler to workers once per step (:class:`KvxferMetadata`); workers
publish their producer's address and generation at start
(:class:`KvxferHandshake`), which vLLM hands to the scheduler side.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from kvxfer.errors import ConfigError
from kvxfer.integrations.vllm import stats
from kvxfer.integrations.vllm.extra import parse_extra
from kvxfer.integrations.vllm.layouts import distinct_layers
from kvxfer.integrations.vllm.metrics import KvxferConnectorStats, KvxferPromMetrics
from kvxfer.integrations.vllm.params import prompt_context
from kvxfer.integrations.vllm.scheduler import (
    HoldJob,
    LoadJob,
    ProducerRank,
    SchedulerSide,
)
from kvxfer.integrations.vllm.worker import (
    WorkerSettings,
    WorkerSide,
    kv_cache_dtype,
    model_identity,
)

if TYPE_CHECKING:
    import torch

__all__ = ["KvxferConnector", "KvxferHandshake", "KvxferMetadata"]

log = logging.getLogger(__name__)


@dataclass
class KvxferMetadata(KVConnectorMetadata):
    """One step's jobs, from the scheduler side to every worker."""

    loads: list[LoadJob] = field(default_factory=list)
    holds: list[HoldJob] = field(default_factory=list)
    idle: bool = False  # the step runs no tokens: get_finished may wait for transfers


@dataclass
class KvxferHandshake(KVConnectorHandshakeMetadata):
    """A prefill worker's producer endpoint, published once at start."""

    tp_rank: int
    address: str
    generation: int
    hold_slots: int = 0


def _backend_name(vllm_config: Any, layer_names: list[str]) -> str:
    """The attention backend of the first KV layer (CPU_ATTN on the CPU platform)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "CPU_ATTN"
    ctx = vllm_config.compilation_config.static_forward_context
    layer = ctx.get(layer_names[0]) if layer_names else None
    backend = getattr(layer, "attn_backend", None)
    return str(backend.get_name()) if backend is not None else "unknown"


def _weights_source(model_config: Any) -> str:
    """What ``--model`` named: vLLM replaces an object-storage URL in ``model`` with its
    local copy's directory (host-dependent) and keeps the URL in ``model_weights``."""
    return str(getattr(model_config, "model_weights", "") or model_config.model)


def check_cache_groups(kv_cache_config: Any) -> None:
    """Refuse KV caches whose blocks vLLM drops while a request lives (sliding window,
    chunked local attention, circular buffers, state caches): it swaps a block a
    request no longer attends to for its shared null block, in the prefill's offer and
    in the decode's allocation alike, so a load would name that one block many times
    and a failed load would report it as lost for every request holding it. Only
    full-attention caches (MLA included) keep every block of a prompt."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for one in inner.values() if isinstance(inner, dict) else [spec]:
            if type(one) not in (FullAttentionSpec, MLAAttentionSpec):
                window = getattr(one, "sliding_window", None) or getattr(
                    one, "attention_chunk_size", None
                )
                raise ConfigError(
                    f"kvxfer's connector supports full-attention KV caches only; group {i} "
                    f"is a {type(one).__name__}"
                    + (f" (window {window} tokens)" if window else "")
                    + ": vLLM drops such a cache's blocks outside the window, which a "
                    "transfer cannot pair; serve this model without the connector"
                )


def _log_through_vllm() -> None:
    """Send kvxfer's warnings to vLLM's log handlers (vLLM configures only its own
    logger; without this a failed load's reason would be invisible in vLLM's logs)."""
    ours, theirs = logging.getLogger("kvxfer"), logging.getLogger("vllm")
    if theirs.handlers and not any(h in ours.handlers for h in theirs.handlers):
        for h in theirs.handlers:
            ours.addHandler(h)
        if ours.level == logging.NOTSET:
            ours.setLevel(logging.INFO)
        ours.propagate = False


class KvxferConnector(KVConnectorBase_V1):
    """vLLM KV connector moving KV caches between P/D instances with kvxfer (pull or push).

    Extra config keys (``kv_connector_extra_config``): the fields of
    :class:`~kvxfer.integrations.vllm.extra.ExtraConfig` (defaults there; docs/vllm.md
    says what each does), read and checked once when the connector starts, in both
    roles (the deployment key is read in the workers' role only): a bad value or a key
    kvxfer does not know stops it with a ``ConfigError`` that names the key. Pipeline
    parallelism is refused the same way, and so are KV caches whose blocks vLLM drops
    during a request (sliding window, chunked local attention: :func:`check_cache_groups`).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        kv = vllm_config.kv_transfer_config
        self._block_size = int(vllm_config.cache_config.block_size)
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        pp_size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
        if pp_size != 1:  # each stage's workers hold other layers under the same TP ranks
            raise ConfigError(
                f"kvxfer's connector does not support pipeline parallelism "
                f"(pipeline_parallel_size {pp_size}): use tensor parallelism only"
            )
        check_cache_groups(kv_cache_config)
        self._engine_id = str(kv.engine_id)
        # the key is the workers' engines' alone: the scheduler checks its settings only
        self._extra = parse_extra(
            kv.kv_connector_extra_config, read_key=role != KVConnectorRole.SCHEDULER
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._idle = False  # the bound step runs no tokens (see KvxferMetadata.idle)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                engine_id=self._engine_id, block_size=self._block_size, tp_size=self._tp_size,
                is_producer=kv.is_kv_producer, is_consumer=kv.is_kv_consumer,
                lease_s=self._extra.lease_s, allowed=self._extra.allowed_prefills,
            )  # fmt: skip

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:  # fmt: skip
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(
            request.request_id, request.prompt_token_ids, request.kv_transfer_params,
            num_computed_tokens, prompt_context(request),
        )  # fmt: skip

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self._scheduler.after_alloc(request.request_id, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        step = self._scheduler.take_step()
        idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        return KvxferMetadata(loads=step.loads, holds=step.holds, idle=idle)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        assert self._scheduler is not None
        return self._scheduler.finished(
            request.request_id, request.kv_transfer_params, block_ids,
            request.num_computed_tokens,
            request.status == RequestStatus.FINISHED_LENGTH_CAPPED,
            request.prompt_token_ids, prompt_context(request),
        )  # fmt: skip

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None and connector_output.finished_sending:
            self._scheduler.freed(connector_output.finished_sending)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:  # fmt: skip
        if self._scheduler is None:
            return
        ranks = [
            ProducerRank(m.tp_rank, m.address, m.generation, m.hold_slots)
            for m in metadata.values()
            if isinstance(m, KvxferHandshake)
        ]
        self._scheduler.set_producers(ranks)
        log.info("kvxfer: producer ranks %s", [(r.tp_rank, r.address) for r in ranks])

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        cfg, kv = self._vllm_config, self._vllm_config.kv_transfer_config
        names = distinct_layers(kv_caches)  # layers sharing one KV tensor count once
        dtype = str(cfg.model_config.dtype).removeprefix("torch.")
        settings = WorkerSettings(
            engine_id=self._engine_id,
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=self._tp_size,
            block_size=self._block_size,
            num_kv_heads=int(cfg.model_config.get_total_num_kv_heads()),
            backend=_backend_name(cfg, names),
            is_producer=kv.is_kv_producer,
            is_consumer=kv.is_kv_consumer,
            model_name=self._extra.model_name
            or model_identity(_weights_source(cfg.model_config), cfg.model_config.revision),
            dtype=dtype,
            extra=self._extra,
            kv_dtype=kv_cache_dtype(dtype, str(getattr(cfg.cache_config, "cache_dtype", "auto"))),
        )
        self._worker = WorkerSide(settings)
        self._worker.register([kv_caches[n] for n in names])

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or (hs := self._worker.handshake()) is None:
            return None
        return KvxferHandshake(self._worker.settings.tp_rank, *hs)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Holds and loads start here, before the step's forward pass, not in
        # start_load_kv (which vLLM calls after a CPU forward has already run): a hold
        # is in place before a decode can read, and a load that completes during the
        # forward is reported finished in this same step.
        super().bind_connector_metadata(connector_metadata)
        self._idle = isinstance(connector_metadata, KvxferMetadata) and connector_metadata.idle
        if self._worker is not None and isinstance(connector_metadata, KvxferMetadata):
            self._worker.start(connector_metadata.loads, connector_metadata.holds)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # started in bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: vLLM schedules a request once it is loaded

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:  # fmt: skip
        return None  # pull mode: the decode reads; nothing is pushed per layer

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        wait = self._extra.idle_wait_s if self._idle else 0.0
        self._idle = False  # one wait per bound step
        sending, recving = self._worker.finished(idle_wait_s=wait, aborted=finished_req_ids)
        return sending or None, recving or None

    def get_kv_connector_stats(self) -> KvxferConnectorStats | None:
        data = self._worker.take_stats() if self._worker is not None else None
        return None if data is None else KvxferConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvxferConnectorStats:
        return KvxferConnectorStats(data=stats.merge(stats.empty(), data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvxferPromMetrics:  # fmt: skip
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        """Close the worker's engines. vLLM calls this once, then drops the connector: an
        engine whose close raised (logged) is tried once more at once; one that fails
        again is logged and kept here (a later call tries again), its agent and memory
        left to the process's exit."""
        worker = self._worker
        if worker is None:
            return
        for _ in range(2):
            worker.close()
            if worker.consumer is None and worker.producer is None:
                self._worker = None
                return
        log.error("kvxfer shutdown: an engine failed to close twice; it stays open until "
                  "this process exits or shutdown() is called again")  # fmt: skip
