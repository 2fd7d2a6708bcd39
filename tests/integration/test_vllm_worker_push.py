"""The vLLM worker side in push mode (``transfer_mode`` "push"): the decode's load asks
the prefill to WRITE the request, with the hold ticket of its params. Real NIXL engines
in one process; no vLLM (the real-vLLM case is in tests/vllm)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, allocate_cache
from kvxfer.errors import ConfigError
from kvxfer.integrations.vllm.extra import ExtraConfig, transfer_mode
from kvxfer.integrations.vllm.params import RemotePrefill
from kvxfer.integrations.vllm.scheduler import LoadJob
from kvxfer.integrations.vllm.worker import WorkerSettings, WorkerSide, _Load
from kvxfer.layout.presets import spec_for
from kvxfer.testing import fill, mismatches
from tests.integration.vllm_worker_util import finish

pytestmark = pytest.mark.timeout(60)

SPEC = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
BLOCKS = (3, 4, 5)


def _side(mode: str) -> WorkerSide:
    return WorkerSide(WorkerSettings("e", 0, 1, 16, 2, "CPU_ATTN", False, True, "tiny-gqa",
                                     "float16", extra=ExtraConfig(transfer_mode=mode)))  # fmt: skip


def _job(prod: Producer, rid: str, ticket: int) -> LoadJob:
    remote = RemotePrefill("p", rid, prod.address, (prod.generation,), BLOCKS, 16, 1,
                           48, hold_ticket=ticket)  # fmt: skip
    return LoadJob(f"d-{rid}", remote, BLOCKS, BLOCKS)


def test_transfer_mode_key() -> None:
    assert transfer_mode("pull") == "pull" and transfer_mode("push") == "push"
    for bad in ("PUSH", "", None, 1):
        with pytest.raises(ConfigError, match="transfer_mode must be"):
            transfer_mode(bad)


def test_push_loads_are_written_checked_and_free_the_hold() -> None:
    bufs = allocate_cache(SPEC)
    fill(SPEC, bufs)
    local = allocate_cache(SPEC)
    with (
        Producer(EngineConfig("wpp", model_name="tiny-gqa"), [(SPEC, bufs)]) as prod,
        Consumer(EngineConfig("wpd", model_name="tiny-gqa"), [(SPEC, local)]) as cons,
    ):
        side = _side("push")
        side.consumer = cons
        lease = prod.hold("a", block_ids=list(BLOCKS))
        side.start([_job(prod, "a", lease.ticket)], [])
        assert side._loads["d-a"].transfer.op.value == "WRITE"  # type: ignore[union-attr]
        assert finish(side, "d-a") == set()
        assert mismatches(SPEC, local, SPEC, list(BLOCKS), list(BLOCKS)) == 0
        end = time.monotonic() + 5
        while prod.num_held and time.monotonic() < end:
            prod.wait_freed(0.05)
        assert [(r, f.value) for r, f in prod.pop_freed()] == [("a", "read")]
        # the same params again (a second engine, a retry): the hold has ended, the
        # prefill refuses to write, and the load is a failed load (vLLM recomputes)
        side.start([_job(prod, "a", lease.ticket)], [])
        assert finish(side, "d-a") == set(BLOCKS)
        stats = side.take_stats()  # what vLLM's stats path gets from this worker
        assert stats is not None
        assert (stats["loads_done"], stats["loads_failed"], stats["first_contacts"]) == (1, 1, 1)
        assert stats["load_bytes"] == len(BLOCKS) * SPEC.page_bytes * SPEC.num_layers
        assert len(stats["load_s"]) == 1 and 0 < stats["load_s"][0] < 10


class _ReadyPeer:
    def __init__(self) -> None:
        self.ready = threading.Event()
        self.ready.set()  # first contact is over


@dataclasses.dataclass
class _StuckPush:
    """A push transfer that timed out while its producer may still write (quarantined):
    a seam for the rule below, which a real producer would end within milliseconds."""

    quarantined: bool = True
    state: RequestState = RequestState.TIMEOUT
    error: Exception | None = None
    latency_s: float = 5.0
    num_bytes: int = 0
    peer: object = dataclasses.field(default_factory=lambda: _ReadyPeer())

    def poll(self) -> RequestState:
        return self.state


def test_a_failed_push_is_reported_only_after_its_quarantine() -> None:
    """vLLM recomputes (or frees) the blocks of a failed load at once: a push that may
    still land there must not be reported before the producer can write nothing more."""
    side = _side("push")
    stuck = _StuckPush()
    job = LoadJob("d-q", RemotePrefill("p", "q", "tcp://x:1", (1,), BLOCKS, 16, 1, 48), BLOCKS,
                  BLOCKS)  # fmt: skip
    side._loads["d-q"] = _Load(job, stuck)  # type: ignore[arg-type]
    assert side.finished() == (set(), set()) and side.take_load_errors() == set()
    stuck.quarantined = False
    assert side.finished() == (set(), {"d-q"})
    assert side.take_load_errors() == set(BLOCKS)
    stats = side.take_stats()
    assert stats is not None and stats["loads_timeout"] == 1 and stats["loads_done"] == 0
