"""Helpers for tests, including users' own: byte patterns that encode what every cache
byte means (:func:`fill`) and their verification (:func:`mismatches`), and
:class:`MemoryBackend`, an in-process transfer backend (memmove, no NIXL) with
NixlBackend's interface and error contract."""

from kvxfer.testing.pattern import fill, mismatches
from kvxfer.transport.memory import MemoryBackend

__all__ = ["MemoryBackend", "fill", "mismatches"]
