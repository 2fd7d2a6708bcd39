"""The CPU census the vLLM probe uses to say who had the CPU during a slow load: per
thread run time and run-queue wait from ``/proc/*/task/*/schedstat``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvxfer.bench.cpu_census import census, census_delta

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/task"), reason="needs Linux /proc (schedstat)"
)

SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


def test_a_busy_process_is_the_top_thread_with_its_cpu_time() -> None:
    live = subprocess.Popen([sys.executable, "-c", SPIN.format(s=30)])
    try:
        time.sleep(0.1)
        start = census()
        time.sleep(0.5)
        report = census_delta(start, census(), top=5)
    finally:
        live.kill()
        live.wait()
    top = report["threads"][0]
    assert top["pid"] == live.pid
    assert top["comm"].startswith("python")
    # spinning for the whole 0.5 s window: at least 0.25 s of CPU even on a busy box
    assert 250 <= top["run_ms"] <= 600
    assert report["window_ms"] == pytest.approx(500, abs=150)
    by_pid = {p["pid"]: p for p in report["processes"]}
    assert by_pid[live.pid]["run_ms"] == pytest.approx(top["run_ms"], abs=1)


def test_threads_that_appear_during_the_window_count_from_zero() -> None:
    start = census()
    live = subprocess.Popen([sys.executable, "-c", SPIN.format(s=30)])
    try:
        time.sleep(0.4)
        report = census_delta(start, census(), top=3)
    finally:
        live.kill()
        live.wait()
    pids = [t["pid"] for t in report["threads"]]
    assert live.pid in pids
    # and a thread's wait for a CPU is reported (non-negative, never larger than the window)
    for t in report["threads"]:
        assert 0 <= t["wait_ms"] <= report["window_ms"] + 50


def test_own_threads_are_listed_with_their_names() -> None:
    start = census()
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        pass
    report = census_delta(start, census(), top=50, own_pid=os.getpid())
    own = report["own"]
    assert own and all(t["pid"] == os.getpid() for t in own)
    main = [t for t in own if t["tid"] == os.getpid()]
    assert main and main[0]["run_ms"] >= 100
