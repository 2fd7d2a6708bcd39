"""One TP rank of an engine: its buffers registered with a transfer backend, and the
handshake records an engine serves."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

from kvxfer.engine.config import U8, EngineConfig
from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout
from kvxfer.layout.spec import LayoutSpec
from kvxfer.transport.backend import BackendFactory, TransferBackend
from kvxfer.transport.nixl import NixlBackend
from kvxfer.transport.side_channel import SideChannelServer
from kvxfer.wire import encode_record, record_from_layout

__all__ = ["RankCache", "encode_records", "new_generation", "serve_records"]


class RankCache:
    """One TP rank of an engine: its spec, buffers, layout and registered NIXL agent.

    The buffers must outlive the rank; :meth:`close` deregisters them.
    ``backend_factory`` builds the agent from its name (default: a NixlBackend from
    ``config``; e.g. ``kvxfer.testing.MemoryBackend`` for in-process tests).
    """

    def __init__(
        self,
        spec: LayoutSpec,
        bufs: Sequence[U8],
        agent_name: str,
        config: EngineConfig,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        sizes = spec.region_bytes()
        if len(bufs) != len(sizes) or any(b.nbytes != n for b, n in zip(bufs, sizes, strict=True)):
            raise LayoutError(f"buffers {[b.nbytes for b in bufs]} do not match regions {sizes}")
        self.spec = spec
        self.bufs = list(bufs)
        self.layout: CacheLayout = spec.build(
            [b.ctypes.data for b in bufs], engine_id=config.engine_id
        )
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
        try:
            self.backend.register(
                [(r.base_addr, r.num_bytes, r.device_id) for r in self.layout.regions]
            )
        except BaseException:
            self.backend.close()
            raise

    @property
    def rank(self) -> int:
        return self.spec.tp_rank

    def close(self) -> None:
        self.backend.close()


def new_generation() -> int:
    """A random 63-bit id for one process incarnation of an engine."""
    return secrets.randbits(63) ^ (os.getpid() << 20) or 1


def encode_records(
    caches: Iterable[RankCache], generation: int, compat_hash: str
) -> dict[int, bytes]:
    """The handshake records an engine serves on its side channel, by TP rank."""
    return {
        c.rank: encode_record(
            record_from_layout(
                c.layout,
                agent_name=c.backend.name,
                agent_metadata=c.backend.metadata(),
                generation=generation,
            ),
            compat_hash,
        )
        for c in caches
    }


def serve_records(config: EngineConfig, records: dict[int, bytes]) -> SideChannelServer:
    """Start the side channel an engine serves its records on (bound to
    ``config.side_channel_addr``, authenticated with ``config.auth_key`` when set)."""
    return SideChannelServer(
        config.side_channel_addr, records, auth_key=config.auth_key, identity=config.engine_id
    ).start()
