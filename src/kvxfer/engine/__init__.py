"""Engine layer (I/O): producers and consumers over a transfer backend.

:class:`EngineConfig`, :class:`RequestState` and :func:`allocate_cache` are plain values
and import nothing heavy; :class:`Producer`, :class:`Consumer`, :class:`Transfer` and
:class:`PeerInfo` load NIXL and ZMQ on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvxfer.engine.config import EngineConfig, RequestState, allocate_cache

if TYPE_CHECKING:
    from kvxfer.engine.consumer import Consumer
    from kvxfer.engine.peer import PeerInfo
    from kvxfer.engine.producer import Producer
    from kvxfer.engine.transfer import Transfer

_LAZY = {
    "Consumer": "kvxfer.engine.consumer",
    "EngineStats": "kvxfer.engine.stats",
    "as_completed": "kvxfer.engine.waiting",
    "wait_any": "kvxfer.engine.waiting",
    "PeerInfo": "kvxfer.engine.peer",
    "Producer": "kvxfer.engine.producer",
    "Transfer": "kvxfer.engine.transfer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvxfer.engine' has no attribute {name!r}")


__all__ = [
    "Consumer",
    "EngineConfig",
    "EngineStats",
    "PeerInfo",
    "Producer",
    "RequestState",
    "Transfer",
    "allocate_cache",
    "as_completed",
    "wait_any",
]
