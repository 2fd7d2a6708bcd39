"""Issue 9 item 12, made deterministic: the heartbeat thread and a caller's thread both
reach the consumer's NIXL backend. One engine lock serializes them, so the backend's
dicts are never changed from two threads at once, and a poll never hands NIXL a handle
that another thread released (it sees a typed PeerLostError instead).

Each test holds one thread inside a backend call (a wrapper around the real call that
waits there) while the other thread tries to get in, and checks the order of events."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, allocate_cache
from kvxfer.errors import PeerLostError
from kvxfer.layout.presets import spec_for
from kvxfer.testing import fill, mismatches
from kvxfer.transport.nixl import XferState
from tests.engines import local_pair

pytestmark = pytest.mark.timeout(60)
HOLD_S = 0.5  # how long a thread stays inside a backend call


def _logged(log: list[str], name: str, real: Callable[..., Any], hold: threading.Event | None = None,
            inside: threading.Event | None = None) -> Callable[..., Any]:  # fmt: skip
    """``real``, logging entry and exit; the first call with ``inside`` set signals it and
    stays in for HOLD_S (another thread then tries its own call)."""

    def call(*args: Any) -> Any:
        log.append(f"{name} in")
        if inside is not None and not inside.is_set():
            inside.set()
            time.sleep(HOLD_S)
        try:
            return real(*args)
        finally:
            log.append(f"{name} out")

    return call


def test_heartbeat_drop_waits_for_a_first_contact_adding_an_agent() -> None:
    """The heartbeat thread drops producer A (``remove_remote``) while a handshake thread
    is inside ``add_remote`` for producer B: the drop starts only after the add ended."""
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    bufs = allocate_cache(spec)
    fill(spec, bufs)
    local = allocate_cache(spec)
    cfg = EngineConfig("p", model_name="tiny-gqa")
    with (
        Producer(cfg, [(spec, bufs)]) as a,
        Producer(cfg, [(spec, bufs)]) as b,
        Consumer(EngineConfig("d", model_name="tiny-gqa"), [(spec, local)]) as cons,
    ):
        assert cons.read("r0", a.address, local_block_ids=[0],
                         remote_block_ids=[1]).wait(10) is RequestState.DONE  # fmt: skip
        backend, log, inside = cons.ranks[0].backend, [], threading.Event()
        backend.add_remote = _logged(log, "add", backend.add_remote, inside=inside)  # type: ignore[method-assign]
        backend.remove_remote = _logged(log, "remove", backend.remove_remote)  # type: ignore[method-assign]
        t = cons.read("r1", b.address, local_block_ids=[2, 3], remote_block_ids=[9, 4])
        assert inside.wait(10)  # B's handshake thread is inside add_remote now
        verdict = threading.Thread(
            target=cons._on_peer_lost, args=(a.address, "injected verdict", {a.generation})
        )
        verdict.start()
        verdict.join(10)
        assert t.wait(10) is RequestState.DONE, t.error
        assert log == ["add in", "add out", "remove in", "remove out"]
        assert a.address not in cons._peers and b.address in cons._peers
        assert mismatches(spec, local, spec, np.array([2, 3]), np.array([9, 4])) == 0


def test_poll_never_uses_a_handle_the_heartbeat_thread_released() -> None:
    """A caller's poll is inside the backend (its transfer still in progress) when the
    heartbeat thread drops the producer: the drop waits for the poll, releases the
    handle as lost, and the request's next poll ends it PEER_LOST with the heartbeat's
    reason; NIXL is never handed the freed handle."""
    with local_pair(16) as (_, _, prod, cons):
        backend, log, inside = cons.ranks[0].backend, [], threading.Event()
        real_poll = backend.poll
        polled: list[bool] = []  # whether each polled handle was already released (a
        # released one raises PeerLostError in the handle itself: NIXL never sees its id)

        def poll_in_progress(x: Any) -> XferState:  # the first poll reports a running READ
            polled.append(x.is_released)
            return XferState.IN_PROGRESS if len(polled) == 1 else real_poll(x)

        backend.poll = _logged(log, "poll", poll_in_progress, inside=inside)  # type: ignore[method-assign]
        backend.remove_remote = _logged(log, "remove", backend.remove_remote)  # type: ignore[method-assign]
        cons.connect(prod.address)
        t = cons.read("r1", prod.address, local_block_ids=[0], remote_block_ids=[5])
        first = threading.Thread(target=t.poll)
        first.start()
        assert inside.wait(10)
        verdict = threading.Thread(
            target=cons._on_peer_lost, args=(prod.address, "injected verdict", {prod.generation})
        )
        verdict.start()
        first.join(10)
        verdict.join(10)
        assert log[:4] == ["poll in", "poll out", "remove in", "remove out"]
        assert t.wait(10) is RequestState.PEER_LOST
        # the heartbeat's reason, not only "stale handle": the user learns why
        assert isinstance(t.error, PeerLostError) and "injected verdict" in str(t.error)
        assert polled[0] is False  # the handle polled while the drop waited was live


def _second_poll_after_done(ticketed: bool) -> None:
    """One thread is past ``poll``'s terminal check, waiting for the engine lock, while
    another polls the request to DONE; the waiting poll then gets the lock."""
    ps = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    ds = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16,
                  block_size=2 * ps.block_size)  # fmt: skip  # bsr 2: DONE runs a relayout
    pb, db = allocate_cache(ps), allocate_cache(ds)
    fill(ps, pb)
    lids, rids = np.array([1, 3]), np.array([9, 2, 5, 7])
    with (
        Producer(EngineConfig("p", model_name="tiny-gqa"), [(ps, pb)]) as prod,
        Consumer(EngineConfig("d", model_name="tiny-gqa"), [(ds, db)]) as cons,
    ):
        lease = prod.hold("r", block_ids=list(rids))
        cons.connect(prod.address)
        t = cons.read("r", prod.address, local_block_ids=lids, remote_block_ids=rids,
                      hold_ticket=lease.ticket if ticketed else None)  # fmt: skip
        with t.context.lock:  # re-entrant: this thread may poll while holding it
            late = threading.Thread(target=t.poll)  # passes the terminal check, waits
            late.start()
            time.sleep(0.3)
            deadline = time.monotonic() + 20
            while t.poll() is not RequestState.DONE and time.monotonic() < deadline:
                time.sleep(0.001)
            assert t.state is RequestState.DONE, t.error
            assert mismatches(ds, db, ps, lids, rids) == 0
        late.join(10)
        assert t.state is RequestState.DONE, t.error  # it was FAILED with a ticket
        assert mismatches(ds, db, ps, lids, rids) == 0  # relaid out twice: 195,844 wrong
        assert cons.stats().requests["done"] == 1  # counted twice


@pytest.mark.parametrize("ticketed", [False, True], ids=["unticketed", "ticketed"])
def test_a_poll_that_waited_for_the_lock_leaves_a_done_request_alone(ticketed: bool) -> None:
    _second_poll_after_done(ticketed)
