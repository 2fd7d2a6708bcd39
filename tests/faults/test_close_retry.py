"""A close() that fails part way (one part raising) closes every other part it can, and
a second close() finishes the job; a producer keeps its side channel up while one of its
agents is not closed, since consumers take a refused connection as proof that the
process can write no more (review finding of stop 29: a failed close could not be
retried). Real NIXL and ZMQ; the failure is injected into one part's close."""

from __future__ import annotations

import pytest

from kvxfer.engine import Consumer, EngineConfig, Producer, allocate_cache
from kvxfer.engine.liveness import listener_gone
from kvxfer.errors import KvxferError, TransferError
from kvxfer.layout.presets import spec_for
from kvxfer.transport.side_client import fetch_records
from tests.engines import local_pair, until


class _FailsOnce:
    """Wraps a bound ``close``/``stop``: the first call raises, later ones close."""

    def __init__(self, fn: object) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected: this part failed to close")
        self.fn()  # type: ignore[operator]


def _closed(backend: object) -> bool:
    try:
        backend.metadata()  # type: ignore[attr-defined]
    except TransferError as e:
        return "closed" in str(e)
    return False


def test_a_consumer_close_that_failed_part_way_can_be_retried() -> None:
    with local_pair() as (_, _, _, cons):
        address = cons.address
        caches = list(cons.ranks.values())
        server = cons.server
        assert server is not None
        server.stop = _FailsOnce(server.stop)  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="injected"):
            cons.close()
        # the rest was closed in the same call: the agents are gone
        assert all(_closed(c.backend) for c in caches), "a failing server left agents open"
        assert not listener_gone(address)  # the part that failed is still up
        cons.close()  # the retry finishes it
        assert until(lambda: listener_gone(address), 2.0)  # ZMQ closes it in its IO thread
        assert cons.ranks == {} and cons.server is None
        cons.close()  # and stays idempotent


def test_a_producer_keeps_its_side_channel_while_an_agent_is_not_closed() -> None:
    with local_pair() as (_, _, prod, cons):
        address = prod.address
        rank = prod.ranks[0]
        rank.close = _FailsOnce(rank.close)  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="injected"):
            prod.close()
        assert not _closed(rank.backend)
        # still answering: no consumer may take this process for gone
        recs = fetch_records(address, None, cons.compat_hash, 5.0,
                             auth_key=cons.config.auth_key, facts=cons.facts)  # fmt: skip
        assert [r.tp_rank for r in recs] == [0]
        prod.close()
        assert _closed(rank.backend) and until(lambda: listener_gone(address), 2.0)
        assert prod.ranks == []


def test_the_vllm_worker_closes_the_other_engine_when_one_fails_and_retries_it() -> None:
    """vLLM's shutdown must not stop at the first engine whose close raised: the other
    closes all the same, and the one that failed is closed by the next close()."""
    from kvxfer.integrations.vllm.extra import ExtraConfig
    from kvxfer.integrations.vllm.worker import WorkerSettings, WorkerSide

    with local_pair() as (_, _, prod, cons):
        side = WorkerSide(WorkerSettings("e", 0, 1, 16, 2, "CPU_ATTN", True, True, "tiny-gqa",
                                         "float16", extra=ExtraConfig()))  # fmt: skip
        side.consumer, side.producer = cons, prod
        cons_rank, prod_rank = cons.ranks[0], prod.ranks[0]
        cons_rank.close = _FailsOnce(cons_rank.close)  # type: ignore[method-assign]
        side.close()  # logs the failure; shutdown goes on
        assert _closed(prod_rank.backend) and until(lambda: listener_gone(prod.address), 2.0)
        assert not _closed(cons_rank.backend) and side.consumer is cons
        side.close()
        assert _closed(cons_rank.backend) and side.consumer is None


def _two_ranks() -> list[tuple[object, list[object]]]:
    """Both TP ranks of tiny-gqa (TP 2) in one engine."""
    out = []
    for r in range(2):
        spec = spec_for("tiny-gqa", tp_rank=r, tp_size=2, num_blocks=8)
        out.append((spec, allocate_cache(spec)))
    return out


def test_one_rank_failing_to_close_does_not_keep_the_others_open() -> None:
    """Consumer and producer with two ranks, rank 0's close failing once: rank 1 closes
    in the same call; the consumer's agents count as gone (which ends quarantines of
    READs still running) only once rank 0 closed too; the producer's side channel stays
    up until then."""
    cons = Consumer(EngineConfig("d2", model_name="tiny-gqa"), _two_ranks())  # type: ignore[arg-type]
    prod = Producer(EngineConfig("p2", model_name="tiny-gqa"), _two_ranks())  # type: ignore[arg-type]
    try:
        c0, c1 = cons.ranks[0], cons.ranks[1]
        p0, p1 = prod.ranks
        c0.close = _FailsOnce(c0.close)  # type: ignore[method-assign]
        p0.close = _FailsOnce(p0.close)  # type: ignore[method-assign]
        for engine in (cons, prod):
            with pytest.raises(RuntimeError, match="injected"):
                engine.close()
        assert _closed(c1.backend) and not _closed(c0.backend)
        assert _closed(p1.backend) and not _closed(p0.backend)
        assert cons._agents_gone is False  # rank 0's agent could still take bytes
        assert list(cons.ranks) == [0] and prod.ranks == [p0]
        assert not listener_gone(prod.address)
        with pytest.raises(KvxferError, match="producer closed"):
            prod.hold("late", block_ids=[1])  # nothing would ever free it
        cons.close()
        prod.close()
        assert _closed(c0.backend) and _closed(p0.backend)
        assert cons._agents_gone is True and cons.ranks == {} and prod.ranks == []
        assert until(lambda: listener_gone(prod.address), 2.0)
    finally:
        cons.close()
        prod.close()


@pytest.mark.parametrize("engine", ["consumer", "producer"])
def test_a_failed_construction_whose_cleanup_also_fails_raises_the_construction_error(
    engine: str,
) -> None:
    """The error users see names why the engine could not be built; the cleanup's own
    failure rides along as a note, and the agent whose close failed is not left to leak
    silently (review finding of stop 30: the close error replaced the construction's)."""
    from kvxfer.transport.nixl import NixlBackend

    made: list[NixlBackend] = []

    def factory(name: str) -> NixlBackend:
        if made:
            raise RuntimeError("injected: rank 1 could not be built")
        backend = NixlBackend(name, thread_safe=True)
        backend.close = _FailsOnce(backend.close)  # type: ignore[method-assign]
        made.append(backend)
        return backend

    specs = [spec_for("tiny-gqa", tp_rank=r, tp_size=2, num_blocks=4) for r in (0, 1)]
    ranks = [(s, allocate_cache(s)) for s in specs]
    cls = Consumer if engine == "consumer" else Producer
    with pytest.raises(RuntimeError, match="rank 1 could not be built") as info:
        cls(EngineConfig(engine[0], model_name="tiny-gqa"), ranks, backend_factory=factory)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "this part failed to close" in notes, notes
    made[0].close()  # the retry the note's reader can make: the agent then closes
    assert _closed(made[0])


def test_a_second_close_during_a_close_returns_at_once_and_the_first_finishes() -> None:
    """Two threads closing one consumer: the second call returns while the first is
    still under way (it neither waits for it nor closes anything twice), and the first
    closes everything (review finding of stop 30: no test of a concurrent close)."""
    import threading
    import time

    with local_pair() as (_, _, _, cons):
        caches = list(cons.ranks.values())
        inside, real = threading.Event(), cons._progress.close

        def slow_close() -> None:  # the first call's step outside the engine lock
            inside.set()
            time.sleep(0.5)
            real()

        cons._progress.close = slow_close  # type: ignore[method-assign]
        first = threading.Thread(target=cons.close)
        first.start()
        assert inside.wait(5.0)
        t0 = time.monotonic()
        cons.close()  # the second call
        took = time.monotonic() - t0
        assert first.is_alive() and took < 0.4, took  # it did not wait for the first
        first.join(10.0)
        assert not first.is_alive()
        assert cons.ranks == {} and cons.server is None
        assert all(_closed(c.backend) for c in caches)
