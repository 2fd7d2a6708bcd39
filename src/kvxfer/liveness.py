"""Liveness of idle peers: side-channel heartbeats that notice dead or restarted producers.

NIXL reports a dead peer only when a transfer touches it. :class:`PeerMonitor` probes
each known producer's side channel every ``interval_s``: a reply with another
generation means the producer restarted; ``max_misses`` unanswered probes in a row
mean it is gone. Either way ``on_lost(address, reason)`` is called once, and the
consumer drops the peer (its agents, lists and handles) so the next request
re-handshakes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .errors import KvxferError, PeerLostError
from .side_channel import fetch_records

__all__ = ["PeerMonitor"]

log = logging.getLogger(__name__)


class PeerMonitor:
    """Background prober of producers' side channels.

    Args:
        compat_hash: the hash records must carry.
        interval_s: seconds between probes of one peer (also the probe timeout).
        on_lost: called with ``(address, reason)`` when a peer died or restarted.
        max_misses: unanswered probes in a row before a peer counts as dead.
    """

    def __init__(
        self,
        compat_hash: str,
        interval_s: float,
        on_lost: Callable[[str, str], None],
        max_misses: int = 3,
    ) -> None:
        self._hash = compat_hash
        self._interval_s = interval_s
        self._on_lost = on_lost
        self._max_misses = max_misses
        self._peers: dict[str, tuple[int, int]] = {}  # address -> (generation, misses)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, address: str, generation: int) -> None:
        """Start (or restart) watching ``address`` at ``generation``."""
        with self._lock:
            self._peers[address] = (generation, 0)

    def forget(self, address: str) -> None:
        with self._lock:
            self._peers.pop(address, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._interval_s * 2 + 1)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            with self._lock:
                peers = dict(self._peers)
            for address, (generation, misses) in peers.items():
                reason = self._probe(address, generation, misses)
                if reason is not None:
                    self.forget(address)
                    log.warning("peer %s lost: %s", address, reason)
                    self._on_lost(address, reason)

    def _probe(self, address: str, generation: int, misses: int) -> str | None:
        try:
            recs = fetch_records(address, [0], self._hash, self._interval_s)
        except PeerLostError:
            with self._lock:
                if address in self._peers:
                    self._peers[address] = (generation, misses + 1)
            if misses + 1 >= self._max_misses:
                return f"no heartbeat reply {misses + 1} times in a row"
            return None
        except KvxferError as e:
            return f"heartbeat refused: {e}"
        if recs and recs[0].generation != generation:
            return f"restarted: generation {generation:x} -> {recs[0].generation:x}"
        with self._lock:
            if address in self._peers:
                self._peers[address] = (generation, 0)
        return None
