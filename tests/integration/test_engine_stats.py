"""Engine statistics: the typed snapshot counts what happened, waiting on many
transfers (sync and asyncio), and the Prometheus exporter reads the same snapshot."""

from __future__ import annotations

import asyncio

import pytest

from kvxfer.engine import (
    Consumer,
    EngineConfig,
    Producer,
    RequestState,
    allocate_cache,
    as_completed,
    wait_any,
)
from kvxfer.layout.presets import spec_for
from kvxfer.testing import MemoryBackend, fill

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engines():
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    bufs = allocate_cache(spec)
    fill(spec, bufs)
    with (
        Producer(EngineConfig("sp", model_name="tiny-gqa"), [(spec, bufs)], backend_factory=MemoryBackend) as prod,
        Consumer(EngineConfig("sd", model_name="tiny-gqa", deadline_s=2.0),
                 [(spec, allocate_cache(spec))], backend_factory=MemoryBackend) as cons,
    ):  # fmt: skip
        yield prod, cons, spec


def test_stats_count_requests_bytes_and_first_contact(engines) -> None:
    prod, cons, spec = engines
    for i in range(3):
        prod.hold(f"ok{i}", block_ids=[i, i + 4])
    done = [cons.read(f"ok{i}", prod.address, local_block_ids=[i, i + 8], remote_block_ids=[i, i + 4])
            for i in range(3)]  # fmt: skip
    bad = cons.read("bad", prod.address, local_block_ids=[99], remote_block_ids=[1])  # no block 99
    finished = list(as_completed([*done, bad], timeout_s=10))
    assert sorted(t.request_id for t in finished) == ["bad", "ok0", "ok1", "ok2"]
    assert [t.state for t in done] == [RequestState.DONE] * 3 and bad.state is RequestState.FAILED
    s = cons.stats()
    assert s.requests == {"done": 3, "failed": 1, "pending": 0}
    # every DONE request moved 2 blocks of K and V for every layer
    assert s.bytes_moved == 3 * 2 * 2 * spec.num_layers * spec.kernel_block_bytes
    assert s.descriptors_posted >= 3 * 2 * 2 * spec.num_layers
    assert sum(s.latency_counts) == 4 and len(s.latency_counts) == len(s.latency_buckets_s) + 1
    assert s.latency_sum_s > 0
    (fc,) = s.first_contacts
    assert fc.address == prod.address and set(fc.phases_s) >= {"fetch", "prepare"}
    assert 0 < fc.num_rows < fc.num_descriptors  # strided rows stand for many descriptors


def test_wait_any_and_wait_async(engines) -> None:
    prod, cons, _ = engines
    prod.hold("a", block_ids=[1])
    never = cons.read("never", "tcp://127.0.0.1:9", local_block_ids=[2], remote_block_ids=[3])
    quick = cons.read("a", prod.address, local_block_ids=[1], remote_block_ids=[1])
    assert wait_any([never, quick], timeout_s=5) is quick
    assert wait_any([never], timeout_s=0.05) is None  # nothing ended within the wait

    async def main() -> RequestState:
        prod.hold("b", block_ids=[2])
        t = cons.read("b", prod.address, local_block_ids=[3], remote_block_ids=[2])
        return await t.wait_async(5)

    assert asyncio.run(main()) is RequestState.DONE


def test_prometheus_exporter_reads_the_snapshot(engines) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvxfer.integrations.prometheus import register

    prod, cons, _ = engines
    prod.hold("p", block_ids=[5])
    assert (
        cons.read("p", prod.address, local_block_ids=[6], remote_block_ids=[5]).wait(5)
        is RequestState.DONE
    )
    registry = prometheus_client.CollectorRegistry()
    register(cons, registry)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'kvxfer_requests_total{engine="sd",state="done"} 1.0' in text
    assert f'kvxfer_moved_bytes_total{{engine="sd"}} {float(cons.stats().bytes_moved)}' in text
    assert 'kvxfer_request_latency_seconds_count{engine="sd"} 1.0' in text
    assert "kvxfer_first_contact_seconds{" in text
