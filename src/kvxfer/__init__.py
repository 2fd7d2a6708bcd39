"""kvxfer: move paged KV caches between prefill and decode workers over NIXL.

The pure planning API (layouts, descriptors, TP plans, request plans) imports only
NumPy. The engine names (:class:`Producer`, :class:`Consumer`, ...) load NIXL and ZMQ
on first use; without NIXL installed they raise :class:`BackendUnavailableError`
naming the install line.

The library never configures logging: it logs to the ``kvxfer`` logger, which has only a
``NullHandler`` (the ``kvxfer`` command configures a handler).
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from kvxfer.errors import (
    AuthError,
    BackendUnavailableError,
    CancelledError,
    ClosedError,
    ConfigError,
    DeadlineError,
    HoldEndedError,
    IncompatibleError,
    InputError,
    KvxferError,
    LayoutError,
    LeaseExpiredError,
    PeerLostError,
    ProtocolError,
    TransferError,
    WaitTimeout,
)
from kvxfer.layout.model import (
    CacheLayout,
    DeviceBuffer,
    MemKind,
    Region,
    Shard,
    TokenLayout,
    View,
    ViewKind,
)
from kvxfer.layout.presets import PRESETS, spec_for
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec
from kvxfer.planning.descriptors import dense_rows, layout_rows, reference_rows, row_starts
from kvxfer.planning.pairing import pair_layouts
from kvxfer.planning.plans import PeerPlan, SourcePlan
from kvxfer.planning.request import RequestIds, RequestPlan, SourceIds, plan_request
from kvxfer.planning.tp import TpPlan, plan_tp

if TYPE_CHECKING:
    from kvxfer.engine.config import EngineConfig, RequestState, allocate_cache
    from kvxfer.engine.consumer import Consumer
    from kvxfer.engine.peer import PeerInfo
    from kvxfer.engine.producer import Producer
    from kvxfer.engine.transfer import Transfer

try:
    __version__ = version("kvxfer")  # single source: pyproject.toml's version
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

logging.getLogger(__name__).addHandler(logging.NullHandler())

_LAZY = {
    "Consumer": "kvxfer.engine.consumer",
    "EngineConfig": "kvxfer.engine.config",
    "PeerInfo": "kvxfer.engine.peer",
    "Producer": "kvxfer.engine.producer",
    "RequestState": "kvxfer.engine.config",
    "Transfer": "kvxfer.engine.transfer",
    "allocate_cache": "kvxfer.engine.config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")


__all__ = [
    "PRESETS",
    "AttnKind",
    "AuthError",
    "BackendUnavailableError",
    "CacheLayout",
    "CancelledError",
    "ClosedError",
    "ConfigError",
    "Consumer",
    "DeadlineError",
    "DeviceBuffer",
    "EngineConfig",
    "HoldEndedError",
    "IncompatibleError",
    "InputError",
    "KvxferError",
    "LayoutError",
    "LayoutSpec",
    "LeaseExpiredError",
    "MemKind",
    "PeerInfo",
    "PeerLostError",
    "PeerPlan",
    "Producer",
    "ProtocolError",
    "Region",
    "RequestIds",
    "RequestPlan",
    "RequestState",
    "Shard",
    "SourceIds",
    "SourcePlan",
    "StateSpec",
    "TokenLayout",
    "TpPlan",
    "Transfer",
    "TransferError",
    "View",
    "ViewKind",
    "WaitTimeout",
    "allocate_cache",
    "dense_rows",
    "layout_rows",
    "pair_layouts",
    "plan_request",
    "plan_tp",
    "reference_rows",
    "row_starts",
    "spec_for",
]
