"""An unexpected exception inside a request's step (not a KvxferError: MemoryError from
the binding, a bug) fails the request: a later poll never finishes a half-done step.

Before, ``_step`` caught KvxferError only: a READ posted to one of two consumer ranks
ended DONE with the other rank's blocks never written (65,286 wrong bytes), and a
relayout interrupted halfway ran again and scrambled what it had already put in place
(97,909 wrong bytes), both reported DONE. Real NIXL, in one process."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, allocate_cache
from kvxfer.engine import transfer as transfer_mod
from kvxfer.layout.presets import spec_for
from kvxfer.testing import MemoryBackend, fill, mismatches


def _drive(t: Any) -> RequestState:
    """Poll like a caller that keeps polling whatever a poll raises."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if t.poll().is_terminal:
                break
        except Exception:  # before the fixes, the step's exception reached the caller
            pass
        time.sleep(0.002)
    return RequestState(t.state)


@contextlib.contextmanager
def _fan_in(memory: bool = False, **consumer: Any) -> Iterator[tuple[Producer, Consumer]]:
    """A producer of TP 1 (its cache filled with the pattern) and a consumer of TP 2 in
    this process: each request posts a READ on each consumer rank. Real NIXL, or the
    in-memory backend."""
    factory = MemoryBackend if memory else None
    ps = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    pb = allocate_cache(ps)
    fill(ps, pb)
    specs = [spec_for("tiny-gqa", tp_rank=r, tp_size=2, num_blocks=16) for r in (0, 1)]
    sides = [(s, allocate_cache(s)) for s in specs]
    with (
        Producer(EngineConfig("p", model_name="tiny-gqa"), [(ps, pb)],
                 backend_factory=factory) as prod,
        Consumer(EngineConfig("d", model_name="tiny-gqa", **consumer), sides,
                 backend_factory=factory) as cons,
    ):  # fmt: skip
        yield prod, cons


def test_a_post_that_fails_on_one_rank_fails_the_request() -> None:
    with _fan_in() as (prod, cons):
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
        ps = prod.ranks[0].spec
        sides = [(c.spec, c.host_bufs()) for c in cons.ranks.values()]
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

    with _fan_in(memory=True) as (prod, cons):
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
    with _fan_in() as (prod, cons):
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
        state = _drive(t)
        assert state is RequestState.FAILED, (state, t.error)
        monkeypatch.undo()
        backend.make_xfer = real  # type: ignore[method-assign]


def test_a_request_whose_failure_raises_after_it_turned_terminal_still_ends() -> None:
    """_fail raised after the state turned terminal (its stats record, then its Abort
    and end come later): the end event was never set and callbacks never ran, so wait(),
    wait_async() and as_completed slept until the deadline (found by a review)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)  # never answers: the request waits for first contact
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    try:
        with Consumer(EngineConfig("md", model_name="tiny-gqa", handshake_timeout_s=30),
                      [(spec, allocate_cache(spec))], backend_factory=MemoryBackend) as cons:  # fmt: skip
            t = cons.read("r", f"tcp://127.0.0.1:{s.getsockname()[1]}", local_block_ids=[1],
                          remote_block_ids=[1], deadline_s=20.0)  # fmt: skip
            called: list[int] = []
            t.on_end(lambda: called.append(1))

            class Boom:  # the stats record, after `self.state = ABORTED`, raises
                def __enter__(self) -> None:
                    raise RuntimeError("simulated bug after the state turned terminal")

                def __exit__(self, *a: object) -> None:
                    pass

            real = cons._stats._lock
            cons._stats._lock = Boom()  # type: ignore[assignment]
            assert t.cancel() is RequestState.ABORTED
            cons._stats._lock = real
            assert called == [1]
            t0 = time.monotonic()
            assert t.wait(5) is RequestState.ABORTED
            assert time.monotonic() - t0 < 1.0
    finally:
        s.close()


def test_a_poll_that_raises_anything_keeps_the_read_quarantined_to_its_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A poll raising a non-kvxfer error (a binding bug) on a READ left running made every
    later `quarantined` raise (in the vLLM worker's step, in the inbox thread), before
    and after its bound (found by a review). Now the READ counts as running until the
    bound, then is released."""

    with _fan_in(memory=True, lease_s=1.0) as (prod, cons):
        b1 = cons.ranks[1].backend
        real_poll = b1.poll

        def poll(x: Any) -> Any:
            if x.num_descriptors > 1:
                raise RuntimeError("simulated binding error polling rank 1's READ")
            return real_poll(x)

        b1.poll = poll  # type: ignore[method-assign]
        prod.hold("r", block_ids=[3, 4])
        t = cons.read("r", prod.address, local_block_ids=[1, 2], remote_block_ids=[3, 4],
                      deadline_s=1.0)  # fmt: skip
        assert _drive(t) is RequestState.FAILED
        assert t.quarantined  # running, as far as anyone can tell
        for _ in range(20):  # polled every 10 ms by the inbox thread too: one warning
            assert t.quarantined
        warned = [r for r in caplog.records
                  if r.levelname == "WARNING" and "polling a READ left running" in r.message]  # fmt: skip
        assert len(warned) == 1, len(warned)
        time.sleep(2.2)  # past deadline + lease_s
        assert not t.quarantined and t.lingering == []
        b1.poll = real_poll  # type: ignore[method-assign]


def test_a_rescue_that_fails_partway_never_ends_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """Failing raised an exception whose repr raised MemoryError: the rescue had emptied
    the request's transfers before turning it FAILED, so cancel() raised, the request
    stayed PENDING with nothing to poll, and the next poll finished it DONE while rank
    1's READ still ran (found by a review)."""
    from kvxfer.transport.backend import XferState

    class BadRepr(RuntimeError):
        def __repr__(self) -> str:
            raise MemoryError("repr under memory pressure")

    with _fan_in(memory=True) as (prod, cons):
        b1 = cons.ranks[1].backend
        b1.poll = lambda x: XferState.IN_PROGRESS  # type: ignore[method-assign,assignment]
        prod.hold("r", block_ids=[3, 4])
        t = cons.read("r", prod.address, local_block_ids=[1, 2], remote_block_ids=[3, 4],
                      deadline_s=10.0)  # fmt: skip
        end = time.monotonic() + 5
        while not t.posted_at and time.monotonic() < end:
            t.poll()
            time.sleep(0.002)

        def bad_fail(self: Any, err: Any) -> None:
            raise BadRepr("bug while failing")

        monkeypatch.setattr(transfer_mod.Transfer, "_fail", bad_fail)
        with contextlib.suppress(MemoryError):  # (it escaped cancel() before the fix)
            t.cancel()
        monkeypatch.undo()
        assert t.poll() is RequestState.FAILED
        assert t.quarantined  # rank 1's READ still runs
