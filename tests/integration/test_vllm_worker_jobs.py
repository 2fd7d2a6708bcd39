"""One job of a step that fails to start never stops the step's other jobs, nor vLLM's
worker (an exception out of ``bind_connector_metadata`` ends the engine). Real NIXL
engines in one process; no vLLM."""

from __future__ import annotations

import time

import pytest

from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, allocate_cache
from kvxfer.errors import HoldEndedError
from kvxfer.integrations.vllm.extra import ExtraConfig
from kvxfer.integrations.vllm.params import RemotePrefill
from kvxfer.integrations.vllm.scheduler import HoldJob, LoadJob
from kvxfer.integrations.vllm.worker import WorkerSettings, WorkerSide
from kvxfer.layout.presets import spec_for
from kvxfer.testing.ports import free_port

pytestmark = pytest.mark.timeout(60)

SPEC = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)


def _side(lease_s: float = 120.0) -> WorkerSide:
    return WorkerSide(
        WorkerSettings(
            "e",
            0,
            1,
            16,
            2,
            "CPU_ATTN",
            True,
            True,
            "tiny-gqa",
            "float16",
            extra=ExtraConfig(lease_s=lease_s),
        )
    )


class _RefusingProducer(Producer):
    """A real producer whose ``hold`` fails for one request id (a seam for the error)."""

    def hold(self, request_id: str, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        if request_id == "refused":
            raise RuntimeError("no room")
        return super().hold(request_id, *args, **kwargs)


def test_a_duplicate_hold_does_not_stop_the_steps_other_jobs() -> None:
    with Producer(EngineConfig("wjp", model_name="tiny-gqa"), [(SPEC, allocate_cache(SPEC))]) as p:
        side = _side()
        side.producer = p
        p.hold("dup", block_ids=[1])
        side.start([], [HoldJob("dup", (2,)), HoldJob("next", (3,))])  # raised before
        assert p.num_held == 2
        assert p.held_block_ids("next") == frozenset({3})
        assert p.held_block_ids("dup") == frozenset({1})  # the first hold stands
        assert side.finished() == (set(), set())  # nothing reported twice


def test_a_hold_that_fails_keeps_its_blocks_until_the_lease_it_promised() -> None:
    # a decode may read the blocks until the lease in the params: vLLM must not free
    # them sooner, so the request is reported finished only when that lease has passed
    cfg = EngineConfig("wjr", model_name="tiny-gqa")
    with _RefusingProducer(cfg, [(SPEC, allocate_cache(SPEC))]) as p:
        side = _side(lease_s=0.3)
        side.producer = p
        t0 = time.monotonic()
        side.start([], [HoldJob("refused", (2,)), HoldJob("next", (3,))])
        assert p.held_block_ids("next") == frozenset({3})
        assert side.finished() == (set(), set())
        while not (got := side.finished())[0]:
            assert time.monotonic() - t0 < 5
            time.sleep(0.02)
        assert got == ({"refused"}, set())
        assert time.monotonic() - t0 >= 0.3


def test_an_aborted_request_stops_its_load_at_once() -> None:
    # vLLM keeps an aborted request's blocks until its load is reported; a load stuck in
    # first contact (params naming a host that never answers) pinned them until the
    # contact's timeout, then its deadline. vLLM names the aborted request in
    # get_finished's finished_req_ids: the load is cancelled and reported there.

    cfg = EngineConfig("wja", model_name="tiny-gqa", handshake_timeout_s=30.0)
    with Consumer(cfg, [(SPEC, allocate_cache(SPEC))]) as cons:
        side = _side()
        side.consumer = cons
        dead = f"tcp://127.0.0.1:{free_port()}"  # nobody listens: the fetch waits
        remote = RemotePrefill("p", "x", dead, (1,), (4, 5), 16, 1, 32, hold_ticket=3)
        side.start([LoadJob("d-x", remote, (6, 7), (4, 5)), LoadJob("d-y", remote, (8,), (4,))], [])
        assert side.finished() == (set(), set())  # contacting
        t0 = time.monotonic()
        assert side.finished(aborted={"d-x", "unknown"}) == (set(), {"d-x"})
        assert time.monotonic() - t0 < 1.0
        assert side.take_load_errors() == set()  # vLLM frees them: no policy applies
        assert side.finished() == (set(), set())  # the other load goes on
        assert "d-y" in side._loads


def test_a_reader_of_a_hold_that_failed_to_start_fails_at_once() -> None:
    # the scheduler handed the ticket out with the params before the worker's hold
    # failed: a decode reading with it saw "not started yet" at every check until its
    # deadline (30 s in vLLM). The failed hold's slot now says the ticket ended.

    cfg = EngineConfig("wjt", model_name="tiny-gqa")
    with (
        _RefusingProducer(cfg, [(SPEC, allocate_cache(SPEC))]) as p,
        Consumer(EngineConfig("wjtd", model_name="tiny-gqa"), [(SPEC, allocate_cache(SPEC))]) as c,
    ):
        side = _side()
        side.producer = p
        live = p.hold("live", block_ids=[1])  # ticket 1; the scheduler's next is 2
        side.start([], [HoldJob("refused", (2,), ticket=live.ticket + 1)])
        t0 = time.monotonic()
        t = c.read("refused", p.address, local_block_ids=[3], remote_block_ids=[2],
                   hold_ticket=live.ticket + 1, deadline_s=20.0)  # fmt: skip
        assert t.wait(25) is RequestState.FAILED, (t.state, t.error)
        assert isinstance(t.error, HoldEndedError), t.error
        assert time.monotonic() - t0 < 5.0
        # the live hold's readers are untouched (another slot)
        ok = c.read("live", p.address, local_block_ids=[4], remote_block_ids=[1],
                    hold_ticket=live.ticket)  # fmt: skip
        assert ok.wait(20) is RequestState.DONE, ok.error


def test_a_refused_ticket_never_ends_a_live_hold_in_its_slot() -> None:
    cfg = EngineConfig("wjs", model_name="tiny-gqa", hold_slots=4)
    with Producer(cfg, [(SPEC, allocate_cache(SPEC))]) as p:
        live = p.hold("live", block_ids=[1])
        assert live.ticket == 1  # the first ticket: slot 1 of 4
        words = p.ranks[0].words
        slot = live.ticket % 4
        assert p.refuse_ticket(live.ticket + 4) is False  # same slot, live: untouched
        assert int(words[slot, 0]) == live.ticket << 1
        assert p.refuse_ticket(live.ticket + 1) is True  # a free slot
        assert int(words[(live.ticket + 1) % 4, 0]) == ((live.ticket + 1) << 1) | 1
        p.hold("later", block_ids=[2], ticket=10)  # slot 2, after the refused ticket 2
        p.release("later")
        assert p.refuse_ticket(6) is False  # slot 2 is past ticket 6: words only grow
        assert int(words[2, 0]) == (10 << 1) | 1
        assert p.refuse_ticket(0) is False  # no ticket
