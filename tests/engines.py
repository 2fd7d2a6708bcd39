"""Helpers shared by the engine tests: a free port, and a producer and a consumer in
this process over real NIXL (the producer's cache filled with the verifiable pattern)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvxfer.engine import Consumer, EngineConfig, Producer, allocate_cache
from kvxfer.layout.presets import spec_for
from kvxfer.layout.spec import LayoutSpec
from kvxfer.testing import fill
from kvxfer.testing.ports import free_port

__all__ = ["free_port", "local_pair", "silent_endpoints", "until"]


@contextmanager
def local_pair(
    num_blocks: int = 16, **consumer_config: Any
) -> Iterator[tuple[LayoutSpec, list[Any], Producer, Consumer]]:
    """``(spec, consumer buffers, producer, consumer)``: tiny-gqa, TP 1 -> 1, the
    producer filled with the pattern, the consumer's buffers zeroed; both closed after."""
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=num_blocks)
    bufs = allocate_cache(spec)
    fill(spec, bufs)
    local = allocate_cache(spec)
    with (
        Producer(EngineConfig("p", model_name="tiny-gqa"), [(spec, bufs)]) as prod,
        Consumer(
            EngineConfig("d", model_name="tiny-gqa", **consumer_config), [(spec, local)]
        ) as cons,
    ):
        yield spec, local, prod, cons


def until(cond: Callable[[], object], within_s: float) -> bool:
    """Whether ``cond()`` became true within ``within_s`` (polled every 10 ms)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


@contextmanager
def silent_endpoints(n: int) -> Iterator[list[str]]:
    """``n`` endpoints that accept TCP connections and never answer (wedged side
    channels); closed after."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(8)
            socks.append(s)
        yield [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()
