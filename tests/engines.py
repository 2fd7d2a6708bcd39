"""Helpers shared by the engine tests: a free port, and a producer and a consumer in
this process over real NIXL (the producer's cache filled with the verifiable pattern)."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvxfer.engine import Consumer, EngineConfig, Producer, allocate_cache
from kvxfer.layout.presets import spec_for
from kvxfer.layout.spec import LayoutSpec
from kvxfer.testing import fill

_GIVEN: set[int] = set()  # ports handed out by this process (never twice)
_RNG = random.SystemRandom()  # not the global generator, which tests may seed


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral
    range: a port the kernel hands out (bind to 0) can be taken as an outgoing
    connection's source port before the test's server binds it ("Address already in
    use", seen once in the soak); ports below the range are never picked that way."""
    low = _ephemeral_low()
    lo, hi = (20000, low - 1) if low > 21000 else (low - 1000, low - 1)
    for _ in range(1000):
        port = _RNG.randint(lo, hi)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {lo}-{hi}")


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
