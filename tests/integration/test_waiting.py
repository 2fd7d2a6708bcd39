"""Waiting without busy loops: once a request is posted, the consumer's progress thread
polls NIXL for everyone who waits, and waiters (``wait``, ``wait_async``,
``as_completed``) sleep on the request's end instead of polling it themselves.

NIXL has no completion callback for a READ, so someone must poll: one thread per
consumer, not one per waiter. Each test makes the backend report the READ in progress
for its first polls (a wrapper around the real poll) and checks which threads polled."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvxfer.engine import RequestState, as_completed
from kvxfer.testing import mismatches
from kvxfer.transport.nixl import XferState
from tests.engines import free_port, local_pair

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
BUSY_POLLS = 20  # the first polls of each handle say "in progress"


def _spy_polls(cons: Any) -> list[str]:
    """Record the thread of every NIXL poll; the first BUSY_POLLS per handle are busy."""
    backend = cons.ranks[0].backend
    real, seen, names = backend.poll, {}, []

    def poll(x: Any) -> XferState:
        names.append(threading.current_thread().name)
        seen[id(x)] = seen.get(id(x), 0) + 1
        return XferState.IN_PROGRESS if seen[id(x)] <= BUSY_POLLS else real(x)

    backend.poll = poll
    return names


def test_wait_sleeps_while_the_progress_thread_polls() -> None:
    with local_pair(32) as (spec, local, prod, cons):
        cons.connect(prod.address)
        polls = _spy_polls(cons)
        lids, rids = np.array([1, 2, 3]), np.array([30, 0, 7])
        t = cons.read("r", prod.address, local_block_ids=lids, remote_block_ids=rids)
        assert t.wait(10) is RequestState.DONE, t.error
        assert mismatches(spec, local, spec, lids, rids) == 0
        me = threading.current_thread().name
        assert len(polls) > BUSY_POLLS
        assert polls.count(me) <= 1  # at most the step that posted it
        assert set(polls) - {me} == {"kvxfer-progress"}


def test_wait_async_sleeps_on_the_end_of_the_request() -> None:
    with local_pair(32) as (spec, local, prod, cons):
        cons.connect(prod.address)
        polls = _spy_polls(cons)
        t = cons.read("r", prod.address, local_block_ids=[4], remote_block_ids=[5])

        async def main() -> tuple[RequestState, str]:
            return await t.wait_async(10), threading.current_thread().name

        state, loop_thread = asyncio.run(main())
        assert state is RequestState.DONE, t.error
        assert polls.count(loop_thread) <= 1 and "kvxfer-progress" in polls


def test_as_completed_yields_each_request_as_it_ends() -> None:
    with local_pair(32) as (spec, local, prod, cons):
        cons.connect(prod.address)
        polls = _spy_polls(cons)
        ts = [cons.read(f"r{i}", prod.address, local_block_ids=[i], remote_block_ids=[i + 8])
              for i in range(3)]  # fmt: skip
        ended = list(as_completed(ts, 10))
        assert sorted(t.request_id for t in ended) == ["r0", "r1", "r2"]
        assert all(t.state is RequestState.DONE for t in ended)
        me = threading.current_thread().name
        assert polls.count(me) <= 3  # one step each, to post them
        assert mismatches(spec, local, spec, np.arange(3), np.arange(8, 11)) == 0


def test_a_waiters_own_timeout_ends_its_wait_not_the_request() -> None:
    with local_pair(8, handshake_timeout_s=1.0) as (_, _, _, cons):
        t = cons.read("r", f"tcp://127.0.0.1:{free_port()}", local_block_ids=[0],
                      remote_block_ids=[0])  # fmt: skip
        t0 = time.monotonic()
        assert t.wait(0.1) is RequestState.PENDING
        assert 0.1 <= time.monotonic() - t0 < 0.6
        assert t.wait(10) is RequestState.PEER_LOST  # first contact failed: nobody there
