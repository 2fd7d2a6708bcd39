"""Waiting for one request's end: the half of :class:`~kvxfer.engine.transfer.Transfer`
its callers use (``wait``, ``result``, ``wait_async``, end callbacks), apart from the
state machine that gets it there. Sleeps on an event the state machine sets; never
busy-loops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from kvxfer.engine.config import RequestState, check_seconds
from kvxfer.errors import KvxferError, WaitTimeout

__all__ = ["RequestEnd"]

log = logging.getLogger(__name__)
_DEADLINE_SLACK_S = 0.05  # a waiter without its own timeout wakes this long past the deadline


class RequestEnd:
    """Base of a request handle: waiting on its end. The subclass owns the fields named
    below and the state machine (:meth:`poll`); it calls :meth:`_ended_now` (under its
    engine lock) when the request turns terminal.

    Thread-safety: callbacks are added and removed under the engine lock
    (:meth:`_engine_lock`), the same lock under which the request ends.
    """

    __slots__ = ()

    request_id: str
    deadline: float  # monotonic
    state: RequestState
    error: KvxferError | None
    _ended: threading.Event
    _on_end: list[Callable[[], None]]

    def poll(self) -> RequestState:
        """One step of the state machine (the subclass's)."""
        raise NotImplementedError

    def _engine_lock(self) -> threading.RLock:
        """The lock every step of the state machine runs under."""
        raise NotImplementedError

    def _watch(self) -> None:
        """Have the engine's progress thread drive this request until it ends."""
        raise NotImplementedError

    def on_end(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` (from whichever thread ends the request, under the engine
        lock: keep it short) once the request is terminal; at once if it already is.
        Returns a function that unregisters it."""
        with self._engine_lock():
            if self.state.is_terminal:
                callback()
                return lambda: None
            self._on_end.append(callback)

        def remove() -> None:
            with self._engine_lock():
                if callback in self._on_end:
                    self._on_end.remove(callback)

        return remove

    def _ended_now(self) -> None:
        """The request just became terminal (under the lock): wake whoever waits."""
        self._ended.set()
        callbacks = list(self._on_end)
        self._on_end.clear()
        for cb in callbacks:
            try:
                cb()
            except Exception as e:  # a waiter's callback never breaks the state machine
                log.warning("request %r: end callback failed: %s", self.request_id, e)

    def _wait_until(self, timeout_s: float | None) -> float:
        """When a wait of ``timeout_s`` ends (never past the request's own deadline)."""
        if timeout_s is None:
            return self.deadline
        check_seconds("timeout_s", timeout_s, allow_zero=True)
        return min(self.deadline, time.monotonic() + timeout_s)

    def wait(self, timeout_s: float | None = None) -> RequestState:
        """Block until terminal or ``timeout_s`` (the request's own deadline always
        applies). Sleeps on the request's end: after one step here (which may post it),
        the consumer's progress thread drives the request.

        Raises:
            ConfigError (a ValueError): ``timeout_s`` is NaN, infinite or negative.
        """
        until = self._wait_until(timeout_s)
        if self.poll().is_terminal:
            return self.state
        self._watch()
        # past the deadline the progress thread ends it TIMEOUT; the slack covers its sweep
        slack = 0.0 if timeout_s is not None else _DEADLINE_SLACK_S
        if not self._ended.wait(max(0.0, until - time.monotonic()) + slack):
            return self.poll()  # the caller's time is up (or the sweep was late: step now)
        return self.state

    def result(self, timeout_s: float | None = None) -> None:
        """Wait; raise the request's error unless it ended DONE.

        Raises:
            WaitTimeout: the caller's ``timeout_s`` ran out first (the request goes on).
            DeadlineError: the request's own deadline passed (it ended TIMEOUT).
        """
        state = self.wait(timeout_s)
        if state is RequestState.DONE:
            return
        if self.error is not None:
            raise self.error
        raise WaitTimeout(f"request {self.request_id!r} still {state.value} after {timeout_s} s")

    async def wait_async(self, timeout_s: float | None = None) -> RequestState:
        """:meth:`wait` for asyncio code: awaits the request's end (the consumer's progress
        thread drives it and wakes this loop), never blocks the event loop."""
        until = self._wait_until(timeout_s)
        if self.poll().is_terminal:
            return self.state
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def wake() -> None:  # from the thread that ended the request
            def settle() -> None:
                if not ended.done():
                    ended.set_result(None)

            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(settle)

        remove = self.on_end(wake)
        self._watch()
        slack = 0.0 if timeout_s is not None else _DEADLINE_SLACK_S
        try:
            await asyncio.wait_for(ended, max(0.0, until - time.monotonic()) + slack)
        except TimeoutError:
            return self.poll()
        finally:
            remove()
        return self.state
