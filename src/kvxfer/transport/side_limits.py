"""Bounds of the side-channel server under floods (no zmq import: pure bookkeeping).

Socket options the server sets, the budget of replies in flight (:class:`Pending`) and
the loopback test behind the "no key on a public address" warning.
"""

from __future__ import annotations

import ipaddress
import time
from typing import Protocol

from kvxfer.wire.limits import MAX_SIDE_REPLY_BYTES

__all__ = [
    "MAX_PENDING_BYTES",
    "MAX_PENDING_PEERS",
    "PEER_BYTES",
    "RCVHWM",
    "REPEAT_BURST",
    "REPEAT_BYTES_PER_S",
    "REPEAT_MIN_BYTES",
    "SNDBUF",
    "SNDHWM",
    "Pending",
    "is_loopback",
]


class Tracker(Protocol):
    """What :class:`Pending` needs of a ``zmq.MessageTracker``."""

    @property
    def done(self) -> bool: ...


SNDHWM = 1000  # replies queued per peer inside ZMQ (ROUTER_MANDATORY: a full queue raises)
RCVHWM = 8  # requests queued per peer inside ZMQ (more wait in TCP: backpressure)
SNDBUF = 256 << 10  # kernel send buffer per peer connection (bytes)
PEER_BYTES = 1 << 20  # reply bytes in flight per peer before its requests are dropped
MAX_PENDING_BYTES = MAX_SIDE_REPLY_BYTES  # reply bytes not yet handed to the kernel, all peers
MAX_PENDING_PEERS = 1 << 16  # peers with a reply in flight (~200 bytes of state each)
REPEAT_MIN_BYTES = 64 << 10  # replies at least this large to repeaters are rate-limited
REPEAT_BYTES_PER_S = 64 << 20  # ... to this many bytes per second, all repeaters together
REPEAT_BURST = 8 << 20


class Pending:
    """Replies handed to ZMQ but not yet written to the kernel, bounded in bytes and peers.

    A peer with :data:`PEER_BYTES` of replies (or :data:`SNDHWM` replies) still inside
    ZMQ gets no new one: its requests are dropped before any work. A client that never
    reads thus holds about one large reply here (its kernel socket buffers hold the
    rest), while a client that pipelines small requests keeps getting answers. Replies
    are sent zero-copy, so peers sent the same (cached) reply share one buffer: memory
    counts once per distinct buffer. ``fetch_records`` asks once per connection, so a
    peer asking again is a *repeater*: its large replies share a token bucket of
    :data:`REPEAT_BYTES_PER_S`, which keeps ZMQ's I/O thread free for first requests
    under a flood. Used by the server thread only.
    """

    def __init__(self) -> None:
        self._by_peer: dict[bytes, list[tuple[Tracker, int]]] = {}  # peer -> [(tracker, buf)]
        self._seen: dict[bytes, None] = {}  # peers served before (bounded, oldest dropped)
        self._tokens = float(REPEAT_BURST)
        self._refilled = time.monotonic()
        self._bufs: dict[int, list[int]] = {}  # id(buf) -> [replies holding it, bytes]
        self._keep: dict[int, bytes] = {}  # the buffers themselves (ids stay unique)
        self.num_bytes = 0
        self._last_sweep = 0.0

    def _prune(self, peer: bytes) -> list[tuple[Tracker, int]]:
        """Forget ``peer``'s replies that left ZMQ; return the ones still inside."""
        live = []
        for tracker, key in self._by_peer.get(peer, ()):
            if not tracker.done:
                live.append((tracker, key))
                continue
            entry = self._bufs[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.num_bytes -= entry[1]
                del self._bufs[key], self._keep[key]
        if live:
            self._by_peer[peer] = live
        else:
            self._by_peer.pop(peer, None)
        return live

    def busy(self, peer: bytes) -> bool:
        """True while ``peer`` has too many reply bytes (or replies) inside ZMQ."""
        if peer not in self._by_peer:
            return False
        live = self._prune(peer)
        return len(live) >= SNDHWM or sum(self._bufs[k][1] for _, k in live) >= PEER_BYTES

    def admit(self, peer: bytes, buf: bytes) -> bool:
        """True if ``buf`` fits the budgets (sweeping finished replies at most every 50 ms)."""
        if peer in self._seen and len(buf) >= REPEAT_MIN_BYTES:  # rate-limited as a group
            now = time.monotonic()
            self._tokens = min(
                REPEAT_BURST, self._tokens + (now - self._refilled) * REPEAT_BYTES_PER_S
            )
            self._refilled = now
            if self._tokens < min(len(buf), REPEAT_BURST):
                return False
            self._tokens -= len(buf)

        def fits() -> bool:
            extra = 0 if id(buf) in self._bufs else len(buf)
            return (
                self.num_bytes + extra <= MAX_PENDING_BYTES
                and len(self._by_peer) < MAX_PENDING_PEERS
            )

        if fits():
            return True
        now = time.monotonic()
        if now - self._last_sweep > 0.05:
            self._last_sweep = now
            for p in list(self._by_peer):
                self._prune(p)
        return fits()

    def add(self, peer: bytes, tracker: Tracker, buf: bytes) -> None:
        key = id(buf)
        entry = self._bufs.get(key)
        if entry is None:
            entry = self._bufs[key] = [0, len(buf)]
            self._keep[key] = buf
            self.num_bytes += len(buf)
        entry[0] += 1
        self._by_peer.setdefault(peer, []).append((tracker, key))
        self._seen[peer] = None
        if len(self._seen) > MAX_PENDING_PEERS:
            del self._seen[next(iter(self._seen))]


def is_loopback(addr: str) -> bool:
    """True for ``ipc://``/``inproc://`` and ``tcp://`` on a loopback host."""
    if addr.startswith(("ipc://", "inproc://")):
        return True
    if not addr.startswith("tcp://"):
        return False
    host = addr[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a wildcard, an interface or a host name
        return False
