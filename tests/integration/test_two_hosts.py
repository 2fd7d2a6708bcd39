"""Producer and consumer on two "hosts": separate network namespaces joined by a veth pair.

Nothing may assume one host: the side channel binds a wildcard and advertises the
namespace's own address, NIXL/UCX wire up over the veth link, and every byte is checked.
Needs root and iproute2 (as on this project's machines and CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

WORKER = str(Path(__file__).with_name("netns_worker.py"))


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def hosts() -> Iterator[tuple[str, str, str]]:
    """Two namespaces ``a`` (10.231.x.1) and ``b`` (10.231.x.2); yields (ns_a, ns_b, ip_a)."""
    tag = f"{os.getpid() % 10000}"
    a, b, net = f"kvx-a{tag}", f"kvx-b{tag}", f"10.231.{os.getpid() % 250}"
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, dev, ip in ((a, f"va{tag}", f"{net}.1"), (b, f"vb{tag}", f"{net}.2")):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield a, b, f"{net}.1"
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _worker(ns: str, *args: str) -> subprocess.Popen[str]:
    cmd = ["ip", "netns", "exec", ns, sys.executable, WORKER, *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_transfer_between_namespaces(hosts: tuple[str, str, str], write: bool) -> None:
    ns_a, ns_b, ip_a = hosts
    port = 5700 + os.getpid() % 200
    prod = _worker(
        ns_a, "producer", "--bind", f"tcp://0.0.0.0:{port}", "--advertise", f"tcp://{ip_a}:{port}"
    )
    try:
        assert prod.stdout is not None
        ready = prod.stdout.readline().split()
        assert ready[:1] == ["READY"], ready
        assert ready[1] == f"tcp://{ip_a}:{port}"  # advertised, not the wildcard
        ip_b = ip_a.rsplit(".", 1)[0] + ".2"
        args = [
            "consumer",
            "--address",
            ready[1],
            "--requests",
            "8",
            "--bind",
            f"tcp://0.0.0.0:{port + 1}",
        ]
        args += ["--advertise", f"tcp://{ip_b}:{port + 1}"] + (["--write"] if write else [])
        cons = subprocess.run(
            ["ip", "netns", "exec", ns_b, sys.executable, WORKER, *args],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )  # fmt: skip
        assert cons.returncode == 0, cons.stderr[-2000:]
        out = json.loads(cons.stdout.strip().splitlines()[-1])
        assert out["states"] == ["done"] * 8
        assert out["done"] == 8 and out["bad"] == 0
    finally:
        prod.stdin.close() if prod.stdin else None
        try:
            prod.wait(10)
        except subprocess.TimeoutExpired:
            prod.kill()
