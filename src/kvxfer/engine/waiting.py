"""Waiting on several requests at once: :func:`as_completed` and :func:`wait_any`."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from kvxfer.engine.config import check_seconds
from kvxfer.engine.transfer import Transfer

__all__ = ["as_completed", "wait_any"]


def as_completed(
    transfers: Iterable[Transfer], timeout_s: float | None = None
) -> Iterator[Transfer]:
    """Yield each transfer as it ends (terminal state), in the order they end.

    Stops after ``timeout_s`` (None: when all ended; each request's own deadline bounds
    that). Raises ConfigError for a NaN, infinite or negative ``timeout_s``.
    """
    if timeout_s is not None:
        check_seconds("timeout_s", timeout_s, allow_zero=True)
    live = list(transfers)
    until = None if timeout_s is None else time.monotonic() + timeout_s
    pause = 0.0002
    while live:
        still = []
        for t in live:
            if t.poll().is_terminal:
                yield t
                pause = 0.0002
            else:
                still.append(t)
        live = still
        if not live or (until is not None and time.monotonic() >= until):
            return
        time.sleep(pause)
        pause = min(pause * 2, 0.002)


def wait_any(transfers: Iterable[Transfer], timeout_s: float | None = None) -> Transfer | None:
    """The first of ``transfers`` to end, or None if none ended within ``timeout_s``."""
    return next(as_completed(transfers, timeout_s), None)
