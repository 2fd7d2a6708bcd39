"""Helpers of the vLLM worker-side tests (real engines, no vLLM)."""

from __future__ import annotations

import time

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
