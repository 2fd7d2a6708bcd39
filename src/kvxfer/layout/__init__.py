"""Layout layer (pure): regions, views, cache layouts, layout specs, model presets and
constructors from engine tensors. Imports only NumPy (torch lazily, where asked)."""

from kvxfer.layout.model import CacheLayout, Region, Shard, TokenLayout, View, ViewKind
from kvxfer.layout.presets import PRESETS, spec_for
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec

__all__ = [
    "PRESETS",
    "AttnKind",
    "CacheLayout",
    "LayoutSpec",
    "Region",
    "Shard",
    "StateSpec",
    "TokenLayout",
    "View",
    "ViewKind",
    "spec_for",
]
