"""An unexpected exception inside a request's step (not a KvxferError: MemoryError from
the binding, a bug) fails the request: a later poll never finishes a half-done step.

Before, ``_step`` caught KvxferError only: a READ posted to one of two consumer ranks
ended DONE with the other rank's blocks never written (65,286 wrong bytes), and a
relayout interrupted halfway ran again and scrambled what it had already put in place
(97,909 wrong bytes), both reported DONE. Real NIXL, in one process."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, allocate_cache
from kvxfer.engine import transfer as transfer_mod
from kvxfer.layout.presets import spec_for
from kvxfer.testing import fill, mismatches


def _drive(t: Any) -> RequestState:
    """Poll like a caller that keeps polling whatever a poll raises."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if t.poll().is_terminal:
                break
        except MemoryError:  # before the fix, the step's exception reached the caller
            pass
        time.sleep(0.002)
    return RequestState(t.state)


def test_a_post_that_fails_on_one_rank_fails_the_request() -> None:
    ps = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    pb = allocate_cache(ps)
    fill(ps, pb)
    specs = [spec_for("tiny-gqa", tp_rank=r, tp_size=2, num_blocks=16) for r in (0, 1)]
    sides = [(s, allocate_cache(s)) for s in specs]
    with (
        Producer(EngineConfig("p", model_name="tiny-gqa"), [(ps, pb)]) as prod,
        Consumer(EngineConfig("d", model_name="tiny-gqa"), sides) as cons,
    ):
        backend = cons.ranks[1].backend
        real, armed = backend.make_xfer, [True]

        def bad_alloc(*a: Any, **k: Any) -> Any:
            if armed[0]:
                armed[0] = False
                raise MemoryError("simulated std::bad_alloc from the binding")
            return real(*a, **k)

        backend.make_xfer = bad_alloc  # type: ignore[method-assign]
        prod.hold("r", block_ids=[3, 4])
        t = cons.read("r", prod.address, local_block_ids=[1, 2], remote_block_ids=[3, 4])
        assert _drive(t) is RequestState.FAILED  # was DONE, rank 1 never written
        assert "internal error" in str(t.error) and "MemoryError" in str(t.error)
        prod.hold("r2", block_ids=[5, 6])  # the engine goes on: the next read is whole
        t2 = cons.read("r2", prod.address, local_block_ids=[7, 8], remote_block_ids=[5, 6])
        assert t2.wait(20) is RequestState.DONE, t2.error
        assert [mismatches(s, b, ps, [7, 8], [5, 6]) for s, b in sides] == [0, 0]


def test_a_relayout_interrupted_halfway_fails_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    ps = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=32, block_size=8)
    cs = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16, block_size=16)  # bsr 2
    pb, cb = allocate_cache(ps), allocate_cache(cs)
    fill(ps, pb)
    real, calls = transfer_mod.relayout_bsr, [0]

    def halfway(spec: Any, bufs: Any, ids: Any, bsr: int) -> None:
        calls[0] += 1
        real(spec, bufs, ids, bsr)  # this part is put in place, the next one fails
        if calls[0] == 1:
            raise MemoryError("simulated: the gather copy of the next part")

    monkeypatch.setattr(transfer_mod, "relayout_bsr", halfway)
    with (
        Producer(EngineConfig("p", model_name="tiny-gqa"), [(ps, pb)]) as prod,
        Consumer(EngineConfig("d", model_name="tiny-gqa"), [(cs, cb)]) as cons,
    ):
        prod.hold("r", block_ids=[4, 5, 6, 7])
        t = cons.read("r", prod.address, local_block_ids=[1, 2], remote_block_ids=[4, 5, 6, 7])
        assert _drive(t) is RequestState.FAILED  # was DONE with 97,909 wrong bytes
        assert calls[0] == 1  # never relaid out a second time
        prod.hold("r2", block_ids=[8, 9, 10, 11])
        t2 = cons.read("r2", prod.address, local_block_ids=[3, 4], remote_block_ids=[8, 9, 10, 11])
        assert t2.wait(20) is RequestState.DONE, t2.error
        assert mismatches(cs, cb, ps, np.array([3, 4]), np.array([8, 9, 10, 11])) == 0


def test_a_post_that_fails_on_one_rank_fails_the_request_on_the_memory_seam() -> None:
    """The same on the in-memory backend, whose transfers lacked ``is_lost``: the failed
    request's end raised AttributeError out of poll (found while reviewing the lingering
    READs: a transfer posted on rank 0 was still in the request when rank 1 failed)."""
    from kvxfer.testing import MemoryBackend

    ps = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    pb = allocate_cache(ps)
    fill(ps, pb)
    specs = [spec_for("tiny-gqa", tp_rank=r, tp_size=2, num_blocks=16) for r in (0, 1)]
    sides = [(s, allocate_cache(s)) for s in specs]
    with (
        Producer(EngineConfig("mp", model_name="tiny-gqa"), [(ps, pb)],
                 backend_factory=MemoryBackend) as prod,
        Consumer(EngineConfig("md", model_name="tiny-gqa"), sides,
                 backend_factory=MemoryBackend) as cons,
    ):  # fmt: skip
        backend = cons.ranks[1].backend
        real = backend.make_xfer

        def refuse(*a: Any, **k: Any) -> Any:
            from kvxfer.errors import TransferError

            raise TransferError("simulated: rank 1 cannot make its READ")

        backend.make_xfer = refuse  # type: ignore[method-assign]
        prod.hold("r", block_ids=[3, 4])
        t = cons.read("r", prod.address, local_block_ids=[1, 2], remote_block_ids=[3, 4])
        assert t.wait(10) is RequestState.FAILED, (t.state, t.error)
        assert "rank 1 cannot make" in str(t.error)
        assert not t.quarantined and t.lingering == []
        backend.make_xfer = real  # type: ignore[method-assign]


def test_a_request_whose_failure_itself_raises_still_ends_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception inside the failing of a request (a bug, MemoryError) escaped poll with
    the request PENDING and its READ posted on one rank: the next poll finished it DONE
    with the other rank never written (65,286 wrong bytes, measured by a review on the
    memory seam). Now it ends FAILED, and what it posted counts as still running."""
    ps = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    pb = allocate_cache(ps)
    fill(ps, pb)
    specs = [spec_for("tiny-gqa", tp_rank=r, tp_size=2, num_blocks=16) for r in (0, 1)]
    sides = [(s, allocate_cache(s)) for s in specs]
    with (
        Producer(EngineConfig("p", model_name="tiny-gqa"), [(ps, pb)]) as prod,
        Consumer(EngineConfig("d", model_name="tiny-gqa"), sides) as cons,
    ):
        backend = cons.ranks[1].backend
        real = backend.make_xfer

        def refuse(*a: Any, **k: Any) -> Any:
            from kvxfer.errors import TransferError

            raise TransferError("simulated: rank 1 cannot make its READ")

        def broken(self: Any, d: int, x: Any) -> bool:
            raise RuntimeError("simulated bug while failing the request")

        backend.make_xfer = refuse  # type: ignore[method-assign]
        monkeypatch.setattr(transfer_mod.Transfer, "_still_running", broken)
        prod.hold("r", block_ids=[3, 4])
        t = cons.read("r", prod.address, local_block_ids=[1, 2], remote_block_ids=[3, 4])
        state = _drive_any(t)
        assert state is RequestState.FAILED, (state, t.error)
        monkeypatch.undo()
        backend.make_xfer = real  # type: ignore[method-assign]


def _drive_any(t: Any) -> RequestState:
    """Poll like a caller that keeps polling whatever a poll raises."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if t.poll().is_terminal:
                break
        except Exception:  # before the fix, the failing's exception reached the caller
            pass
        time.sleep(0.002)
    return RequestState(t.state)
