"""Helpers of the vLLM worker-side tests (real engines, no vLLM)."""

from __future__ import annotations

import time

from kvxfer.engine import Producer
from kvxfer.integrations.vllm.params import RemotePrefill
from kvxfer.integrations.vllm.scheduler import LoadJob
from kvxfer.integrations.vllm.worker import WorkerSide


def finish(side: WorkerSide, rid: str, timeout_s: float = 20) -> set[int]:
    """Poll ``side`` as vLLM's steps do until load ``rid`` is reported finished; its
    failed blocks (empty: the load ended DONE)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if rid in side.finished()[1]:
            return side.take_load_errors()
        time.sleep(0.005)
    raise AssertionError(f"{rid} never finished")


def load_held(prod: Producer, side: WorkerSide, name: str, blocks: tuple[int, ...],
              block_size: int) -> set[int]:  # fmt: skip
    """Hold ``blocks`` for request ``name`` on ``prod`` and load them into the same blocks
    of ``side`` (one step's LoadJob, its params naming the hold's ticket); the failed
    blocks (empty: the load ended DONE)."""
    lease = prod.hold(name, block_ids=list(blocks))
    remote = RemotePrefill(f"{name}-prefill", name, prod.address, (prod.generation,), blocks,
                           block_size, 1, len(blocks) * block_size,
                           hold_ticket=lease.ticket)  # fmt: skip
    side.start([LoadJob(f"d-{name}", remote, blocks, blocks)], [])
    return finish(side, f"d-{name}")
