"""A producer engine whose TP ranks live in separate processes, one side channel each
(as in vLLM: one worker process per rank). The consumer is given every endpoint."""

from __future__ import annotations

import pytest

from kvxfer.engine.config import RequestState

from .procs import ids, make_consumer, spec, verify

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.mark.parametrize("consumer_tp", [1, 4], ids=["fan-out-2to1", "fan-in-2to4"])
@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_one_process_per_producer_rank(spawn, closing, consumer_tp: int, write: bool) -> None:  # type: ignore[no-untyped-def]
    procs = [spawn(engine_id="prefill", tp=2, ranks=[r]).start() for r in range(2)]
    assert procs[0].generation != procs[1].generation  # two incarnations, one engine
    address = ",".join(p.address for p in procs)
    cons, ranks = make_consumer("tiny-gqa", 64, tp=consumer_tp)
    closing(cons)
    for p in procs:
        p.hold([("r0", 3), ("r1", 3)])
    for name, lids, rids in (
        ("r0", ids(1, 2, 3), ids(9, 4, 7)),
        ("r1", ids(10, 11, 12), ids(0, 5, 6)),
    ):
        start = cons.push if write else cons.read
        t = start(name, address, local_block_ids=lids, remote_block_ids=rids)
        assert t.wait(20) is RequestState.DONE, t.error
        assert verify(ranks, spec("tiny-gqa", 64, 0, 2), lids, rids) == 0
    peer = cons.connect(address)
    assert peer.generations == {0: procs[0].generation, 1: procs[1].generation}
    for p in procs:  # every producer rank heard from every expected consumer rank
        stats = p.wait_free()
        assert stats["held_blocks"] == 0, stats
    # a request pinned to the old generation map is refused once a rank restarts
    pinned = {0: procs[0].generation, 1: procs[1].generation}
    procs[1].kill()
    t = cons.read(
        "r2", address, local_block_ids=ids(20), remote_block_ids=ids(1), generation=pinned
    )
    assert t.wait(20) in (RequestState.PEER_LOST, RequestState.FAILED)
