"""Liveness of idle peers: side-channel heartbeats that notice dead or restarted producers.

NIXL reports a dead peer only when a transfer touches it. :class:`PeerMonitor` probes
each known producer's side channel every ``interval_s``: a reply with another
generation means the producer restarted; ``max_misses`` unanswered probes in a row
mean it is gone. Either way ``on_lost(address, reason, generations)`` is called once
(``generations``: what the verdict was about, so a peer re-handshaken meanwhile, with
other generations, is not dropped by a verdict about its predecessor), and the
consumer drops the peer (its agents, lists and handles) so the next request
re-handshakes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvxfer.errors import KvxferError, PeerLostError
from kvxfer.transport.side_client import fetch_records

__all__ = ["PeerMonitor"]

log = logging.getLogger(__name__)


class PeerMonitor:
    """Background prober of producers' side channels.

    Args:
        compat_hash: the hash records must carry.
        interval_s: seconds between probes of one peer (also the probe timeout).
        on_lost: called with ``(address, reason, generations)`` when a peer died or
            restarted (``generations``: the ones that were watched).

    Thread-safety: :meth:`watch`, :meth:`forget` and :meth:`close` may be called from
    any thread; the probe thread never dies from one failed probe.
        max_misses: unanswered probes in a row before a peer counts as dead.
    """

    def __init__(
        self,
        compat_hash: str,
        interval_s: float,
        on_lost: Callable[[str, str, set[int]], None],
        max_misses: int = 3,
        auth_key: bytes | None = None,
    ) -> None:
        self._hash = compat_hash
        self._auth_key = auth_key
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
                watched = {g for gens, _ in endpoints.values() for g in gens}
                for ep, (gens, misses) in endpoints.items():
                    try:
                        reason = self._probe(key, ep, gens, misses)
                    except Exception as e:  # the loop survives anything: a typed verdict
                        reason = f"{ep}: heartbeat failed: {type(e).__name__}: {e}"
                    if reason is not None:
                        with self._lock:  # forget only the watch this verdict is about
                            now = self._peers.get(key)
                            if (
                                now is not None
                                and {g for gs, _ in now.values() for g in gs} == watched
                            ):
                                del self._peers[key]
                        log.warning("peer %s lost: %s", key, reason)
                        try:
                            self._on_lost(key, reason, watched)
                        except Exception as e:
                            log.exception("on_lost(%s) failed: %s", key, e)
                        break

    def _probe(self, key: str, endpoint: str, gens: set[int], misses: int) -> str | None:
        try:
            recs = fetch_records(
                endpoint, None, self._hash, self._interval_s, auth_key=self._auth_key
            )
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
