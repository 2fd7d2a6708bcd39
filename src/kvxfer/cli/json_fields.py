"""Reading typed fields out of decoded JSON/TOML objects (pure): each accessor checks
the type and bounds of one field and raises :class:`~kvxfer.errors.LayoutError` whose
message starts with the field's path (``remote[1].views[3].stride: expected int, got
"x"``). Used by :mod:`kvxfer.cli.records`."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any, TypeVar

from kvxfer.cli.plan_bounds import BigInt
from kvxfer.errors import LayoutError
from kvxfer.wire.limits import MAX_NAME_LEN, MAX_U64

__all__ = [
    "MISSING",
    "as_list",
    "as_object",
    "bool_field",
    "bounded_int",
    "check_keys",
    "enum_field",
    "get_field",
    "int_field",
    "int_list_field",
    "show",
    "str_field",
]

E = TypeVar("E", bound=Enum)
MISSING = object()  # a field without a default: absent raises


def show(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (dict, list)):
        return type(value).__name__
    return repr(value) if not isinstance(value, bool) else str(value).lower()


def as_object(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise LayoutError(f"{path}: expected object, got {show(value)}")
    return value


def check_keys(obj: Mapping[str, Any], allowed: Sequence[str], path: str) -> None:
    for key in obj:
        if key not in allowed:
            raise LayoutError(f"{path}.{key}: unknown field (expected one of {', '.join(allowed)})")


def get_field(obj: Mapping[str, Any], key: str, path: str, default: object = MISSING) -> object:
    if key in obj:
        return obj[key]
    if default is MISSING:
        raise LayoutError(f"{path}.{key}: missing field")
    return default


def bounded_int(value: object, where: str, hi: int) -> int:
    """``value`` as an int of magnitude at most ``hi`` (a wire bound), or LayoutError."""
    if isinstance(value, BigInt):
        raise LayoutError(f"{where}: {value!r} exceeds the limit of {hi}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{where}: expected int, got {show(value)}")
    if abs(value) > hi:
        shown = f"an integer of {value.bit_length()} bits" if value.bit_length() > 128 else value
        raise LayoutError(f"{where}: {shown} exceeds the limit of {hi}")
    return value


def int_field(
    obj: Mapping[str, Any], key: str, path: str, default: object = MISSING, hi: int = MAX_U64
) -> int:
    """An int field of magnitude <= ``hi``; addresses may also be hex strings (``"0x7f00..."``)."""
    value = get_field(obj, key, path, default)
    if isinstance(value, str) and key.endswith("addr") and value.lower().startswith("0x"):
        with contextlib.suppress(ValueError):  # hex is linear-time: no digit limit needed
            value = int(value, 16)
    return bounded_int(value, f"{path}.{key}", hi)


def bool_field(obj: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = get_field(obj, key, path, default)
    if not isinstance(value, bool):
        raise LayoutError(f"{path}.{key}: expected true or false, got {show(value)}")
    return value


def str_field(obj: Mapping[str, Any], key: str, path: str, default: str = "") -> str:
    value = get_field(obj, key, path, default)
    if not isinstance(value, str):
        raise LayoutError(f"{path}.{key}: expected string, got {show(value)}")
    if len(value) > MAX_NAME_LEN:  # names cross the wire (and fill a table cell)
        raise LayoutError(
            f"{path}.{key}: {len(value)} characters exceeds the limit of {MAX_NAME_LEN}"
        )
    try:
        value.encode()
    except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800"): not printable, not sendable
        raise LayoutError(f"{path}.{key}: not valid UTF-8 text: {value!r}") from None
    return value


def enum_field(obj: Mapping[str, Any], key: str, path: str, enum: type[E], default: E) -> E:
    value = get_field(obj, key, path, default.value)
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(f'"{e.value}"' for e in enum)
        raise LayoutError(f"{path}.{key}: expected one of {choices}, got {show(value)}") from None


def as_list(value: object, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise LayoutError(f"{path}: expected list, got {show(value)}")
    return value


def int_list_field(obj: Mapping[str, Any], key: str, path: str, hi: int) -> tuple[int, ...]:
    items = as_list(get_field(obj, key, path), f"{path}.{key}")
    return tuple(bounded_int(x, f"{path}.{key}[{i}]", hi) for i, x in enumerate(items))
