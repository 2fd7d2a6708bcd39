"""Short-lived helper threads an engine's ``close()`` waits for.

A consumer's first contacts, preconnects and rechecks, and a producer's consumer
fetches, each run in a thread of their own that blocks in a side-channel fetch. The
engine cancels those fetches first (``fetch_records(cancel=)``), then joins the threads
here, within one time bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["ThreadSet"]


class ThreadSet:
    """Daemon threads started by :meth:`spawn`, each removing itself when it ends.
    Thread-safe: the set is under its own lock, and a thread is added as it starts, so
    :meth:`join` never meets one that has not started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()

    def spawn(
        self, target: Callable[..., None], args: tuple[object, ...], name: str
    ) -> threading.Thread:
        """Start ``target(*args)`` in a daemon thread named ``name``."""

        def run() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        th = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            th.start()
            self._threads.add(th)
        return th

    def join(self, within_s: float) -> list[str]:
        """Wait up to ``within_s`` in all for the threads running now; return the names
        of those still running."""
        end = time.monotonic() + within_s
        with self._lock:
            threads = list(self._threads)
        for th in threads:
            th.join(max(0.0, end - time.monotonic()))
        return [th.name for th in threads if th.is_alive()]
