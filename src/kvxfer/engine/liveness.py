"""Liveness of peers: side-channel heartbeats that notice dead or restarted producers,
and end watches that prove a producer process gone.

NIXL reports a dead peer only when a transfer touches it. :class:`PeerMonitor` probes
each known producer's side channel every ``interval_s``: a reply with another
generation means the producer restarted; a refused connection means nothing listens
there any more (the process exited or closed its side channel); ``max_misses``
unanswered probes in a row, over at least ``silence_s`` seconds without an answer, mean
it is gone or unreachable. A live producer can be silent for seconds: starved of CPU on
a busy host (measured here: a vLLM prefill sharing 2 cores with three decodes went 2.7 s
without serving its side channel during a first load), in a long GC or swap pause, or
while its container is throttled; three misses of a 1 s heartbeat dropped such live
producers, and every load waiting on them failed. ``silence_s`` is that tolerance: it
costs a hung producer's loads that much more time before they end PEER_LOST (still
bounded by their deadline), and nothing for dead ones, whose refused connection or new
generation is a verdict at the first probe. Each verdict calls
``on_lost(address, reason, generations)`` once (``generations``: what the verdict was
about, so a peer re-handshaken meanwhile, with other generations, is not dropped by a
verdict about its predecessor), and the consumer drops the peer (its agents, lists and
handles) so the next request re-handshakes.

Only the first two verdicts prove that the old process can no longer touch memory
(another process took its port, or none holds it); unanswered probes do not (a stopped
or partitioned process may go on). :meth:`PeerMonitor.watch_end` keeps probing the
endpoints of an incarnation that a push may still be writing from, after the heartbeat
gave up on it, until one of those proofs comes; ``on_gone(generations)`` is called with
the generations proven ended, by either kind of probe (the consumer then ends the
quarantine of pushes from them, see :class:`~kvxfer.engine.config.RequestState`).
A refused connection counts only for an endpoint on this host (its own kernel refused:
no process holds the port); another host's refusal may come from a firewall. A producer
on another host is proven gone only when its next incarnation answers at its endpoint;
until then a push from it stays quarantined up to its time bound.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from kvxfer.errors import AuthError, ClosedError, KvxferError, PeerLostError
from kvxfer.transport.side_client import fetch_push_failures, fetch_records
from kvxfer.wire import MAX_LEASE_IDS, PushFailure

__all__ = ["PeerMonitor", "listener_gone"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 0.5  # the refused-connection check (a refusal comes at once)


def listener_gone(endpoint: str, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """True when ``endpoint`` ("tcp://host:port") is on this host and a TCP connection to
    it is refused at every address its host resolves to (IPv4, as ZMQ connects it):
    nothing listens there, so the process that served it exited (or closed it). False
    when it connects or times out (alive, stopped or unreachable), for endpoints that
    are not TCP, and for other hosts: a refusal from another host may come from a
    firewall while the process behind it lives (this machine's own network rejects
    connections to unknown hosts that way), so it proves nothing."""
    if not endpoint.startswith("tcp://"):
        return False
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    bracketed = host.startswith("[")
    host = host.strip("[]")
    # ZMQ (IPv6 off) binds and connects names over IPv4 only: a name's IPv6 address
    # (many hosts files put "localhost" on ::1, often first) is not where it listens
    family = socket.AF_INET6 if bracketed else socket.AF_INET
    try:
        addrs = socket.getaddrinfo(host, int(port), family, socket.SOCK_STREAM)
        if not addrs:
            return False
        for fam, kind, proto, _, addr in addrs:  # every address must be local and refuse
            with socket.socket(fam, kind, proto) as probe:
                probe.bind((str(addr[0]), 0))  # succeeds only for an address of this host
            try:
                with socket.create_connection((str(addr[0]), int(addr[1])), timeout=timeout_s):
                    return False
            except ConnectionRefusedError:
                continue
        return True
    except (OSError, ValueError):
        return False


class PeerMonitor:
    """Background prober of producers' side channels.

    Args:
        compat_hash: the hash records must carry.
        interval_s: seconds between probes of one peer (also the probe timeout).
        on_lost: called with ``(address, reason, generations)`` when a peer died or
            restarted (``generations``: the ones that were watched).
        max_misses: unanswered probes in a row before a peer counts as dead.
        silence_s: and the least time without an answer from it (0: misses alone).
        on_gone: called with generations proven ended (their process exited or was
            replaced), from heartbeats and end watches alike.
        pending_pushes: ``(peer key, posted before)`` -> the attempts of pushes to it
            still waiting that were posted before that time (``time.perf_counter``: a
            heartbeat ago); after each answered probe, the endpoint is asked which of
            them it failed without being able to say so over NIXL
            (:class:`~kvxfer.wire.GetPushStatus`). An endpoint that refuses the question
            (an older kvxfer) is not asked again while it runs the same generations.
        on_push_failed: called with ``(key, failures)``: those of an endpoint's answer
            that name a rank and generation the same probe found serving there.

    Thread-safety: :meth:`watch`, :meth:`forget`, :meth:`watch_end` and :meth:`close`
    may be called from any thread; the probe thread owns the probing and never dies
    from one failed probe or callback. ``_peers`` and ``_ending`` are under ``_lock``.
    """

    def __init__(
        self,
        compat_hash: str,
        interval_s: float,
        on_lost: Callable[[str, str, set[int]], None],
        max_misses: int = 3,
        auth_key: bytes | None = None,
        on_gone: Callable[[set[int]], object] | None = None,
        silence_s: float = 0.0,
        pending_pushes: Callable[[str, float], tuple[int, ...]] | None = None,
        on_push_failed: Callable[[str, tuple[PushFailure, ...]], object] | None = None,
    ) -> None:
        self._hash = compat_hash
        self._pending_pushes = pending_pushes
        self._on_push_failed = on_push_failed
        self._no_push_status: dict[str, frozenset[int]] = {}  # endpoint -> its generations
        self._auth_key = auth_key
        self._interval_s = interval_s
        self._on_lost = on_lost
        self._on_gone = on_gone
        self._max_misses = max_misses
        self._silence_s = silence_s
        # peer key -> endpoint -> (generations served there, consecutive misses,
        # monotonic time of its last answer, or of the watch's start)
        self._peers: dict[str, dict[str, tuple[set[int], int, float]]] = {}
        # end watches: endpoint -> (generations not yet proven ended, monotonic give-up)
        self._ending: dict[str, tuple[set[int], float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, key: str, generations: dict[str, set[int]]) -> None:
        """Start (or restart) watching peer ``key``: per endpoint, the generations it serves."""
        with self._lock:
            now = time.monotonic()
            self._peers[key] = {ep: (set(g), 0, now) for ep, g in generations.items()}

    def forget(self, key: str) -> None:
        with self._lock:
            self._peers.pop(key, None)

    def watch_end(self, endpoint: str, generations: set[int], until: float) -> None:
        """Probe ``endpoint`` each interval until ``generations`` served there are proven
        ended (then ``on_gone``), or until the monotonic time ``until``."""
        with self._lock:
            gens, end = self._ending.get(endpoint, (set(), 0.0))
            self._ending[endpoint] = (gens | generations, max(end, until))

    @property
    def num_ending(self) -> int:
        with self._lock:
            return len(self._ending)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._interval_s * 2 + 1)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            with self._lock:
                peers = {k: dict(v) for k, v in self._peers.items()}
            for key, endpoints in peers.items():
                if self._stop.is_set():
                    return  # close() waits for this thread: one probe at most, not a round
                self._heartbeat(key, endpoints)
            self._watch_ends()

    def _heartbeat(self, key: str, endpoints: dict[str, tuple[set[int], int, float]]) -> None:
        watched = {g for gens, _, _ in endpoints.values() for g in gens}
        for ep, (gens, misses, heard) in endpoints.items():
            if self._stop.is_set():
                return
            gone = False
            try:
                reason, gone = self._probe(key, ep, gens, misses, heard)
            except Exception as e:  # the loop survives anything: a typed verdict
                reason = f"{ep}: heartbeat failed: {type(e).__name__}: {e}"
            if reason is None:
                continue
            with self._lock:  # forget only the watch this verdict is about
                now = self._peers.get(key)
                if now is not None and {g for gs, _, _ in now.values() for g in gs} == watched:
                    del self._peers[key]
            log.warning("peer %s lost: %s", key, reason)
            self._call(self._on_lost, key, reason, watched)
            if gone:
                self._call(self._on_gone, gens)
            return

    def _watch_ends(self) -> None:
        with self._lock:
            ending = dict(self._ending)
        now = time.monotonic()
        for ep, (gens, until) in ending.items():
            if self._stop.is_set():
                return
            ended: set[int] = set()
            if now < until:
                try:
                    ended = self._ended(ep, gens)
                except Exception as e:  # no proof; probed again next round
                    log.debug("end watch %s: %r", ep, e)
            with self._lock:
                left, end = self._ending.get(ep, (set(), 0.0))
                if now >= end or not left - ended:
                    self._ending.pop(ep, None)
                else:
                    self._ending[ep] = (left - ended, end)
            if ended:
                log.info("%s: generations %s ended (their process is gone)", ep, sorted(ended))
                self._call(self._on_gone, ended)

    def _ended(self, endpoint: str, gens: set[int]) -> set[int]:
        """Those of ``gens`` proven to run no more at ``endpoint``: all of them when
        nothing listens there, else those another generation replaced."""
        try:
            recs = fetch_records(
                endpoint, None, self._hash, self._interval_s, auth_key=self._auth_key,
                cancel=self._stop,
            )  # fmt: skip
        except PeerLostError:
            return set(gens) if listener_gone(endpoint) else set()
        except KvxferError:
            return set()  # it answered (refused us): no proof
        return gens - {r.generation for r in recs}

    @staticmethod
    def _call(fn: Callable[..., object] | None, *args: object) -> None:
        if fn is None:
            return
        try:
            fn(*args)
        except Exception as e:
            log.exception("%s%r failed: %s", getattr(fn, "__name__", fn), args[:1], e)

    def _probe(
        self, key: str, endpoint: str, gens: set[int], misses: int, heard: float
    ) -> tuple[str | None, bool]:
        """``(verdict or None, whether it proves the generations ended)``; ``heard``:
        when the endpoint last answered (monotonic)."""
        try:
            recs = fetch_records(
                endpoint, None, self._hash, self._interval_s, auth_key=self._auth_key,
                cancel=self._stop,
            )  # fmt: skip
        except (PeerLostError, AuthError) as e:
            # AuthError: refused as unauthorized, which a key holder's probe gets only if
            # an on-path party replayed it first or 1,024 later ones overtook it: a miss,
            # as silence is (a peer that refuses every probe is dropped like a silent one)
            if isinstance(e, PeerLostError) and listener_gone(endpoint):
                return f"{endpoint}: refuses connections (its process exited)", True
            with self._lock:
                if key in self._peers and endpoint in self._peers[key]:
                    self._peers[key][endpoint] = (gens, misses + 1, heard)
            silent = time.monotonic() - heard
            if misses + 1 >= self._max_misses and silent >= self._silence_s:
                why = f"; last refusal: {e}" if isinstance(e, AuthError) else ""
                return (
                    f"{endpoint}: no heartbeat reply {misses + 1} times in a row "
                    f"({silent:.1f} s without an answer{why})"
                ), False
            return None, False
        except ClosedError:
            return None, False  # close() cut the probe short: no verdict
        except KvxferError as e:
            return f"{endpoint}: heartbeat refused: {e}", False
        now = {r.generation for r in recs}
        if now != gens:
            return f"{endpoint} restarted: generation {sorted(gens)} -> {sorted(now)}", True
        now_s = time.monotonic()
        with self._lock:
            if key in self._peers and endpoint in self._peers[key]:
                self._peers[key][endpoint] = (gens, 0, now_s)
        if misses:  # what silence_s forgave: the measure an operator tunes it by
            log.info("peer %s: %s answered again after %d unanswered heartbeats "
                     "(%.1f s without an answer)", key, endpoint, misses, now_s - heard)  # fmt: skip
        try:  # optional: whatever goes wrong here is no verdict on a peer that answered
            self._ask_pushes(key, endpoint, {r.tp_rank: r.generation for r in recs})
        except Exception as e:
            log.warning("push status from %s failed: %r", endpoint, e)
        return None, False

    def _ask_pushes(self, key: str, endpoint: str, serving: dict[int, int]) -> None:
        """Ask ``endpoint`` (serving these ranks: their generations) which of the pushes
        still waiting on peer ``key`` it failed unannounced; report those of its ranks."""
        if self._pending_pushes is None or self._on_push_failed is None:
            return
        gens = frozenset(serving.values())
        if self._no_push_status.get(endpoint) == gens:
            return  # it refused the question (an older kvxfer)
        attempts = self._pending_pushes(key, time.perf_counter() - self._interval_s)
        if not attempts:
            return
        try:
            failed = fetch_push_failures(endpoint, attempts[:MAX_LEASE_IDS], self._interval_s,
                                         auth_key=self._auth_key, cancel=self._stop)  # fmt: skip
        except KvxferError as e:  # no answer now: asked again at the next heartbeat
            log.debug("push status from %s: %s", endpoint, e)
            return
        if failed is None:
            if len(self._no_push_status) >= 1024:
                self._no_push_status.clear()
            self._no_push_status[endpoint] = gens
            return
        ours = tuple(f for f in failed if serving.get(f.producer_rank) == f.generation)
        if ours:
            self._call(self._on_push_failed, key, ours)
