"""The producer's table of push consumers (``PushWorker._peers``, owned by its push
thread): a refetch of a consumer that did not restart keeps its entry (and the WRITEs
in flight to it), and the table is bounded, the least recently used idle consumer
forgotten first. Engines over the in-memory backend, real ZMQ side channels."""

from __future__ import annotations

from typing import ClassVar

import pytest

from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, allocate_cache
from kvxfer.engine import pusher as pusher_mod
from kvxfer.layout.presets import spec_for
from kvxfer.testing import MemoryBackend, fill, mismatches
from kvxfer.transport.side_client import fetch_records

pytestmark = pytest.mark.timeout(60)

SPEC = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)


class RemovalLog(MemoryBackend):
    """A memory backend that records the remote agents it is told to forget."""

    removed: ClassVar[list[str]] = []

    def remove_remote(self, name: str) -> None:
        RemovalLog.removed.append(name)
        super().remove_remote(name)


def _producer() -> Producer:
    bufs = allocate_cache(SPEC)
    fill(SPEC, bufs)
    return Producer(EngineConfig("pp", model_name="tiny-gqa"), [(SPEC, bufs)],
                    backend_factory=RemovalLog)  # fmt: skip


def _consumer(name: str) -> Consumer:
    return Consumer(EngineConfig(name, model_name="tiny-gqa"), [(SPEC, allocate_cache(SPEC))],
                    backend_factory=MemoryBackend)  # fmt: skip


def _push(prod: Producer, cons: Consumer, rid: str, local: int, remote: int) -> None:
    prod.hold(rid, block_ids=[remote])
    t = cons.push(rid, prod.address, local_block_ids=[local], remote_block_ids=[remote])
    assert t.wait(20) is RequestState.DONE, t.error
    assert mismatches(SPEC, cons.ranks[0].bufs, SPEC, [local], [remote]) == 0


def test_a_refetch_of_a_consumer_that_did_not_restart_keeps_its_entry() -> None:
    # a PushRequest naming another generation of a known consumer (a stale one) makes
    # the push thread fetch its records again; the same incarnation answers: its entry,
    # agents and any WRITE in flight to it must stay (they were dropped and released
    # without a Cancelled, leaving the consumer's pushes quarantined)
    RemovalLog.removed = []
    with _producer() as prod, _consumer("c1") as cons:
        _push(prod, cons, "a", 1, 2)
        pusher = prod._pusher
        entry = pusher._peers[cons.address]
        recs = fetch_records(cons.address, None, prod.compat_hash, 5.0)
        pusher._jobs.put(("fetched", (cons.address, recs)))  # as the stale request's fetch
        _push(prod, cons, "b", 3, 4)  # after it on the push thread's queue
        assert pusher._peers[cons.address] is entry
        assert RemovalLog.removed == []


def test_the_consumer_table_forgets_the_least_recently_used_idle_consumer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pusher_mod, "MAX_CONSUMERS", 2)
    RemovalLog.removed = []
    with _producer() as prod, _consumer("c1") as c1, _consumer("c2") as c2, _consumer("c3") as c3:
        pusher = prod._pusher
        _push(prod, c1, "a", 1, 2)
        _push(prod, c2, "b", 1, 3)
        _push(prod, c1, "c", 2, 4)  # c1 used again: c2 is now the least recently used
        c2_agents = set(pusher._peers[c2.address].agents.values())
        _push(prod, c3, "d", 1, 5)
        assert list(pusher._peers) == [c1.address, c3.address]
        assert set(RemovalLog.removed) == c2_agents
        _push(prod, c2, "e", 3, 6)  # a forgotten consumer is contacted again: still exact
        assert len(pusher._peers) == 2 and c2.address in pusher._peers


def test_a_deadline_past_an_hour_is_refused_by_name() -> None:
    # budgets travel as at most an hour (MAX_BUDGET_MS: a forged renew of 2**64-1 ms held
    # blocks for good), and a push's budget is sent once: a longer deadline is refused
    # where it is given, not clipped on the wire
    from kvxfer.errors import ConfigError

    with _producer() as prod, _consumer("c1") as cons:
        prod.hold("long", block_ids=[6])
        with pytest.raises(ConfigError, match="deadline_s must be at most 3600 seconds, got 7200"):
            cons.push("long", prod.address, local_block_ids=[2], remote_block_ids=[6],
                      deadline_s=7200.0)  # fmt: skip
        t = cons.push("long", prod.address, local_block_ids=[2], remote_block_ids=[6],
                      deadline_s=3600.0)  # fmt: skip
        assert t.wait(20) is RequestState.DONE, t.error
        assert mismatches(SPEC, cons.ranks[0].bufs, SPEC, [2], [6]) == 0
    with pytest.raises(ConfigError, match="deadline_s must be at most 3600 seconds"):
        EngineConfig("x", deadline_s=3601.0).check()


def test_forgetting_a_consumer_releases_its_lists_on_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over real NIXL: forgetting a consumer released the lists naming its agent, not
    the producer's own half of each pair (1, 2, ... 6 lists for one consumer known)."""
    monkeypatch.setattr(pusher_mod, "MAX_CONSUMERS", 1)
    bufs = allocate_cache(SPEC)
    fill(SPEC, bufs)

    def nixl_consumer(name: str) -> Consumer:
        return Consumer(EngineConfig(name, model_name="tiny-gqa"), [(SPEC, allocate_cache(SPEC))])

    with (
        Producer(EngineConfig("pp", model_name="tiny-gqa"), [(SPEC, bufs)]) as prod,
        nixl_consumer("c1") as c1,
        nixl_consumer("c2") as c2,
    ):
        backend = prod.ranks[0].backend
        counts = []
        for i in range(6):
            _push(prod, (c1, c2)[i % 2], f"r{i}", i % 16, (i + 5) % 16)
            counts.append(len(backend._prepared))
        assert len(prod._pusher._peers) == 1
        assert counts[2:] == counts[1:-1], counts  # bounded: one consumer's pair at a time


def test_a_consumer_whose_agents_fail_to_load_leaves_none_loaded() -> None:
    """Adding a consumer loads each of its records' agents; one that failed midway left
    the earlier ones loaded for good (the peer was never installed, so nothing removed
    them; found by a review). Real NIXL."""
    import msgspec

    from kvxfer.engine.push_peer import consumer_peer
    from kvxfer.errors import KvxferError
    from tests.engines import local_pair

    with local_pair() as (_, _, prod, cons):
        (rec,) = fetch_records(cons.address, None, cons.compat_hash, 5.0)
        bad = msgspec.structs.replace(rec, agent_name="broken", agent_metadata=b"not nixl")
        backend = prod.ranks[0].backend
        before = set(backend._remotes)
        with pytest.raises(KvxferError):
            consumer_peer(cons.address, [rec, bad], {0: prod.ranks[0]}, 1)
        assert set(backend._remotes) == before


def test_a_push_from_the_wrong_agent_leaves_no_pending_cancel_mark() -> None:
    """A push naming another rank's agent failed after its job's sender was blanked, so
    its pending mark (keyed by sender) was never removed: a peer could grow the exact
    cancel set without bound (found by a review of this change)."""
    import time

    from kvxfer.engine.push_peer import ConsumerPeer
    from kvxfer.engine.pusher import PushWorker
    from kvxfer.wire import PushRequest

    w = PushWorker({}, 1, "h", 1.0, lambda *a: None)
    try:
        w._peers["tcp://c:1"] = ConsumerPeer({0: "real-agent"}, {}, 0)
        for i in range(3):
            req = PushRequest(f"r{i}", 1, "tcp://c:1", 0, 1, (1,), (1,), attempt=100 + i)
            w.submit(0, "forger", req, time.monotonic() + 10)
        end = time.monotonic() + 5
        while w.num_failed < 3 and time.monotonic() < end:
            time.sleep(0.01)
        assert w.num_failed == 3
        assert dict(w._pending) == {}
        w.cancel(0, "forger", "r0", 100)
        assert w._cancelled_pending == set()
    finally:
        w.close()
