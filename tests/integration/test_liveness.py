"""Liveness verdicts over real sockets: which probe results prove a producer process gone
(a refused connection, another generation answering) and which do not (silence)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvxfer.engine.liveness import PeerMonitor, listener_gone
from kvxfer.transport.side_channel import SideChannelServer
from tests.engines import free_port
from tests.integration.test_side_channel import H, records

pytestmark = pytest.mark.timeout(60)

INTERVAL_S = 0.1


@pytest.fixture
def silent() -> Iterator[str]:
    """An endpoint that accepts TCP connections (the kernel's backlog) and never answers:
    what a stopped (SIGSTOP) or wedged producer looks like."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield f"tcp://127.0.0.1:{s.getsockname()[1]}"
    s.close()


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    srv = SideChannelServer("tcp://127.0.0.1:0", records(1)).start()
    yield srv
    srv.stop()


def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


class Calls:
    def __init__(self) -> None:
        self.lost: list[tuple[str, str, set[int]]] = []
        self.gone: list[set[int]] = []
        self.lock = threading.Lock()

    def on_lost(self, key: str, reason: str, generations: set[int]) -> None:
        with self.lock:
            self.lost.append((key, reason, generations))

    def on_gone(self, generations: set[int]) -> None:
        with self.lock:
            self.gone.append(set(generations))


@pytest.fixture
def calls() -> Iterator[tuple[Calls, PeerMonitor]]:
    c = Calls()
    mon = PeerMonitor(H, INTERVAL_S, c.on_lost, max_misses=2, on_gone=c.on_gone)
    yield c, mon
    mon.close()


def test_a_name_resolving_to_ipv6_first_is_not_proof_that_an_ipv4_listener_is_gone(
    monkeypatch: pytest.MonkeyPatch, server: SideChannelServer
) -> None:
    # ZMQ (IPv6 off) binds and connects IPv4 only; many hosts files put "localhost" on
    # ::1 too, often first. A refusal at ::1 while the producer listens on 127.0.0.1 is
    # not a proof that its process is gone (that proof ends push quarantines).
    port = int(server.address.rsplit(":", 1)[1])
    real = socket.getaddrinfo

    def v6_first(host, port, family=0, type=0, proto=0, flags=0):  # type: ignore[no-untyped-def]
        if host != "dual.test":
            return real(host, port, family, type, proto, flags)
        v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))
        v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))
        return [a for a in (v6, v4) if family in (0, a[0])]

    monkeypatch.setattr(socket, "getaddrinfo", v6_first)
    assert listener_gone(f"tcp://dual.test:{port}") is False
    assert listener_gone(f"tcp://dual.test:{free_port()}") is True  # nothing listens: gone


def test_listener_gone_only_when_nothing_listens(silent: str, server: SideChannelServer) -> None:
    assert listener_gone(f"tcp://127.0.0.1:{free_port()}") is True
    assert listener_gone(silent) is False  # connects: alive, or only stopped
    assert listener_gone(server.address) is False
    assert listener_gone("ipc:///tmp/kvxfer-none") is False  # not TCP: no proof
    assert listener_gone("tcp://127.0.0.1:notaport") is False
    # another host: its refusal may be a firewall (this machine rejects unknown hosts so)
    assert listener_gone("tcp://192.0.2.1:5555", timeout_s=0.05) is False


def test_a_dead_endpoint_is_judged_gone_at_its_first_probe(calls) -> None:  # type: ignore[no-untyped-def]
    c, mon = calls
    ep = f"tcp://127.0.0.1:{free_port()}"
    mon.watch("p", {ep: {5, 6}})
    assert _until(lambda: bool(c.lost))
    ((key, reason, gens),) = c.lost
    assert key == "p" and gens == {5, 6} and "refuses connections" in reason, reason
    assert c.gone == [{5, 6}]


def test_silence_drops_the_peer_but_proves_nothing(calls, silent: str) -> None:  # type: ignore[no-untyped-def]
    c, mon = calls
    mon.watch("p", {silent: {5}})
    assert _until(lambda: bool(c.lost))
    assert "no heartbeat reply 2 times in a row" in c.lost[0][1], c.lost
    time.sleep(3 * INTERVAL_S)
    assert c.gone == []  # a stopped process may still write: no proof


def test_silence_waits_silence_s_before_its_verdict(silent: str) -> None:
    """Misses alone (2 here, about 0.3 s) are not enough: the endpoint must also have been
    silent ``silence_s`` since it was watched (or last answered)."""
    c = Calls()
    mon = PeerMonitor(H, INTERVAL_S, c.on_lost, max_misses=2, silence_s=1.0)
    try:
        t0 = time.monotonic()
        mon.watch("p", {silent: {5}})
        time.sleep(0.7)
        assert c.lost == []
        assert _until(lambda: bool(c.lost))
        took = time.monotonic() - t0
        assert 1.0 <= took < 2.5, took
        ((key, reason, gens),) = c.lost
        assert key == "p" and gens == {5}, c.lost
        assert "no heartbeat reply" in reason and "s without an answer" in reason, reason
    finally:
        mon.close()


def test_a_restart_proves_the_old_generation_gone(calls, server: SideChannelServer) -> None:  # type: ignore[no-untyped-def]
    c, mon = calls
    mon.watch("p", {server.address: {7}})  # the server runs generation 1 now
    assert _until(lambda: bool(c.gone))
    assert "restarted" in c.lost[0][1] and c.gone == [{7}]


def test_end_watch_settles_only_on_proof(calls, server: SideChannelServer, silent: str) -> None:  # type: ignore[no-untyped-def]
    c, mon = calls
    far = time.monotonic() + 60
    mon.watch_end(server.address, {1}, far)  # generation 1 still answers there: alive
    mon.watch_end(silent, {2}, far)  # silent: stopped or partitioned, no proof
    time.sleep(6 * INTERVAL_S)
    assert c.gone == [] and mon.num_ending == 2
    mon.watch_end(server.address, {3}, far)  # 3 ran there before: generation 1 replaced it
    assert _until(lambda: {3} in [g & {3} for g in c.gone])
    addr = server.address
    server.stop()  # nothing listens there any more: generation 1 is gone too
    assert _until(lambda: any(1 in g for g in c.gone))
    assert mon.num_ending == 1  # only the silent endpoint is still watched
    assert not any(2 in g for g in c.gone)
    assert listener_gone(addr)


def test_an_end_watch_gives_up_at_its_bound_without_a_verdict(calls, silent: str) -> None:  # type: ignore[no-untyped-def]
    c, mon = calls
    mon.watch_end(silent, {2}, time.monotonic() + 3 * INTERVAL_S)
    assert _until(lambda: mon.num_ending == 0)
    assert c.gone == []  # the time bound ends the quarantine itself; nothing is proven
