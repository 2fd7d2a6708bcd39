"""1,000 requests in flight across 4 producer processes; every byte verified, nothing lost."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer.engine.config import RequestState

from .procs import make_consumer, start_all, states, verify, wait_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NUM_PRODUCERS = 4
PER_PRODUCER = 250
BLOCKS_PER_REQUEST = 2
PRODUCER_BLOCKS = 128


def test_thousand_requests_four_producers(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    n = NUM_PRODUCERS * PER_PRODUCER
    prods = start_all([spawn(engine_id=f"p{k}", num_blocks=PRODUCER_BLOCKS) for k in range(NUM_PRODUCERS)])  # fmt: skip
    # consumer TP 2 over producer TP 1: fan-in, so every request needs 2 ReadDones to free
    cons, ranks = make_consumer("tiny-gqa", n * BLOCKS_PER_REQUEST, tp=2, deadline_s=60.0)
    closing(cons)
    rng = np.random.default_rng(7)
    reqs = []
    for k, p in enumerate(prods):
        batch = []
        for j in range(PER_PRODUCER):
            i = k * PER_PRODUCER + j
            lids = np.arange(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)
            rids = rng.choice(PRODUCER_BLOCKS, BLOCKS_PER_REQUEST, replace=False)
            batch.append((f"req-{i}", p, lids, rids))
        p.hold([(rid, BLOCKS_PER_REQUEST) for rid, *_ in batch])
        reqs += batch
    for p in prods:  # first contact outside the timed part
        cons.connect(p.address)

    t0 = time.perf_counter()
    xfers = [cons.read(rid, p.address, local_block_ids=lids, remote_block_ids=rids)
             for rid, p, lids, rids in reqs]  # fmt: skip
    wall = wait_all(xfers, 90)
    num_bytes = sum(t.num_bytes for t in xfers)
    print(f"[measure] load: {n} requests in {wall:.2f} s = {n / wall:.0f} req/s, "
          f"{num_bytes / 2**20:.0f} MiB = {num_bytes / wall / 1e9:.2f} GB/s; "
          f"p50 latency {np.median([t.latency_s for t in xfers]) * 1e3:.0f} ms")  # fmt: skip
    assert states(xfers) == {"done": n}, states(xfers)
    assert time.perf_counter() - t0 < 90
    bad = [t.request_id for t, (_, p, lids, rids) in zip(xfers, reqs, strict=True)
           if verify(ranks, p.remote_spec(), lids, rids)]  # fmt: skip
    assert bad == []
    # no leaked transfer handles on any consumer rank (NixlBackend._xfers: live handles)
    assert {d: len(c.backend._xfers) for d, c in cons.ranks.items()} == {0: 0, 1: 0}
    assert all(not t.xfers for t in xfers)
    for p in prods:
        s = p.stop(10)
        assert s["held_blocks"] == 0, s
        assert s["freed"] == PER_PRODUCER, s
        assert s["freed_by_reason"] == {"read": PER_PRODUCER}, s
        assert s["num_rejected"] == 0 and s["num_unknown_acks"] == 0, s
    assert all(t.state is RequestState.DONE for t in xfers)
