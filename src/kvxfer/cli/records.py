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

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from kvxfer._intmath import ceil_div
from kvxfer.cli.plan_bounds import BigInt, check_spec_sizes
from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout, Region, Shard, TokenLayout, View, ViewKind
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec
from kvxfer.wire.limits import (
    MAX_BLOCK_ID,
    MAX_COUNT,
    MAX_DESCRIPTORS,
    MAX_RANKS,
    MAX_REGIONS,
    MAX_SMALL_INT,
    MAX_U64,
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

E = TypeVar("E", bound=Enum)
_MISSING = object()


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


def _show(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (dict, list)):
        return type(value).__name__
    return repr(value) if not isinstance(value, bool) else str(value).lower()


def _obj(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise LayoutError(f"{path}: expected object, got {_show(value)}")
    return value


def _check_keys(obj: Mapping[str, Any], allowed: Sequence[str], path: str) -> None:
    for key in obj:
        if key not in allowed:
            raise LayoutError(f"{path}.{key}: unknown field (expected one of {', '.join(allowed)})")


def _get(obj: Mapping[str, Any], key: str, path: str, default: object = _MISSING) -> object:
    if key in obj:
        return obj[key]
    if default is _MISSING:
        raise LayoutError(f"{path}.{key}: missing field")
    return default


def _bounded(value: object, where: str, hi: int) -> int:
    """``value`` as an int of magnitude at most ``hi`` (a wire bound), or LayoutError."""
    if isinstance(value, BigInt):
        raise LayoutError(f"{where}: {value!r} exceeds the limit of {hi}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{where}: expected int, got {_show(value)}")
    if abs(value) > hi:
        raise LayoutError(f"{where}: {value} exceeds the limit of {hi}")
    return value


def _int(
    obj: Mapping[str, Any], key: str, path: str, default: object = _MISSING, hi: int = MAX_U64
) -> int:
    """An int field of magnitude <= ``hi``; addresses may also be hex strings (``"0x7f00..."``)."""
    value = _get(obj, key, path, default)
    if isinstance(value, str) and key.endswith("addr") and value.lower().startswith("0x"):
        with contextlib.suppress(ValueError):  # hex is linear-time: no digit limit needed
            value = int(value, 16)
    return _bounded(value, f"{path}.{key}", hi)


def _bool(obj: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = _get(obj, key, path, default)
    if not isinstance(value, bool):
        raise LayoutError(f"{path}.{key}: expected true or false, got {_show(value)}")
    return value


def _str(obj: Mapping[str, Any], key: str, path: str, default: str = "") -> str:
    value = _get(obj, key, path, default)
    if not isinstance(value, str):
        raise LayoutError(f"{path}.{key}: expected string, got {_show(value)}")
    return value


def _enum(obj: Mapping[str, Any], key: str, path: str, enum: type[E], default: E) -> E:
    value = _get(obj, key, path, default.value)
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(f'"{e.value}"' for e in enum)
        raise LayoutError(f"{path}.{key}: expected one of {choices}, got {_show(value)}") from None


def _list(value: object, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise LayoutError(f"{path}: expected list, got {_show(value)}")
    return value


def _int_list(obj: Mapping[str, Any], key: str, path: str, hi: int) -> tuple[int, ...]:
    items = _list(_get(obj, key, path), f"{path}.{key}")
    return tuple(_bounded(x, f"{path}.{key}[{i}]", hi) for i, x in enumerate(items))


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
    obj = _obj(value, path)
    _check_keys(obj, _REGION_KEYS, path)
    return Region(
        base_addr=_int(obj, "base_addr", path),
        num_bytes=_int(obj, "num_bytes", path),
        device_id=_int(obj, "device_id", path, 0, MAX_SMALL_INT),
        name=_str(obj, "name", path),
    )


def _view(value: object, path: str) -> View:
    obj = _obj(value, path)
    _check_keys(obj, _VIEW_KEYS, path)
    return View(
        region=_int(obj, "region", path, hi=MAX_REGIONS),
        offset=_int(obj, "offset", path),
        length=_int(obj, "length", path),
        stride=_int(obj, "stride", path),
        count=_int(obj, "count", path, hi=MAX_COUNT),
        kind=_enum(obj, "kind", path, ViewKind, ViewKind.ATTN),
        shard=_enum(obj, "shard", path, Shard, Shard.HEADS),
        name=_str(obj, "name", path),
    )


def _record(obj: Mapping[str, Any], path: str) -> CacheLayout:
    _check_keys(obj, _RECORD_KEYS, path)
    regions = _list(_get(obj, "regions", path), f"{path}.regions")
    views = _list(_get(obj, "views", path), f"{path}.views")
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
    block_size = _int(obj, "block_size", path, hi=small)
    num_kv_heads = _int(obj, "num_kv_heads", path, hi=small)
    head_dim = _int(obj, "head_dim", path, hi=small)
    dtype_bytes = _int(obj, "dtype_bytes", path, hi=small)
    tp_rank = _int(obj, "tp_rank", path, 0, small)
    tp_size = _int(obj, "tp_size", path, 1, small)
    token_layout = _enum(obj, "token_layout", path, TokenLayout, TokenLayout.HND)
    ppl = _int(obj, "ppl", path, 1, small)
    is_mla = _bool(obj, "is_mla", path, False)
    is_cross_layer = _bool(obj, "is_cross_layer", path, False)
    engine_id = _str(obj, "engine_id", path)
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
    obj = _obj(value, path)
    _check_keys(obj, _STATE_KEYS, path)
    return StateSpec(
        num_layers=_int(obj, "num_layers", path, hi=MAX_SMALL_INT),
        conv_cols=_int_list(obj, "conv_cols", path, MAX_SMALL_INT),
        conv_kernel=_int(obj, "conv_kernel", path, hi=MAX_SMALL_INT),
        ssm_bytes=_int(obj, "ssm_bytes", path),
    )


def _spec(value: object, path: str) -> LayoutSpec:
    obj = _obj(value, path)
    _check_keys(obj, _SPEC_KEYS, path)
    return LayoutSpec(
        kind=_enum(obj, "kind", path, AttnKind, AttnKind.SPLIT_KV),
        num_layers=_int(obj, "num_layers", path, hi=MAX_SMALL_INT),
        num_blocks=_int(obj, "num_blocks", path, hi=MAX_COUNT),
        block_size=_int(obj, "block_size", path, hi=MAX_SMALL_INT),
        num_kv_heads=_int(obj, "num_kv_heads", path, hi=MAX_SMALL_INT),
        head_dim=_int(obj, "head_dim", path, hi=MAX_SMALL_INT),
        dtype_bytes=_int(obj, "dtype_bytes", path, 2, MAX_SMALL_INT),
        tp_rank=_int(obj, "tp_rank", path, 0, MAX_SMALL_INT),
        tp_size=_int(obj, "tp_size", path, 1, MAX_SMALL_INT),
        token_layout=_enum(obj, "token_layout", path, TokenLayout, TokenLayout.HND),
        ppl=_int(obj, "ppl", path, 1, MAX_SMALL_INT),
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
    _check_keys(obj, _SHORTHAND_KEYS, path)
    spec_path = f"{path}.spec"
    base = _int(obj, "base_addr", path, DEFAULT_BASE_ADDR)
    device_id = _int(obj, "device_id", path, 0, MAX_SMALL_INT)
    engine_id = _str(obj, "engine_id", path)
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
    obj = _obj(value, path)
    if "spec" in obj:
        return _shorthand(obj, path)
    return _record(obj, path)


def parse_engine(value: object, path: str) -> dict[int, CacheLayout]:
    """The remote engine: a list of per-rank sides, one explicit record, or one spec
    shorthand expanded to every rank of its ``tp_size`` (rank ``r`` based at
    ``base_addr + r * span``, ``span`` = one rank's packed bytes rounded up to 1 MiB).

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
    obj = _obj(value, path)
    if "spec" not in obj:
        lay = _record(obj, path)
        return {lay.tp_rank: lay}
    spec_obj = _obj(obj["spec"], f"{path}.spec")
    if "tp_rank" in spec_obj:
        raise LayoutError(
            f"{path}.spec.tp_rank: not allowed when the remote engine is one spec "
            "(every rank of tp_size is expanded); give a list of records instead"
        )
    tp_size = _int(spec_obj, "tp_size", f"{path}.spec", 1, MAX_SMALL_INT)
    if tp_size <= 0:
        raise LayoutError(f"{path}.spec.tp_size: must be > 0, got {tp_size}")
    check_spec_sizes(_spec(spec_obj, f"{path}.spec"), f"{path}.spec", tp_size)
    return {r: _shorthand(obj, path, rank_index=r) for r in range(tp_size)}


_REQUEST_KEYS = (
    "local_block_ids", "remote_block_ids", "local_state_ids", "remote_state_ids",
    "num_cached_blocks",
)  # fmt: skip


def _request(value: object, path: str) -> RequestInput | None:
    if value is None:
        return None
    obj = _obj(value, path)
    _check_keys(obj, _REQUEST_KEYS, path)
    ids = {
        k: _int_list(obj, k, path, MAX_BLOCK_ID)
        for k in ("local_block_ids", "remote_block_ids", "local_state_ids", "remote_state_ids")
        if k in obj or not k.endswith("state_ids")  # block ids are required: _get names them
    }
    return RequestInput(
        local_block_ids=ids["local_block_ids"],
        remote_block_ids=ids["remote_block_ids"],
        local_state_ids=ids.get("local_state_ids"),
        remote_state_ids=ids.get("remote_state_ids"),
        num_cached_blocks=_int(obj, "num_cached_blocks", path, 0, MAX_BLOCK_ID),
    )


def load_plan_input(data: object) -> PlanInput:
    """Parse a whole plan file (already decoded from JSON/TOML).

    Top-level fields: ``local`` (one side), ``remote`` (the engine), optional
    ``request`` and ``description`` (ignored text).

    Raises:
        LayoutError: the first bad field, named by its JSON path.
    """
    obj = _obj(data, "$")
    for key in obj:
        if key not in ("local", "remote", "request", "description"):
            raise LayoutError(
                f"{key}: unknown top-level field (local, remote, request, description)"
            )
    for key in ("local", "remote"):
        if key not in obj:
            raise LayoutError(f"{key}: missing field")
    return PlanInput(
        local=parse_side(obj["local"], "local"),
        remotes=parse_engine(obj["remote"], "remote"),
        request=_request(obj.get("request"), "request"),
    )
