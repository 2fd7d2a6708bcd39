"""A close() that fails part way (one part raising) closes every other part it can, and
a second close() finishes the job; a producer keeps its side channel up while one of its
agents is not closed, since consumers take a refused connection as proof that the
process can write no more (review finding of stop 29: a failed close could not be
retried). Real NIXL and ZMQ; the failure is injected into one part's close."""

from __future__ import annotations

import pytest

from kvxfer.engine.liveness import listener_gone
from kvxfer.errors import TransferError
from kvxfer.transport.side_client import fetch_records
from tests.engines import local_pair


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
        assert listener_gone(address)
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
        assert _closed(rank.backend) and listener_gone(address)
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
        assert _closed(prod_rank.backend) and listener_gone(prod.address)
        assert not _closed(cons_rank.backend) and side.consumer is cons
        side.close()
        assert _closed(cons_rank.backend) and side.consumer is None
