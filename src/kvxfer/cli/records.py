"""Plan input files: JSON/TOML dicts -> :class:`~kvxfer.layout.model.CacheLayout` values (pure).

The format is documented in ``docs/plan-input.md``. Every missing or mistyped field
raises :class:`~kvxfer.errors.LayoutError` whose message starts with the JSON path of
the field, e.g. ``remote[1].views[3].stride: expected int, got "x"``.

A side is either an explicit record (the field names of :class:`CacheLayout`,
:class:`Region` and :class:`View`) or a spec shorthand ``{"spec": {...}, "base_addr": N}``
whose regions are laid out back to back: region 0 at ``base_addr``, each next region at
the previous end rounded up to :data:`REGION_ALIGN`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer._intmath import ceil_div
from kvxfer.cli.json_fields import (
    as_list,
    as_object,
    bool_field,
    check_keys,
    enum_field,
    get_field,
    int_field,
    int_list_field,
    str_field,
)
from kvxfer.cli.plan_bounds import check_spec_sizes
from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout, Region, Shard, TokenLayout, View, ViewKind
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec
from kvxfer.planning.pairing import tp_plan_of
from kvxfer.wire.limits import (
    MAX_BLOCK_ID,
    MAX_COUNT,
    MAX_DESCRIPTORS,
    MAX_RANKS,
    MAX_REGIONS,
    MAX_SMALL_INT,
    MAX_VIEWS,
)

__all__ = [
    "DEFAULT_BASE_ADDR",
    "REGION_ALIGN",
    "PlanInput",
    "RequestInput",
    "load_plan_input",
    "pack_regions",
    "parse_engine",
    "parse_side",
]

REGION_ALIGN = 1 << 20  # 1 MiB between regions of a spec shorthand
DEFAULT_BASE_ADDR = 1 << 32  # base_addr of a spec shorthand that gives none


@dataclass(frozen=True, slots=True)
class RequestInput:
    """The optional ``request`` object: logical block ids (lists of ints) on each side."""

    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    local_state_ids: tuple[int, ...] | None = None
    remote_state_ids: tuple[int, ...] | None = None
    num_cached_blocks: int = 0


@dataclass(frozen=True, slots=True)
class PlanInput:
    """A whole plan file: this rank's layout, the remote engine's rank layouts, a request."""

    local: CacheLayout
    remotes: dict[int, CacheLayout]  # remote tp_rank -> layout, ascending
    request: RequestInput | None


# --- field readers: each names the JSON path of what it rejects -------------------------


def _checked(path: str, build: Callable[[], CacheLayout]) -> CacheLayout:
    """Run a layout constructor, prefixing its LayoutError with ``path``."""
    try:
        return build()
    except LayoutError as exc:
        raise LayoutError(f"{path}: {exc}") from None


# --- explicit records ------------------------------------------------------------------

_REGION_KEYS = ("base_addr", "num_bytes", "device_id", "name")
_VIEW_KEYS = ("region", "offset", "length", "stride", "count", "kind", "shard", "name")
_RECORD_KEYS = (
    "regions", "views", "block_size", "num_kv_heads", "head_dim", "dtype_bytes", "tp_rank",
    "tp_size", "token_layout", "ppl", "is_mla", "is_cross_layer", "engine_id",
)  # fmt: skip


def _region(value: object, path: str) -> Region:
    obj = as_object(value, path)
    check_keys(obj, _REGION_KEYS, path)
    return Region(
        base_addr=int_field(obj, "base_addr", path),
        num_bytes=int_field(obj, "num_bytes", path),
        device_id=int_field(obj, "device_id", path, 0, MAX_SMALL_INT),
        name=str_field(obj, "name", path),
    )


def _view(value: object, path: str) -> View:
    obj = as_object(value, path)
    check_keys(obj, _VIEW_KEYS, path)
    return View(
        region=int_field(obj, "region", path, hi=MAX_REGIONS),
        offset=int_field(obj, "offset", path),
        length=int_field(obj, "length", path),
        stride=int_field(obj, "stride", path),
        count=int_field(obj, "count", path, hi=MAX_COUNT),
        kind=enum_field(obj, "kind", path, ViewKind, ViewKind.ATTN),
        shard=enum_field(obj, "shard", path, Shard, Shard.HEADS),
        name=str_field(obj, "name", path),
    )


def _record(obj: Mapping[str, Any], path: str) -> CacheLayout:
    check_keys(obj, _RECORD_KEYS, path)
    regions = as_list(get_field(obj, "regions", path), f"{path}.regions")
    views = as_list(get_field(obj, "views", path), f"{path}.views")
    for what, items, limit in (("regions", regions, MAX_REGIONS), ("views", views, MAX_VIEWS)):
        if len(items) > limit:
            raise LayoutError(f"{path}.{what}: {len(items)} {what} exceed the limit of {limit}")
    region_list = tuple(_region(r, f"{path}.regions[{i}]") for i, r in enumerate(regions))
    view_list = tuple(_view(v, f"{path}.views[{i}]") for i, v in enumerate(views))
    total = sum(v.count for v in view_list)
    if total > MAX_DESCRIPTORS:
        raise LayoutError(
            f"{path}.views: {total} descriptors in all exceed the limit of {MAX_DESCRIPTORS}"
        )
    small = MAX_SMALL_INT
    block_size = int_field(obj, "block_size", path, hi=small)
    num_kv_heads = int_field(obj, "num_kv_heads", path, hi=small)
    head_dim = int_field(obj, "head_dim", path, hi=small)
    dtype_bytes = int_field(obj, "dtype_bytes", path, hi=small)
    tp_rank = int_field(obj, "tp_rank", path, 0, small)
    tp_size = int_field(obj, "tp_size", path, 1, small)
    token_layout = enum_field(obj, "token_layout", path, TokenLayout, TokenLayout.HND)
    ppl = int_field(obj, "ppl", path, 1, small)
    is_mla = bool_field(obj, "is_mla", path, False)
    is_cross_layer = bool_field(obj, "is_cross_layer", path, False)
    engine_id = str_field(obj, "engine_id", path)
    return _checked(
        path,
        lambda: CacheLayout(
            regions=region_list,
            views=view_list,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype_bytes=dtype_bytes,
            tp_rank=tp_rank,
            tp_size=tp_size,
            token_layout=token_layout,
            ppl=ppl,
            is_mla=is_mla,
            is_cross_layer=is_cross_layer,
            engine_id=engine_id,
        ),
    )


# --- spec shorthand --------------------------------------------------------------------

_SHORTHAND_KEYS = ("spec", "base_addr", "device_id", "engine_id")
_SPEC_KEYS = (
    "kind", "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype_bytes",
    "tp_rank", "tp_size", "token_layout", "ppl", "state",
)  # fmt: skip
_STATE_KEYS = ("num_layers", "conv_cols", "conv_kernel", "ssm_bytes")


def _state(value: object, path: str) -> StateSpec | None:
    if value is None:
        return None
    obj = as_object(value, path)
    check_keys(obj, _STATE_KEYS, path)
    return StateSpec(
        num_layers=int_field(obj, "num_layers", path, hi=MAX_SMALL_INT),
        conv_cols=int_list_field(obj, "conv_cols", path, MAX_SMALL_INT),
        conv_kernel=int_field(obj, "conv_kernel", path, hi=MAX_SMALL_INT),
        ssm_bytes=int_field(obj, "ssm_bytes", path),
    )


def _spec(value: object, path: str) -> LayoutSpec:
    obj = as_object(value, path)
    check_keys(obj, _SPEC_KEYS, path)
    return LayoutSpec(
        kind=enum_field(obj, "kind", path, AttnKind, AttnKind.SPLIT_KV),
        num_layers=int_field(obj, "num_layers", path, hi=MAX_SMALL_INT),
        num_blocks=int_field(obj, "num_blocks", path, hi=MAX_COUNT),
        block_size=int_field(obj, "block_size", path, hi=MAX_SMALL_INT),
        num_kv_heads=int_field(obj, "num_kv_heads", path, hi=MAX_SMALL_INT),
        head_dim=int_field(obj, "head_dim", path, hi=MAX_SMALL_INT),
        dtype_bytes=int_field(obj, "dtype_bytes", path, 2, MAX_SMALL_INT),
        tp_rank=int_field(obj, "tp_rank", path, 0, MAX_SMALL_INT),
        tp_size=int_field(obj, "tp_size", path, 1, MAX_SMALL_INT),
        token_layout=enum_field(obj, "token_layout", path, TokenLayout, TokenLayout.HND),
        ppl=int_field(obj, "ppl", path, 1, MAX_SMALL_INT),
        state=_state(obj.get("state"), f"{path}.state"),
    )


def pack_regions(sizes: Sequence[int], base_addr: int, align: int = REGION_ALIGN) -> list[int]:
    """Base addresses of regions of ``sizes`` bytes placed back to back from ``base_addr``.

    Region 0 starts at ``base_addr``; each next region at the previous end rounded up to
    ``align`` bytes.
    """
    addrs, addr = [], base_addr
    for size in sizes:
        addrs.append(addr)
        addr = ceil_div(addr + size, align) * align
    return addrs


def _span(sizes: Sequence[int], align: int = REGION_ALIGN) -> int:
    """Bytes from region 0 to the aligned end of the last region of a packed spec."""
    return pack_regions([*sizes, 1], 0, align)[-1]


def _shorthand(obj: Mapping[str, Any], path: str, rank_index: int | None = None) -> CacheLayout:
    """Build a spec shorthand; with ``rank_index``, override the rank and shift the base."""
    check_keys(obj, _SHORTHAND_KEYS, path)
    spec_path = f"{path}.spec"
    base = int_field(obj, "base_addr", path, DEFAULT_BASE_ADDR)
    device_id = int_field(obj, "device_id", path, 0, MAX_SMALL_INT)
    engine_id = str_field(obj, "engine_id", path)
    spec = _spec(obj["spec"], spec_path)
    check_spec_sizes(spec, spec_path, 1 if rank_index is None else spec.tp_size)
    try:
        if rank_index is not None:
            spec = spec.with_rank(rank_index)
        sizes = spec.region_bytes()
        base += (rank_index or 0) * _span(sizes)
        return spec.build(pack_regions(sizes, base), device_id, engine_id)
    except LayoutError as exc:
        raise LayoutError(f"{spec_path}: {exc}") from None


def parse_side(value: object, path: str) -> CacheLayout:
    """One rank's layout from an explicit record or a spec shorthand at ``path``."""
    obj = as_object(value, path)
    if "spec" in obj:
        return _shorthand(obj, path)
    return _record(obj, path)


def parse_engine(value: object, path: str, local: CacheLayout) -> dict[int, CacheLayout]:
    """The remote engine: a list of per-rank sides, one explicit record, or one spec
    shorthand expanded to the ranks ``local`` reads (its TP plan's source ranks; rank ``r``
    based at ``base_addr + r * span``, ``span`` = one rank's packed bytes rounded up to
    1 MiB). Ranks it only notifies are not built: a remote of thousands of ranks costs
    what its source ranks cost.

    Returns:
        remote tp_rank -> layout, ascending by rank.
    """
    if isinstance(value, list):
        if not value:
            raise LayoutError(f"{path}: expected at least one remote record, got []")
        if len(value) > MAX_RANKS:
            raise LayoutError(f"{path}: {len(value)} records exceed the limit of {MAX_RANKS} ranks")
        out: dict[int, CacheLayout] = {}
        for i, item in enumerate(value):
            lay = parse_side(item, f"{path}[{i}]")
            if lay.tp_rank in out:
                raise LayoutError(f"{path}[{i}].tp_rank: rank {lay.tp_rank} given twice")
            out[lay.tp_rank] = lay
        return dict(sorted(out.items()))
    obj = as_object(value, path)
    if "spec" not in obj:
        lay = _record(obj, path)
        return {lay.tp_rank: lay}
    spec_obj = as_object(obj["spec"], f"{path}.spec")
    if "tp_rank" in spec_obj:
        raise LayoutError(
            f"{path}.spec.tp_rank: not allowed when the remote engine is one spec "
            "(every rank of tp_size is expanded); give a list of records instead"
        )
    tp_size = int_field(spec_obj, "tp_size", f"{path}.spec", 1, MAX_SMALL_INT)
    if tp_size <= 0:
        raise LayoutError(f"{path}.spec.tp_size: must be > 0, got {tp_size}")
    check_spec_sizes(_spec(spec_obj, f"{path}.spec"), f"{path}.spec", tp_size)
    rank0 = _shorthand(obj, path, rank_index=0)  # the spec's own errors come first
    sources = tp_plan_of(local, tp_size).source_ranks  # ascending
    return {r: rank0 if r == 0 else _shorthand(obj, path, rank_index=r) for r in sources}


_REQUEST_KEYS = (
    "local_block_ids", "remote_block_ids", "local_state_ids", "remote_state_ids",
    "num_cached_blocks",
)  # fmt: skip


def _request(value: object, path: str) -> RequestInput | None:
    if value is None:
        return None
    obj = as_object(value, path)
    check_keys(obj, _REQUEST_KEYS, path)
    ids = {
        k: int_list_field(obj, k, path, MAX_BLOCK_ID)
        for k in ("local_block_ids", "remote_block_ids", "local_state_ids", "remote_state_ids")
        if k in obj or not k.endswith("state_ids")  # block ids are required: get_field names them
    }
    return RequestInput(
        local_block_ids=ids["local_block_ids"],
        remote_block_ids=ids["remote_block_ids"],
        local_state_ids=ids.get("local_state_ids"),
        remote_state_ids=ids.get("remote_state_ids"),
        num_cached_blocks=int_field(obj, "num_cached_blocks", path, 0, MAX_BLOCK_ID),
    )


def load_plan_input(data: object) -> PlanInput:
    """Parse a whole plan file (already decoded from JSON/TOML).

    Top-level fields: ``local`` (one side), ``remote`` (the engine), optional
    ``request`` and ``description`` (ignored text).

    Raises:
        LayoutError: the first bad field, named by its JSON path.
    """
    obj = as_object(data, "$")
    for key in obj:
        if key not in ("local", "remote", "request", "description"):
            raise LayoutError(
                f"{key}: unknown top-level field (local, remote, request, description)"
            )
    for key in ("local", "remote"):
        if key not in obj:
            raise LayoutError(f"{key}: missing field")
    local = parse_side(obj["local"], "local")
    return PlanInput(
        local=local,
        remotes=parse_engine(obj["remote"], "remote", local),
        request=_request(obj.get("request"), "request"),
    )
