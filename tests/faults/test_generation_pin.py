"""A read pinned to a wrong generation fails alone (issue 9, item 10): the consumer
refetches the producer's records and compares before dropping anything, so reads that
pinned the right generation keep their peer (no re-handshake, no lost transfers)."""

from __future__ import annotations

import pytest

from kvxfer.engine.config import RequestState

from .procs import ids, make_consumer, verify, wait_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_wrong_generation_does_not_drop_the_peer(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    a = spawn(engine_id="pa").start()
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0)
    closing(cons)
    a.hold([("good", 2), ("bad", 2), ("good2", 2)])
    good = cons.read("good", a.address, local_block_ids=ids(0, 1), remote_block_ids=ids(5, 6),
                     generation=a.generation)  # fmt: skip
    assert good.wait(20) is RequestState.DONE, good.error
    bad = cons.read("bad", a.address, local_block_ids=ids(2, 3), remote_block_ids=ids(7, 8),
                    generation=a.generation ^ 1)  # fmt: skip
    good2 = cons.read("good2", a.address, local_block_ids=ids(4, 5),
                      remote_block_ids=ids(9, 10), generation=a.generation)  # fmt: skip
    wait_all([bad, good2], 10)
    assert bad.state is RequestState.PEER_LOST, (bad.state, bad.error)
    assert good2.state is RequestState.DONE, (good2.state, good2.error)
    assert good2.peer is good.peer  # the peer was never dropped: no second handshake
    assert cons._peers.get(a.address) is good.peer
    assert verify(ranks, a.remote_spec(), ids(4, 5), ids(9, 10)) == 0
