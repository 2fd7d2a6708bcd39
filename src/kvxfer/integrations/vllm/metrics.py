"""The connector's statistics in vLLM's stats path: the ``KV Transfer metrics: ...`` log
line and ``vllm:kvxfer_*`` Prometheus metrics (the dict itself is
:mod:`kvxfer.integrations.vllm.stats`, pure).

vLLM calls the worker connector's ``get_kv_connector_stats()`` after each step, merges
what the TP workers return (:meth:`KvxferConnectorStats.aggregate`), rebuilds the
object in its logger process with the connector class's ``build_kv_connector_stats``,
logs :meth:`KvxferConnectorStats.reduce` every ``VLLM_LOG_STATS_INTERVAL`` seconds and
hands the dict to :meth:`KvxferPromMetrics.observe` (the OpenAI server's ``/metrics``).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvxfer.integrations.vllm import stats

__all__ = ["KvxferConnectorStats", "KvxferPromMetrics"]

LOAD_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class KvxferConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """vLLM's stats object over :mod:`kvxfer.integrations.vllm.stats`' dict."""

    def reset(self) -> None:
        self.data = stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KvxferConnectorStats:
        self.data = stats.merge(self.data, getattr(other, "data", None) or {})
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.summary(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


class KvxferPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``vllm:kvxfer_loads_total{outcome}``, ``vllm:kvxfer_load_seconds`` (DONE loads),
    ``vllm:kvxfer_load_bytes_total``, ``vllm:kvxfer_first_contacts_total``,
    ``vllm:kvxfer_first_contact_seconds`` and ``vllm:kvxfer_holds_released_total{reason}``,
    labelled per engine as vLLM's own metrics are."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = list(labelnames)
        counter, histogram = self._counter_cls, self._histogram_cls
        self._loads = counter(name="vllm:kvxfer_loads", labelnames=[*names, "outcome"],
                              documentation="kvxfer KV loads (decode side) by how they ended.")  # fmt: skip
        self._load_s = histogram(name="vllm:kvxfer_load_seconds", labelnames=names,
                                 buckets=list(LOAD_BUCKETS_S),
                                 documentation="Duration of kvxfer KV loads that ended DONE.")  # fmt: skip
        self._bytes = counter(name="vllm:kvxfer_load_bytes", labelnames=names,
                              documentation="Bytes of kvxfer KV loads that ended DONE.")  # fmt: skip
        self._contacts = counter(name="vllm:kvxfer_first_contacts", labelnames=names,
                                 documentation="Prefill engines a kvxfer load waited to contact.")  # fmt: skip
        self._contact_s = histogram(name="vllm:kvxfer_first_contact_seconds", labelnames=names,
                                    buckets=list(LOAD_BUCKETS_S),
                                    documentation="Duration of kvxfer first contacts.")  # fmt: skip
        self._released = counter(name="vllm:kvxfer_holds_released", labelnames=[*names, "reason"],
                                 documentation="Prefill blocks held for decodes, released, by why.")  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = stats.merge(stats.empty(), transfer_stats_data or {})
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for end in stats.LOAD_ENDS:
            if n := d[f"loads_{end}"]:
                self._loads.labels(*labels, end).inc(n)
        for reason in stats.RELEASES:
            if n := d[f"released_{reason}"]:
                self._released.labels(*labels, reason).inc(n)
        if d["load_bytes"]:
            self._bytes.labels(*labels).inc(d["load_bytes"])
        if d["first_contacts"]:
            self._contacts.labels(*labels).inc(d["first_contacts"])
        for s in d["load_s"]:
            self._load_s.labels(*labels).observe(s)
        for s in d["first_contact_s"]:
            self._contact_s.labels(*labels).observe(s)
