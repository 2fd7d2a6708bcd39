"""Fixtures of the fault suite: every producer process and consumer is torn down, always."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .procs import ProducerProc


@pytest.fixture
def spawn() -> Iterator[Callable[..., ProducerProc]]:
    """``spawn(**kw)`` makes a (not yet started) ProducerProc killed at teardown."""
    made: list[ProducerProc] = []

    def make(**kw: Any) -> ProducerProc:
        p = ProducerProc(**kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    """``closing(obj)`` closes ``obj`` at teardown (consumers, backends) and returns it."""
    objs: list[Any] = []

    def add(obj: Any) -> Any:
        objs.append(obj)
        return obj

    yield add
    for obj in reversed(objs):
        obj.close()
