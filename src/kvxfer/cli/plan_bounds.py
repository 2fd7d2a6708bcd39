"""Bounds of a plan file, checked before anything is built (pure).

``kvxfer plan`` reads files anyone may hand it. Every size is checked against the
bounds the wire uses for peer records (:mod:`kvxfer.wire.limits`) *before* a region,
view or array is allocated, and the file itself is bounded:

- the file: at most :data:`MAX_PLAN_FILE_BYTES`; JSON nested too deeply or integers
  longer than 20 digits become one-line errors naming the field (:func:`loads_json`);
- every int field: within its wire type (``SmallInt`` <= 2**32, ``Count``, ``U64``,
  block ids <= 2**40);
- a spec shorthand: regions <= ``MAX_REGIONS``, views <= ``MAX_VIEWS``, blocks per
  view <= ``MAX_COUNT``, descriptors <= ``MAX_DESCRIPTORS``, computed from its fields
  (:func:`check_spec_sizes`); a remote spec expands to at most ``MAX_RANKS`` ranks and
  ``MAX_VIEWS`` views in all.
"""

from __future__ import annotations

import json
from typing import Any

from kvxfer.errors import LayoutError
from kvxfer.layout.spec import AttnKind, LayoutSpec
from kvxfer.wire.limits import (
    MAX_COUNT,
    MAX_DESCRIPTORS,
    MAX_RANKS,
    MAX_RECORD_BYTES,
    MAX_REGIONS,
    MAX_VIEWS,
)

__all__ = ["MAX_PLAN_FILE_BYTES", "BigInt", "check_spec_sizes", "loads_json", "spec_counts"]

MAX_PLAN_FILE_BYTES = MAX_RECORD_BYTES // 4  # 4 MiB: a few records and a request
_MAX_DIGITS = 20  # 2**64 - 1 has 20 digits; longer integers are never valid here


class BigInt:
    """An integer literal too long to be any field: kept as its digit count, never converted."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"integer of {self.digits} digits"


def _parse_int(text: str) -> int | BigInt:
    digits = len(text.lstrip("-"))
    return BigInt(digits) if digits > _MAX_DIGITS else int(text)


def loads_json(text: str, where: str) -> Any:
    """``json.loads`` with long integers kept as :class:`BigInt` and deep nesting refused.

    Raises:
        LayoutError: invalid JSON, or nested deeper than the parser's recursion limit.
    """
    try:
        return json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        raise LayoutError(
            f"{where}: invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise LayoutError(f"{where}: invalid JSON: nested too deeply") from None


def spec_counts(spec: LayoutSpec) -> tuple[int, int, int]:
    """``(regions, views, descriptors)`` that ``spec.build`` would make, by arithmetic only."""
    layers, st = spec.num_layers, spec.state
    kernel_blocks = spec.num_blocks * spec.ppl
    if st is not None:
        regions = max(layers, st.num_layers)
        attn_views = 2 * layers
    else:
        regions = {
            AttnKind.SPLIT_KV: 2 * layers,
            AttnKind.BLOCKS_FIRST: layers,
            AttnKind.PACKED: layers,
            AttnKind.MLA: layers,
            AttnKind.CROSS_LAYER: 1,
        }[spec.kind]
        attn_views = {AttnKind.SPLIT_KV: 2, AttnKind.BLOCKS_FIRST: 2}.get(spec.kind, 1) * layers
        if spec.kind is AttnKind.CROSS_LAYER:
            attn_views = 1
    state_views = st.num_layers * (len(st.conv_cols) + 1) if st is not None else 0
    descriptors = attn_views * kernel_blocks + state_views * spec.num_blocks
    return regions, attn_views + state_views, descriptors


def check_spec_sizes(spec: LayoutSpec, path: str, num_ranks: int = 1) -> None:
    """Refuse a spec (expanded to ``num_ranks`` ranks) past the wire's bounds, naming ``path``."""
    if num_ranks > MAX_RANKS:
        raise LayoutError(f"{path}.tp_size: {num_ranks} ranks exceed the limit of {MAX_RANKS}")
    regions, views, descriptors = spec_counts(spec)
    if spec.num_blocks * spec.ppl > MAX_COUNT:
        raise LayoutError(
            f"{path}: num_blocks {spec.num_blocks} x ppl {spec.ppl} kernel blocks exceed the "
            f"limit of {MAX_COUNT}"
        )
    if regions > MAX_REGIONS:
        raise LayoutError(f"{path}.num_layers: {regions} regions exceed the limit of {MAX_REGIONS}")
    if views * num_ranks > MAX_VIEWS:
        raise LayoutError(
            f"{path}: {views} views x {num_ranks} ranks exceed the limit of {MAX_VIEWS} views"
        )
    if descriptors > MAX_DESCRIPTORS:
        raise LayoutError(
            f"{path}: {descriptors} descriptors exceed the limit of {MAX_DESCRIPTORS}"
        )
