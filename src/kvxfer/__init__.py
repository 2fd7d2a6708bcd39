"""kvxfer: move paged KV caches between prefill and decode workers over NIXL.

The pure planning API (layouts, descriptors, TP plans, request plans) imports only
NumPy. The engine names (:class:`Producer`, :class:`Consumer`, ...) load NIXL and ZMQ
on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .descriptors import dense_rows, layout_rows, reference_rows, row_starts
from .errors import (
    DeadlineError,
    IncompatibleError,
    KvxferError,
    LayoutError,
    PeerLostError,
    ProtocolError,
    TransferError,
)
from .layout import CacheLayout, Region, Shard, TokenLayout, View, ViewKind
from .pairing import PeerPlan, SourcePlan, pair_layouts
from .plan import RequestPlan, SourceIds, plan_request
from .presets import PRESETS, spec_for
from .spec import AttnKind, LayoutSpec, StateSpec
from .tp import TpPlan, plan_tp

if TYPE_CHECKING:
    from .consumer import Consumer
    from .engine import EngineConfig, RequestState, allocate_cache
    from .producer import Producer
    from .transfer import PeerInfo, Transfer

__version__ = "0.1.0"

_LAZY = {
    "Consumer": "consumer",
    "EngineConfig": "engine",
    "PeerInfo": "transfer",
    "Producer": "producer",
    "RequestState": "engine",
    "Transfer": "transfer",
    "allocate_cache": "engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")


__all__ = [
    "PRESETS",
    "AttnKind",
    "CacheLayout",
    "Consumer",
    "DeadlineError",
    "EngineConfig",
    "IncompatibleError",
    "KvxferError",
    "LayoutError",
    "LayoutSpec",
    "PeerInfo",
    "PeerLostError",
    "PeerPlan",
    "Producer",
    "ProtocolError",
    "Region",
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
