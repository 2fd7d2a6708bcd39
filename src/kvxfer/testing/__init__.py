"""Helpers for tests, including users' own: byte patterns that encode what every cache
byte means (:func:`fill`) and their verification (:func:`mismatches`)."""

from kvxfer.testing.pattern import fill, mismatches

__all__ = ["fill", "mismatches"]
