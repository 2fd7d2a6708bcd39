"""Prometheus metrics of a kvxfer consumer engine (optional: ``pip install 'kvxfer[prometheus]'``).

Reads :meth:`kvxfer.engine.Consumer.stats` at scrape time, so nothing is counted twice
and the engine pays nothing between scrapes::

    from prometheus_client import start_http_server
    from kvxfer.integrations.prometheus import register

    register(consumer)          # on prometheus_client's default registry
    start_http_server(9400)

Metric names and units follow Prometheus conventions (``_total`` counters, ``_seconds``
and ``_bytes`` units, base units only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvxfer.engine.stats import EngineStats

__all__ = ["KvxferCollector", "register"]


class KvxferCollector:
    """A ``prometheus_client`` collector over an engine's :class:`EngineStats` snapshots.

    Args:
        stats: returns a fresh snapshot (e.g. ``consumer.stats``).
        engine_id: the ``engine`` label on every metric.
    """

    def __init__(self, stats: Callable[[], EngineStats], engine_id: str) -> None:
        self._stats = stats
        self._engine = engine_id

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        s = self._stats()
        e = self._engine
        requests = CounterMetricFamily(
            "kvxfer_requests", "Requests that ended, by end state", labels=["engine", "state"]
        )
        for state, n in sorted(s.requests.items()):
            if state != "pending":
                requests.add_metric([e, state], n)
        yield requests
        pending = GaugeMetricFamily(
            "kvxfer_requests_pending", "Requests in flight", labels=["engine"]
        )
        pending.add_metric([e], s.requests.get("pending", 0))
        yield pending
        moved = CounterMetricFamily(
            "kvxfer_moved_bytes", "Bytes of requests that ended DONE", labels=["engine"]
        )
        moved.add_metric([e], s.bytes_moved)
        yield moved
        posted = CounterMetricFamily(
            "kvxfer_descriptors_posted",
            "Descriptors posted to the transfer backend",
            labels=["engine"],
        )
        posted.add_metric([e], s.descriptors_posted)
        yield posted
        cumulative, buckets = 0, []
        for bound, n in zip([*s.latency_buckets_s, float("inf")], s.latency_counts, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        hist = HistogramMetricFamily(
            "kvxfer_request_latency_seconds", "Request latency, start to end", labels=["engine"]
        )
        hist.add_metric([e], buckets, sum_value=s.latency_sum_s)
        yield hist
        phases = GaugeMetricFamily(
            "kvxfer_first_contact_seconds", "First-contact phase durations per producer",
            labels=["engine", "peer", "phase"],
        )  # fmt: skip
        rows = GaugeMetricFamily(
            "kvxfer_first_contact_rows", "Strided rows prepared at first contact, per producer",
            labels=["engine", "peer"],
        )  # fmt: skip
        descs = GaugeMetricFamily(
            "kvxfer_first_contact_descriptors",
            "Descriptors the prepared rows stand for, per producer", labels=["engine", "peer"],
        )  # fmt: skip
        for fc in s.first_contacts:
            for phase, sec in sorted(fc.phases_s.items()):
                phases.add_metric([e, fc.address, phase], sec)
            rows.add_metric([e, fc.address], fc.num_rows)
            descs.add_metric([e, fc.address], fc.num_descriptors)
        yield phases
        yield rows
        yield descs


def register(engine: Any, registry: Any = None) -> KvxferCollector:
    """Register a collector for ``engine`` (anything with ``stats()`` and ``config``)."""
    from prometheus_client import REGISTRY

    collector = KvxferCollector(engine.stats, engine.config.engine_id)
    (registry or REGISTRY).register(collector)
    return collector
