"""Waiting without busy loops.

NIXL reports a READ's completion only when asked (``check_xfer_state``), so someone
must poll. :class:`Progress` is one thread per consumer that polls the requests someone
waits on; waiters sleep on each request's end (:meth:`Transfer.wait`,
:meth:`Transfer.wait_async`, :func:`as_completed`, :func:`wait_any`). A request nobody
waits on is only advanced by its owner's :meth:`Transfer.poll` (what the vLLM connector
does once per step), so an engine whose requests are polled never runs this thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator

from kvxfer.engine.config import check_seconds
from kvxfer.engine.transfer import Transfer

__all__ = ["Progress", "as_completed", "wait_any"]

log = logging.getLogger(__name__)

POSTED_SWEEP_S = 0.0002  # between sweeps while a watched request is in flight
IDLE_SWEEP_S = 0.01  # while watched requests wait for first contact (kick() wakes at once)


class Progress:
    """The consumer's progress thread: drives watched requests until they end.

    Thread-safety: :meth:`watch`, :meth:`kick` and :meth:`close` may be called from any
    thread; the watched set is owned by ``_cv``. Each sweep steps every watched request
    through :meth:`Transfer.poll` (under the engine lock, like any caller); a request
    whose step raises is logged and the thread goes on. Started on the first watch.
    """

    def __init__(self, name: str = "kvxfer-progress") -> None:
        self._name = name
        self._cv = threading.Condition()
        self._watched: dict[int, Transfer] = {}  # id(transfer) -> transfer
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, t: Transfer) -> None:
        """Drive ``t`` until it is terminal (idempotent)."""
        with self._cv:
            if self._closed:
                return  # the consumer closed: its requests end ABORTED without us
            self._watched[id(t)] = t
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()

    def kick(self) -> None:
        """Sweep now (a first contact finished: watched requests can post)."""
        with self._cv:
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._watched.clear()
            self._cv.notify()
            th = self._thread
        if th is not None and th is not threading.current_thread():
            th.join(5)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._watched and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                batch = list(self._watched.values())
            in_flight = False
            for t in batch:
                try:
                    t.poll()
                except Exception as e:  # one request's fault never stops the others
                    log.warning("progress: request %r: %s: %s", t.request_id, type(e).__name__, e)
                if t.state.is_terminal:
                    with self._cv:
                        self._watched.pop(id(t), None)
                elif t.posted_at:
                    in_flight = True
            if in_flight:
                time.sleep(POSTED_SWEEP_S)
            else:
                with self._cv:
                    if self._watched and not self._closed:
                        self._cv.wait(IDLE_SWEEP_S)


def as_completed(
    transfers: Iterable[Transfer], timeout_s: float | None = None
) -> Iterator[Transfer]:
    """Yield each transfer as it ends (terminal state), in the order they end; sleeps
    between ends (the consumers' progress threads drive the requests).

    Stops after ``timeout_s`` (None: when all ended; each request's own deadline bounds
    that). Raises ConfigError for a NaN, infinite or negative ``timeout_s``.
    """
    if timeout_s is not None:
        check_seconds("timeout_s", timeout_s, allow_zero=True)
    live = list(transfers)
    until = None if timeout_s is None else time.monotonic() + timeout_s
    ended: queue.SimpleQueue[Transfer] = queue.SimpleQueue()
    removers = []
    try:
        for t in live:
            t.poll()  # one step each now (posts what can be posted)
            removers.append(t.on_end(lambda t=t: ended.put(t)))  # type: ignore[misc]
            if not t.state.is_terminal:
                t.context.watch(t)
        for _ in live:
            if until is None:  # every request ends by its own deadline (+ a sweep)
                left = max(t.deadline for t in live) - time.monotonic() + 1.0
            else:
                left = until - time.monotonic()
            try:
                yield ended.get(timeout=max(0.0, left))
            except queue.Empty:
                return
    finally:
        for remove in removers:
            remove()


def wait_any(transfers: Iterable[Transfer], timeout_s: float | None = None) -> Transfer | None:
    """The first of ``transfers`` to end, or None if none ended within ``timeout_s``."""
    return next(as_completed(transfers, timeout_s), None)
