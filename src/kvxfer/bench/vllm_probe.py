"""A profiling wrapper of :class:`~kvxfer.integrations.vllm.connector.KvxferConnector`
for ``kvxfer bench vllm`` (imports vLLM; runs inside vLLM's worker processes).

Behaves exactly like the connector; in addition, each decode-side load that ends is
written to the worker's log as one ``KVXFER_PROFILE {json}`` line: when the read was
started, posted and finished (``time.perf_counter``, CLOCK_MONOTONIC, so comparable with
the driver's clock), the peer's first-contact phases (``PeerInfo.timings_s``), whether
the peer was already contacted when the read started, sizes, and the connector's own
polls of it (vLLM asks once per engine step): how many, the longest gap between two while
it was posted, and when the last poll before the one that saw it end came. A READ whose
last in-flight poll came long after posting ended late on the wire; one polled only
rarely was waiting for vLLM's next step. Also: page-fault and CPU-steal counter deltas
over the load; on the producer side ``KVXFER_PRODUCER`` lines (when blocks were held,
when each ReadDone arrived); ``KVXFER_SLOW`` lines for backend calls of 10 ms or more
(which call, agent, thread, when, how long); ``KVXFER_GC`` lines for collections that
paused the worker 5 ms or more. With ``KVXFER_CENSUS=1`` in the environment, also a
``KVXFER_CPU`` line per load: which threads of the machine ran, and how long each of this
worker's threads waited for a CPU, between the read's start and its end being seen
(:mod:`kvxfer.bench.cpu_census`; taken in a helper thread, off the step path).
Load it with ``kv_connector_module_path="kvxfer.bench.vllm_probe"``,
``kv_connector="ProfiledKvxferConnector"``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import json
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kvxfer.bench.cpu_census import Census, census, census_delta
from kvxfer.engine import Producer, Transfer
from kvxfer.integrations.vllm.connector import KvxferConnector
from kvxfer.wire import ReadDone, decode_msg

__all__ = ["CPU_TAG", "GC_TAG", "PRODUCER_TAG", "PROFILE_TAG", "SLOW_TAG",
           "ProfiledKvxferConnector"]  # fmt: skip

PROFILE_TAG = "KVXFER_PROFILE"
PRODUCER_TAG = "KVXFER_PRODUCER"
GC_TAG = "KVXFER_GC"
SLOW_TAG = "KVXFER_SLOW"
CPU_TAG = "KVXFER_CPU"
log = logging.getLogger(__name__)


class ProfiledKvxferConnector(KvxferConnector):
    """:class:`KvxferConnector` that logs the timeline of every finished load."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._probe_census_on = os.environ.get("KVXFER_CENSUS") == "1"
        if self._probe_census_on:
            _name_os_threads()
        super().register_kv_caches(kv_caches)
        _trace_gc()
        self._probe_live: dict[str, Transfer] = {}
        self._probe_ready: dict[str, bool] = {}
        self._probe_polls: dict[str, list[float]] = {}  # poll times while posted
        self._probe_calls: dict[str, float] = {}  # longest get_finished while posted
        self._probe_faults: dict[str, dict[str, int]] = {}  # at read()
        self._probe_census: dict[str, threading.Thread] = {}  # takes the census at read()
        if self._worker is not None:
            consumer, producer = self._worker.consumer, self._worker.producer
            for cache in [
                *(consumer.ranks.values() if consumer is not None else ()),
                *(producer.ranks if producer is not None else ()),
            ]:
                _trace_slow(cache.backend)
        producer = self._worker.producer if self._worker is not None else None
        if producer is not None:
            self._trace_producer(producer)
        consumer = self._worker.consumer if self._worker is not None else None
        if consumer is None:
            return
        consumer.read = self._traced(consumer.read)  # type: ignore[method-assign]
        consumer.push = self._traced(consumer.push)  # type: ignore[method-assign]

    def _traced(self, start: Callable[..., Transfer]) -> Callable[..., Transfer]:
        """``start`` (the consumer's read or push) with its transfer traced."""

        def traced(request_id: str, *args: Any, **kwargs: Any) -> Transfer:
            faults = _faults()
            t = start(request_id, *args, **kwargs)
            self._probe_faults[request_id] = faults
            self._probe_live[request_id] = t
            self._probe_ready[request_id] = t.peer.ready.is_set()  # contact already done
            if self._probe_census_on:
                self._probe_census[request_id] = _census_start()
            return t

        return traced

    @staticmethod
    def _trace_producer(producer: Producer) -> None:
        """Log (``KVXFER_PRODUCER``) when the producer holds a request's blocks and when
        each consumer's ReadDone for it arrives (CLOCK_MONOTONIC, like the decode's)."""
        hold, on_msg = producer.hold, producer._on_msg
        held: dict[str, dict[str, int]] = {}  # request id -> fault counters at hold

        def traced_hold(request_id: str, *args: Any, **kwargs: Any) -> Any:
            out = hold(request_id, *args, **kwargs)
            held[request_id] = _faults()
            _emit(PRODUCER_TAG, {"request_id": request_id, "held_at": time.perf_counter()})
            return out

        def traced_on_msg(rank: int, agent: str, raw: bytes, pushes: Any) -> None:
            at = time.perf_counter()
            with contextlib.suppress(Exception):
                msg = decode_msg(raw)
                if isinstance(msg, ReadDone):
                    faults = _delta(held.pop(msg.request_id, {}))
                    _emit(PRODUCER_TAG, {"request_id": msg.request_id, "read_done_at": at,
                                         "faults": faults})  # fmt: skip
            on_msg(rank, agent, raw, pushes)

        producer.hold = traced_hold  # type: ignore[method-assign]
        producer._on_msg = traced_on_msg  # type: ignore[method-assign]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not hasattr(self, "_probe_live"):  # no caches registered: nothing to trace
            return super().get_finished(finished_req_ids)
        before = time.perf_counter()
        for rid, t in self._probe_live.items():
            if t.posted_at and not t.state.is_terminal:
                self._probe_polls.setdefault(rid, []).append(before)
        out = super().get_finished(finished_req_ids)
        now = time.perf_counter()
        for rid in self._probe_polls:
            self._probe_calls[rid] = max(self._probe_calls.get(rid, 0.0), now - before)
        for rid, t in list(self._probe_live.items()):
            if not t.state.is_terminal:
                continue
            del self._probe_live[rid]
            polls = self._probe_polls.pop(rid, [])
            times = [t.posted_at, *polls]
            gaps = [b - a for a, b in itertools.pairwise(times)]
            rec = {
                "request_id": rid, "state": t.state.value, "started_at": t.started_at,
                "posted_at": t.posted_at, "finished_at": t.finished_at, "reported_at": now,
                "num_descriptors": t.num_descriptors, "num_bytes": t.num_bytes,
                "peer_timings_s": dict(t.peer.timings_s), "peer_rows": t.peer.num_rows,
                "peer_ready_at": t.peer.phase_at if t.peer.phase == "ready" else None,
                "peer_descriptors": t.peer.num_descriptors,
                "peer_ready_at_read": self._probe_ready.pop(rid, False),
                "polls": len(polls), "max_poll_gap_s": max(gaps, default=0.0),
                "last_poll_in_flight_s": (polls[-2] - t.posted_at) if len(polls) > 1 else 0.0,
                "max_call_s": self._probe_calls.pop(rid, 0.0),
                "faults": _delta(self._probe_faults.pop(rid, {})),
            }  # fmt: skip
            _emit(PROFILE_TAG, rec)
            if (first := self._probe_census.pop(rid, None)) is not None:
                _census_emit(rid, first)
        return out


_VMSTAT = ("pgmajfault", "pgfault", "compact_stall", "allocstall_movable", "thp_fault_alloc")


def _faults() -> dict[str, int]:
    """This process's major/minor page faults, the machine's (``/proc/vmstat``) and its
    CPU steal ticks, for deltas around a load."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {"majflt": ru.ru_majflt, "minflt": ru.ru_minflt}
    with contextlib.suppress(OSError):
        with open("/proc/vmstat") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in _VMSTAT:
                    out[f"sys_{key}"] = int(value)
        with open("/proc/stat") as f:
            out["sys_steal_ticks"] = int(f.readline().split()[8])
    return out


def _delta(before: dict[str, int]) -> dict[str, int]:
    now = _faults()
    return {k: now[k] - v for k, v in before.items() if k in now}


_TRACED = ("make_xfer", "post", "poll", "release", "get_notifs", "send_notif", "add_remote",
           "prepare")  # fmt: skip


def _trace_slow(backend: Any, min_s: float = 0.01) -> None:
    """Log (``KVXFER_SLOW``) each call of the backend's transfer methods that takes longer
    than ``min_s``: which, on which agent, in which thread, when, and for how long."""
    for name in _TRACED:
        real = getattr(backend, name)

        def traced(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                if took >= min_s:
                    _emit(SLOW_TAG, {"call": _name, "agent": backend.name, "at": start, "s": took,
                                     "thread": threading.current_thread().name})  # fmt: skip

        setattr(backend, name, traced)


def _trace_gc(min_s: float = 0.005) -> None:
    """Log (``KVXFER_GC``) each garbage collection of this process that pauses it longer
    than ``min_s``: its generation, start and duration."""
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and time.perf_counter() - started[0] >= min_s:
            took = time.perf_counter() - started[0]
            _emit(GC_TAG, {"generation": info.get("generation"), "at": started[0], "s": took})

    gc.callbacks.append(callback)


def _name_os_threads() -> None:
    """Give every Python thread started from now on its name at the OS level too
    (``prctl(PR_SET_NAME)``, 15 bytes), so a census of this process from another one,
    or ``top -H``, tells kvxfer's threads from vLLM's (threads inherit their starter's
    name otherwise: every one would read ``VLLM::Worker``)."""
    if getattr(threading.Thread.run, "_kvxfer_named", False):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    run = threading.Thread.run

    def named_run(self: threading.Thread) -> None:
        libc.prctl(15, self.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        run(self)

    named_run._kvxfer_named = True  # type: ignore[attr-defined]
    threading.Thread.run = named_run  # type: ignore[method-assign]


def _census_start() -> threading.Thread:
    """Take a CPU census in a helper thread, kept on the thread as ``census``."""

    def take() -> None:
        thread.census = census()  # type: ignore[attr-defined]

    thread = threading.Thread(target=take, name="kvxfer-census", daemon=True)
    thread.start()
    return thread


def _census_emit(request_id: str, first: threading.Thread) -> None:
    """In a helper thread: wait for ``first`` (:func:`_census_start` at the read's start),
    take the end census and emit the window's ``KVXFER_CPU`` line."""

    def emit() -> None:
        first.join(1.0)  # the window's start is taken before its end
        start: Census | None = getattr(first, "census", None)
        if start is None:
            return
        names = {t.native_id: t.name for t in threading.enumerate()}
        report = census_delta(start, census(), top=12, own_pid=os.getpid())
        for row in [*report["threads"], *report["own"]]:
            row["py"] = names.get(row["tid"], "main" if row["tid"] == row["pid"] else "")
        _emit(CPU_TAG, {"request_id": request_id, "started_at": start.at_ns / 1e9, **report})

    threading.Thread(target=emit, name="kvxfer-census", daemon=True).start()


def _emit(tag: str, rec: dict[str, Any]) -> None:
    print(f"{tag} {json.dumps(rec)}", file=sys.stderr, flush=True)
