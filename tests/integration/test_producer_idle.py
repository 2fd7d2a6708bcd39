"""An idle producer does not spin: its engine thread drains notifications every
``IDLE_S`` unless push mode is in use (a PushRequest in the last ``PUSH_ACTIVE_S``),
when it drains every ``BUSY_S`` so a push starts at once. Measured before the change:
an idle NIXL producer used 10.5% of a core (2,000 drains a second), an idle consumer
4.9%; inside vLLM every instance runs both."""

from __future__ import annotations

import time

import pytest

from kvxfer.engine import producer as producer_mod
from kvxfer.engine.config import EngineConfig, allocate_cache
from kvxfer.engine.holds import hold_digest
from kvxfer.engine.leases import FreeReason
from kvxfer.engine.producer import Producer
from kvxfer.layout.presets import spec_for
from kvxfer.testing import MemoryBackend
from kvxfer.wire import Abort, Failed, PushRequest, ReadDone, encode_msg

pytestmark = pytest.mark.timeout(60)


class CountingBackend(MemoryBackend):
    drains = 0

    def get_notifs(self) -> dict[str, list[bytes]]:
        CountingBackend.drains += 1
        return super().get_notifs()


def _producer() -> Producer:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    return Producer(
        EngineConfig("idle", model_name="tiny-gqa"),
        [(spec, allocate_cache(spec))],
        backend_factory=CountingBackend,
    )


def test_an_idle_producer_drains_at_the_idle_interval() -> None:
    with _producer():
        time.sleep(0.2)  # started
        CountingBackend.drains = 0
        time.sleep(1.0)
        drains = CountingBackend.drains
    assert drains <= 1.0 / producer_mod.IDLE_S * 1.2 + 5, drains
    assert drains >= 1.0 / producer_mod.IDLE_S / 10  # it still drains (unsolicited notices)


def test_a_push_request_switches_the_drain_interval_to_busy_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _producer() as prod:
        assert prod._drain_interval() == producer_mod.IDLE_S
        push = PushRequest("r", prod.generation, "tcp://127.0.0.1:1", 0, 1, (1,), (1,))
        prod._on_msg(0, "someone", encode_msg(push), [])
        assert prod._drain_interval() == producer_mod.BUSY_S
        later = time.monotonic() + producer_mod.PUSH_ACTIVE_S + 1
        monkeypatch.setattr(producer_mod.time, "monotonic", lambda: later)
        assert prod._drain_interval() == producer_mod.IDLE_S


class FailingOnceBackend(MemoryBackend):
    """A backend whose first drain raises what no KvxferError covers (a frame that broke
    the replay guard raised OverflowError there)."""

    failures = 1

    def get_notifs(self) -> dict[str, list[bytes]]:
        if FailingOnceBackend.failures:
            FailingOnceBackend.failures -= 1
            raise OverflowError("a notification the backend could not open")
        return super().get_notifs()


def test_a_drain_that_raises_anything_never_stops_the_engine_thread() -> None:
    # that thread also ends leases: had it died, no hold would ever be freed again
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    FailingOnceBackend.failures = 1
    with Producer(EngineConfig("flaky", model_name="tiny-gqa"), [(spec, allocate_cache(spec))],
                  backend_factory=FailingOnceBackend) as prod:  # fmt: skip
        prod.hold("r", block_ids=[1], lease_s=0.3)
        assert prod.wait_freed(10)
        assert prod.pop_freed() == [("r", FreeReason.EXPIRED)]
    assert FailingOnceBackend.failures == 0  # the failing drain did run


def test_ticketed_notices_that_overtook_their_hold_count_when_it_starts() -> None:
    # vLLM hands out a hold's ticket with the params before its workers start the hold:
    # a decode that gave up (Abort) or needed no block read (ReadDone) at once names a
    # hold that does not exist yet. Dropped, they left the blocks pinned for the lease.
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    with Producer(EngineConfig("early", model_name="tiny-gqa", lease_s=60.0),
                  [(spec, allocate_cache(spec))], backend_factory=MemoryBackend) as prod:  # fmt: skip
        g = prod.generation
        gone = hold_digest(None, 1000, "gone", [1])  # the params' digest the decode sends
        hit = hold_digest(None, 1001, "hit", [2])
        prod._on_msg(0, "d", encode_msg(Abort("gone", g, "client left", 1, 1000, gone)), [])
        prod._on_msg(0, "d", encode_msg(ReadDone("hit", g, 0, 1, 1, 1001, hit)), [])
        prod._on_msg(0, "d", encode_msg(Abort("kept", g, "of another hold", 1, ticket=7)), [])
        prod.hold("gone", block_ids=[1], ticket=1000)
        prod.hold("hit", block_ids=[2], ticket=1001)
        prod.hold("kept", block_ids=[3], ticket=1002)  # its notice named ticket 7: not this hold
        freed: list[tuple[str, FreeReason]] = []
        end = time.monotonic() + 10
        while len(freed) < 2 and time.monotonic() < end:
            prod.wait_freed(0.5)
            freed += prod.pop_freed()
        assert sorted(freed) == [("gone", FreeReason.ABORTED), ("hit", FreeReason.READ)]
        assert prod.held_block_ids("kept") == frozenset({3})


def test_early_notices_are_bounded_and_expire_from_their_first_arrival() -> None:
    # a stream of notices naming one unheld hold (a key holder, or anyone unkeyed) must
    # neither grow its list nor keep it alive past EARLY_NOTICE_S from its first one
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    with Producer(EngineConfig("flood", model_name="tiny-gqa"), [(spec, allocate_cache(spec))],
                  backend_factory=MemoryBackend) as prod:  # fmt: skip
        g, t0 = prod.generation, 1000.0
        with prod._lock:
            for i in range(2000):  # 2,000 notices over 20 s
                prod._remember_early(0, Abort("flood", g, "", 1, ticket=5), t0 + i * 0.01)
            assert len(prod._early[("flood", 5)]) <= producer_mod.MAX_NOTICES_PER_HOLD
            prod._remember_early(0, Abort("other", g, "", 1, ticket=6), t0 + 20.5)
            assert ("flood", 5) not in prod._early  # its first notice came 20.5 s ago
            assert ("other", 6) in prod._early


def test_a_bound_hold_counts_no_unticketed_early_read_and_ignores_failed() -> None:
    """A hold made with a binding is freed only by notices of its params: an unticketed
    ReadDone that came before it (kept by the lease table as an early ack) freed it as
    it started, and a Failed (which producers send, never receive) freed any hold."""
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    with Producer(EngineConfig("early", model_name="tiny-gqa", lease_s=60.0),
                  [(spec, allocate_cache(spec))], backend_factory=MemoryBackend) as prod:  # fmt: skip
        g = prod.generation
        prod._on_msg(0, "x", encode_msg(ReadDone("victim", g, 0, 1, 1)), [])
        prod.hold("victim", block_ids=[1, 2], binding=b"prompt")
        prod.hold("v2", block_ids=[3], binding=b"prompt")
        prod._on_msg(0, "x", encode_msg(Failed("v2", g, "forged", 1)), [])
        assert not prod.wait_freed(0.5)
        assert prod.pop_freed() == []
        assert prod.held_block_ids("victim") and prod.held_block_ids("v2")


def test_early_notices_of_one_hold_keep_the_newest() -> None:
    """Past 64 notices for one hold not started yet, the newest were dropped: forged
    aborts ahead of it pushed the genuine decode's ReadDone out, and the hold stayed
    pinned for its lease."""
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    with Producer(EngineConfig("early", model_name="tiny-gqa", lease_s=60.0),
                  [(spec, allocate_cache(spec))], backend_factory=MemoryBackend) as prod:  # fmt: skip
        g = prod.generation
        for i in range(producer_mod.MAX_NOTICES_PER_HOLD):
            prod._on_msg(0, "x", encode_msg(Abort("victim", g, "", i + 1, 500, b"\x01" * 16)), [])
        good = hold_digest(None, 500, "victim", [1], b"prompt")
        prod._on_msg(0, "x", encode_msg(ReadDone("victim", g, 0, 1, 99, 500, good)), [])
        prod.hold("victim", block_ids=[1], binding=b"prompt", ticket=500)
        assert prod.wait_freed(2)
        assert prod.pop_freed() == [("victim", FreeReason.READ)]
