"""One TP rank of an engine: its buffers registered with a transfer backend, and the
handshake records an engine serves."""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.engine.config import U8, Buffer, EngineConfig
from kvxfer.engine.holds import SLOT_BYTES, SLOT_WORDS
from kvxfer.errors import ConfigError, KvxferError, LayoutError, TransferError
from kvxfer.layout.buffers import host_view
from kvxfer.layout.model import CacheLayout, DeviceBuffer, MemKind, Region, single_place
from kvxfer.layout.spec import LayoutSpec
from kvxfer.transport.backend import BackendFactory, TransferBackend
from kvxfer.transport.nixl import NixlBackend, XferOp, XferState
from kvxfer.transport.side_channel import SideChannelServer
from kvxfer.wire import ModelFacts, encode_record, facts_json, record_from_layout

__all__ = ["RankCache", "close_each", "encode_records", "new_generation", "serve_records"]

log = logging.getLogger(__name__)
WARM_UP_BYTES = 64
WARM_UP_TIMEOUT_S = 2.0


class RankCache:
    """One TP rank of an engine: its spec, buffers, layout and registered NIXL agent.

    The buffers must outlive the rank; :meth:`close` deregisters them.
    ``backend_factory`` builds the agent from its name (default: a NixlBackend from
    ``config``; e.g. ``kvxfer.testing.MemoryBackend`` for in-process tests).
    ``words``: slots of :data:`~kvxfer.engine.holds.SLOT_BYTES` of DRAM registered
    beside the cache (:attr:`words`, one row a slot): a producer's hold table, a
    consumer's landing slots for hold checks (:mod:`kvxfer.engine.holds`); 0 for none.
    """

    def __init__(
        self,
        spec: LayoutSpec,
        bufs: Sequence[Buffer],
        agent_name: str,
        config: EngineConfig,
        backend_factory: BackendFactory | None = None,
        words: int = 0,
    ) -> None:
        sizes = spec.region_bytes()
        if len(bufs) != len(sizes) or any(b.nbytes != n for b, n in zip(bufs, sizes, strict=True)):
            raise LayoutError(f"buffers {[b.nbytes for b in bufs]} do not match regions {sizes}")
        self.spec = spec
        self.bufs = list(bufs)
        self.mem_kind, device = single_place(
            [(b.mem_kind, b.device_id) if isinstance(b, DeviceBuffer) else (MemKind.DRAM, 0)
             for b in bufs],
            f"rank {spec.tp_rank}: buffers",
        )  # fmt: skip
        self.layout: CacheLayout = spec.build(
            [b.addr if isinstance(b, DeviceBuffer) else b.ctypes.data for b in bufs],
            device_id=device, engine_id=config.engine_id, mem_kind=self.mem_kind,
        )  # fmt: skip
        self.backend: TransferBackend[Any, Any] = (
            backend_factory(agent_name)
            if backend_factory is not None
            else NixlBackend(
                agent_name,
                progress_delay_us=config.progress_delay_us,
                thread_safe=True,
                backend_params=dict(config.backend_params),
                auth_key=config.auth_key,
            )
        )
        if backend_factory is not None and getattr(self.backend, "auth_key", None) != (
            config.auth_key
        ):
            self.backend.close()
            raise ConfigError(
                f"rank {spec.tp_rank}: the backend from backend_factory does not carry the "
                "config's auth_key: its notifications would go unauthenticated (forged "
                "ReadDone, Abort, LeaseRenew, PushRequest obeyed); build it with "
                "auth_key=config.auth_key"
            )
        self.words: npt.NDArray[np.uint64] = np.zeros((words, SLOT_WORDS), np.uint64)
        self.words_list: Any = None  # the consumer's prepared list over words (lazily)
        self.word_cursor = 0
        self.words_busy: dict[int, float] = {}  # consumer: slot -> reusable after (monotonic)
        try:
            self.backend.register(
                [(r.base_addr, r.num_bytes, r.device_id) for r in self.layout.regions],
                self.mem_kind,
            )
            if words:
                self.backend.register([(self.words.ctypes.data, self.words.nbytes, 0)])
        except TransferError as e:
            err = TransferError(
                f"rank {spec.tp_rank}: registering {len(sizes)} {self.mem_kind.value} regions "
                f"on device {device}: {e}"
            )
            close_after_failed_start(self.backend.close, err, f"agent {agent_name}")
            raise err from e
        except BaseException as e:
            close_after_failed_start(self.backend.close, e, f"agent {agent_name}")
            raise

    def words_list_ready(self) -> Any:
        """The prepared local list over :attr:`words` (one strided row; made on first
        use). The caller holds the engine lock."""
        if self.words_list is None and len(self.words):
            row = np.array(
                [[self.words.ctypes.data, SLOT_BYTES, 0, SLOT_BYTES, len(self.words)]], np.uint64
            )
            self.words_list = self.backend.prepare(row)
        return self.words_list

    def next_word(self) -> int:
        """A slot of :attr:`words` for one hold check (zeroed; under the engine lock),
        round-robin, never one in use: taken and not given back by :meth:`free_word`
        (its check not judged yet, or released while its READ may still land).

        Raises:
            TransferError: every slot is in use.
        """
        n, now = len(self.words), time.monotonic()
        for k in range(n):
            i = (self.word_cursor + k) % n
            until = self.words_busy.get(i)
            if until is None or until <= now:
                self.words_busy[i] = math.inf
                self.word_cursor = (i + 1) % n
                self.words[i] = 0
                return i
        raise TransferError(f"all {n} hold-check slots are in use: too many checks in flight")

    def free_word(self, i: int, quarantine_s: float = 0.0) -> None:
        """Give slot ``i`` back: at once (its READ completed), or after ``quarantine_s``
        (its READ was released in flight and may still land)."""
        if quarantine_s > 0:
            self.words_busy[i] = time.monotonic() + quarantine_s
        else:
            self.words_busy.pop(i, None)

    def host_bufs(self) -> list[U8]:
        """The buffers as NumPy arrays, for host-side work (relayout after a transfer);
        DRAM given by address (a DRAM :class:`DeviceBuffer`) is viewed in place.

        Raises:
            ConfigError: the cache is device memory (VRAM).
        """
        if self.mem_kind is not MemKind.DRAM:
            raise ConfigError(
                f"rank {self.rank}: its cache is device memory ({self.mem_kind.value}); "
                "this needs host buffers"
            )
        return [
            host_view(b.addr, b.nbytes) if isinstance(b, DeviceBuffer) else b for b in self.bufs
        ]

    @property
    def rank(self) -> int:
        return self.spec.tp_rank

    def _warm_region(self) -> Region | None:
        """The first region, when this rank's transport is NIXL and it is DRAM large enough
        for a warm-up transfer; else None (e.g. the in-memory backend: nothing to warm)."""
        if not isinstance(self.backend, NixlBackend):
            return None
        region = self.layout.regions[0]
        if region.mem_kind is not MemKind.DRAM or region.num_bytes < WARM_UP_BYTES:
            return None
        return region

    def warm_up_transport(self, config: EngineConfig) -> None:
        """Pay the transport's one-time costs now instead of in the first request.

        UCX sets an agent up lazily on its first peer and first transfer (measured: a
        consumer's first ``add_remote`` 18 ms and its first notification 5 ms, vs 3.5 ms
        and 0.1 ms for its next peers). Against a throwaway loopback agent this adds it,
        WRITEs ``WARM_UP_BYTES`` of our own first region into its scratch buffer (our
        memory is only read), sends it one notification and removes it. A failure
        only costs the first request that time again: logged, never raised. A backend
        other than NIXL (e.g. the in-memory one) has nothing to warm.
        """
        region = self._warm_region()
        if region is None:
            return
        t0 = time.perf_counter()
        scratch = np.zeros(WARM_UP_BYTES, np.uint8)
        probe = NixlBackend(f"{self.backend.name}-warm-up", thread_safe=True,
                            backend_params=dict(config.backend_params))  # fmt: skip
        try:
            probe.register([(scratch.ctypes.data, scratch.nbytes, 0)])
            name = self.backend.add_remote(probe.metadata())
            try:
                own = (region.base_addr, WARM_UP_BYTES, region.device_id)
                _one_transfer(self.backend, XferOp.WRITE, own, (scratch.ctypes.data,
                              WARM_UP_BYTES, 0), name)  # fmt: skip
                self.backend.send_notif(name, b"kvxfer warm-up")
            finally:
                self.backend.remove_remote(name)  # releases the lists made for it
        except KvxferError as e:
            log.debug("%s: transport warm-up skipped: %s", self.backend.name, e)
        finally:
            probe.close()
        log.debug("%s: transport warmed up in %.1f ms", self.backend.name,
                  (time.perf_counter() - t0) * 1e3)  # fmt: skip

    def warm_up_incoming(self, config: EngineConfig, metadata: bytes) -> None:
        """Pay a producer's one-time cost of its first incoming peer now.

        A producer's UCX worker selects its protocols for a new kind of endpoint when
        it accepts its first connection; the first READ from a fresh producer process
        paid that (measured between processes here: 16-21 ms, then 1-2 ms). A throwaway
        agent of our own loads ``metadata`` (this rank's) and READs ``WARM_UP_BYTES`` of
        the first region (never writes there), then closes. Only the probe agent is
        used, so this may run in a background thread while the producer serves. Errors
        are logged, never raised.
        """
        region = self._warm_region()
        if region is None:
            return
        t0 = time.perf_counter()
        scratch = np.zeros(WARM_UP_BYTES, np.uint8)
        probe = NixlBackend(f"{self.backend.name}-warm-up-in",
                            backend_params=dict(config.backend_params))  # fmt: skip
        try:
            probe.register([(scratch.ctypes.data, scratch.nbytes, 0)])
            name = probe.add_remote(metadata)
            theirs = (region.base_addr, WARM_UP_BYTES, region.device_id)
            _one_transfer(probe, XferOp.READ, (scratch.ctypes.data, WARM_UP_BYTES, 0),
                          theirs, name)  # fmt: skip
        except KvxferError as e:
            log.debug("%s: incoming warm-up skipped: %s", self.backend.name, e)
        finally:
            probe.close()  # drops its connection to us and its lists
        log.debug("%s: incoming warmed up in %.1f ms", self.backend.name,
                  (time.perf_counter() - t0) * 1e3)  # fmt: skip

    def close(self) -> None:
        self.backend.close()


def close_each(caches: dict[int, RankCache], errors: list[Exception]) -> dict[int, RankCache]:
    """Close every cache; return those whose close raised (their errors appended to
    ``errors``), so that a later close() can try them again."""
    left = {}
    for key, cache in caches.items():
        try:
            cache.close()
        except Exception as e:
            errors.append(e)
            left[key] = cache
    return left


def close_after_failed_start(close: Callable[[], None], error: BaseException, what: str) -> None:
    """After ``error`` stopped ``what``'s constructor, close what it had built. A failure
    of that close is logged and added to ``error`` as a note, so the error users see
    still names why construction failed (before, the close error replaced it)."""
    try:
        close()
    except Exception as e:
        log.warning("%s: closing it after a failed start also failed: %r", what, e)
        error.add_note(
            f"closing the half-built {what} then failed too ({type(e).__name__}: {e}); "
            "what it could not close stays open until the process exits"
        )


def _one_transfer(
    backend: TransferBackend[Any, Any],
    op: XferOp,
    local: tuple[int, int, int],
    remote: tuple[int, int, int],
    remote_name: str,
) -> None:
    """One small transfer ``(addr, nbytes, device)`` <-> the same on ``remote_name``,
    waited for up to ``WARM_UP_TIMEOUT_S`` (a warm-up: its result does not matter)."""
    loc = backend.prepare(np.array([local], np.uint64), strided=False)
    rem = backend.prepare(np.array([remote], np.uint64), remote_name, strided=False)
    one = np.zeros(1, np.int64)
    x = backend.make_xfer(op, loc, one, rem, one)
    state, end = backend.post(x), time.monotonic() + WARM_UP_TIMEOUT_S
    while state is XferState.IN_PROGRESS and time.monotonic() < end:
        time.sleep(0.0002)
        state = backend.poll(x)
    backend.release(x)


def new_generation() -> int:
    """A random 63-bit id for one process incarnation of an engine."""
    return secrets.randbits(63) ^ (os.getpid() << 20) or 1


def encode_records(
    caches: Iterable[RankCache], generation: int, compat_hash: str, *, holds: bool = False
) -> dict[int, bytes]:
    """The handshake records an engine serves on its side channel, by TP rank (with
    ``holds``: each rank's :attr:`RankCache.words` published as its hold table)."""

    def table(c: RankCache) -> tuple[int, int]:
        return (c.words.ctypes.data, len(c.words)) if holds and len(c.words) else (0, 0)

    return {
        c.rank: encode_record(
            record_from_layout(
                c.layout,
                agent_name=c.backend.name,
                agent_metadata=c.backend.metadata(),
                generation=generation,
                hold_table=table(c),
            ),
            compat_hash,
        )
        for c in caches
    }


def serve_records(
    config: EngineConfig, records: dict[int, bytes], facts: ModelFacts | None = None
) -> SideChannelServer:
    """Start the side channel an engine serves its records on (bound to
    ``config.side_channel_addr``, authenticated with ``config.auth_key`` when set;
    ``facts``: the engine's model facts, named to a peer whose hash differs)."""
    return SideChannelServer(
        config.side_channel_addr, records, auth_key=config.auth_key, identity=config.engine_id,
        facts="" if facts is None else facts_json(facts),
    ).start()  # fmt: skip
