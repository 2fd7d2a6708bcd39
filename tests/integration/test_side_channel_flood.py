"""Side channel under clients that send GetRecords and never read (real processes, real ZMQ).

The server runs in its own process with ~1 MiB of records per reply; a second process
opens hundreds of DEALER sockets that send requests as fast as their queues allow and
never receive. The server's RSS must stay bounded and a well-behaved client's fetch
latency low. Figures are printed (run with ``-s``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvxfer.transport.side_client import fetch_records
from tests.integration.test_side_channel import H

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
METADATA_BYTES = 512 << 10  # per rank: 2 ranks -> ~1 MiB per reply

SERVER = f"""
import sys, time
sys.path[:0] = [{str(ROOT / "src")!r}, {str(ROOT)!r}]
from tests.integration.test_side_channel import H, layout
from kvxfer.transport.side_channel import SideChannelServer
from kvxfer.wire import encode_record, record_from_layout
recs = {{r: encode_record(record_from_layout(layout(r), agent_name=f"p{{r}}",
        agent_metadata=bytes([r]) * {METADATA_BYTES}, generation=1), H) for r in range(2)}}
srv = SideChannelServer("tcp://127.0.0.1:0", recs).start()
print(srv.address, flush=True)
sys.stdin.read()  # until the test closes our stdin
print(srv.num_served, srv.num_rejected, flush=True)
"""

FLOODER = f"""
import sys, time, zmq
sys.path[:0] = [{str(ROOT / "src")!r}, {str(ROOT)!r}]
from tests.integration.test_side_channel import H
from kvxfer.wire import GetRecords, encode_side
address, n = sys.argv[1], int(sys.argv[2])
req = encode_side(GetRecords(None, H))
ctx = zmq.Context.instance()
socks = []
for _ in range(n):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    socks.append(s)
print("ready", flush=True)
while True:  # never receive; every socket sends a request every ~20 ms its queue takes it
    for s in socks:
        try:
            s.send(req, zmq.NOBLOCK)
        except zmq.Again:
            pass
    time.sleep(0.02)  # 400 sockets: ~20,000 requests/s; unpaced, the flooder itself
    # would take the CPU the server needs on a shared 2-core box
"""


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://"), address
        yield proc, address
    finally:
        proc.kill()
        proc.wait()


def flood(address: str, n: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOODER, address, str(n)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def fetch_latencies_ms(address: str, seconds: float) -> list[float]:
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        recs = fetch_records(address, [0, 1], H, 5.0)
        out.append((time.perf_counter() - t0) * 1e3)
        assert [len(r.agent_metadata) for r in recs] == [METADATA_BYTES] * 2
        time.sleep(0.005)
    return out


def test_clients_that_never_read_do_not_grow_the_server(
    server: tuple[subprocess.Popen[str], str],
) -> None:
    proc, address = server
    base = fetch_latencies_ms(address, 0.5)  # also the warm-up
    before = rss_mib(proc.pid)
    peak = before
    flooders = [flood(address, 200)]
    try:
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            peak = max(peak, rss_mib(proc.pid))
            time.sleep(0.1)
        growth_200 = peak - before
        flooders.append(flood(address, 200))  # 400 clients that never read
        time.sleep(1.0)  # past their first requests (each a first contact, answered once)
        cpu0, t0 = cpu_s(proc.pid), time.monotonic()
        lat = fetch_latencies_ms(address, 3.0)
        server_cpu = (cpu_s(proc.pid) - cpu0) / (time.monotonic() - t0)
        load = os.getloadavg()[0]
        peak = max(peak, rss_mib(proc.pid))
    finally:
        for f in flooders:
            f.kill()
            f.wait()
    p50, p99 = np.percentile(lat, [50, 99])
    print(
        f"\nserver RSS {before:.0f} MiB -> peak {peak:.0f} MiB (+{growth_200:.0f} MiB after 4 s "
        f"of 200 non-readers, +{peak - before:.0f} MiB with 400); valid fetches under 400 "
        f"non-readers: n={len(lat)} p50 {p50:.1f} ms p99 {p99:.1f} ms (idle: p50 "
        f"{np.percentile(base, 50):.1f} ms); server CPU {server_cpu:.0%} of a core, "
        f"machine load average {load:.1f}"
    )
    assert proc.poll() is None  # the server survived
    assert growth_200 < 160, growth_200  # a reply is 1 MiB: at most the reply budget + slack
    assert peak - before < 200
    # Quiet, the fix meets p99 < 50 ms; on a shared 2-core box (load average ~10 from
    # other jobs) scheduling delay dominates the tail, so the bound asserted is generous.
    # Before the fix a valid fetch got no reply within 5 s.
    assert p50 < 50, p50
    assert p99 < 1000, p99
