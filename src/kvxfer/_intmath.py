"""Integer helpers shared by the planners. Every check raises LayoutError with the numbers."""

from __future__ import annotations

from kvxfer.errors import LayoutError


def exact_div(num: int, den: int, what: str) -> int:
    """Return ``num // den``; raise LayoutError naming ``what`` unless it divides evenly."""
    if den <= 0:
        raise LayoutError(f"{what}: divisor must be positive, got {den}")
    if num % den:
        raise LayoutError(f"{what}: {num} is not divisible by {den}")
    return num // den


def ceil_div(num: int, den: int) -> int:
    """Return ``ceil(num / den)`` for non-negative ``num`` and positive ``den``."""
    return -(-num // den)


def require_positive(value: int, what: str) -> int:
    """Return ``value``; raise LayoutError naming ``what`` unless it is > 0."""
    if value <= 0:
        raise LayoutError(f"{what} must be > 0, got {value}")
    return value
