"""A free TCP port for a test server (tests and the vLLM scenarios)."""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

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
    connection's source port, or by another server binding port 0, before the test's
    server binds it ("Address already in use": seen in the soak, and for the HTTP
    scenario's proxy started after two vLLM servers); ports below the range are never
    picked that way."""
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
