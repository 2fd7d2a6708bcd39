"""kvxfer: move paged KV caches between prefill and decode workers over NIXL."""

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
from .spec import AttnKind, LayoutSpec, StateSpec

__version__ = "0.1.0"

__all__ = [
    "AttnKind",
    "CacheLayout",
    "DeadlineError",
    "IncompatibleError",
    "KvxferError",
    "LayoutError",
    "LayoutSpec",
    "PeerLostError",
    "ProtocolError",
    "Region",
    "Shard",
    "StateSpec",
    "TokenLayout",
    "TransferError",
    "View",
    "ViewKind",
]
