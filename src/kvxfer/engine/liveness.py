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

from kvxfer.errors import KvxferError, PeerLostError
from kvxfer.transport.side_channel import fetch_records

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
        # peer key -> endpoint -> (generations served there, consecutive misses)
        self._peers: dict[str, dict[str, tuple[set[int], int]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, key: str, generations: dict[str, set[int]]) -> None:
        """Start (or restart) watching peer ``key``: per endpoint, the generations it serves."""
        with self._lock:
            self._peers[key] = {ep: (set(g), 0) for ep, g in generations.items()}

    def forget(self, key: str) -> None:
        with self._lock:
            self._peers.pop(key, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._interval_s * 2 + 1)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            with self._lock:
                peers = {k: dict(v) for k, v in self._peers.items()}
            for key, endpoints in peers.items():
                for ep, (gens, misses) in endpoints.items():
                    reason = self._probe(key, ep, gens, misses)
                    if reason is not None:
                        self.forget(key)
                        log.warning("peer %s lost: %s", key, reason)
                        self._on_lost(key, reason)
                        break

    def _probe(self, key: str, endpoint: str, gens: set[int], misses: int) -> str | None:
        try:
            recs = fetch_records(endpoint, None, self._hash, self._interval_s)
        except PeerLostError:
            with self._lock:
                if key in self._peers and endpoint in self._peers[key]:
                    self._peers[key][endpoint] = (gens, misses + 1)
            if misses + 1 >= self._max_misses:
                return f"{endpoint}: no heartbeat reply {misses + 1} times in a row"
            return None
        except KvxferError as e:
            return f"{endpoint}: heartbeat refused: {e}"
        now = {r.generation for r in recs}
        if now != gens:
            return f"{endpoint} restarted: generation {sorted(gens)} -> {sorted(now)}"
        with self._lock:
            if key in self._peers and endpoint in self._peers[key]:
                self._peers[key][endpoint] = (gens, 0)
        return None
