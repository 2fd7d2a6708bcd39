"""A producer restarts on the same address: the consumer re-handshakes with the new
generation, and nothing of the old generation completes.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.engine.config import RequestState

from .procs import free_port, ids, make_consumer, verify

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MAX_ATTEMPTS = 4


def test_restart_same_address(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    addr = f"tcp://127.0.0.1:{free_port()}"
    a = spawn(engine_id="prefill", address=addr).start()
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0)
    closing(cons)
    a.hold([("r0", 2), ("old", 2)])
    t = cons.read("r0", addr, local_block_ids=ids(0, 1), remote_block_ids=ids(3, 4))
    assert t.wait(20) is RequestState.DONE
    assert verify(ranks, a.remote_spec(), ids(0, 1), ids(3, 4)) == 0
    assert cons.connect(addr).generation == a.generation

    # made (and first contact cached) before the restart; polled only after recovery
    old = cons.read("old", addr, local_block_ids=ids(8, 9), remote_block_ids=ids(5, 6))
    a.kill()
    b = spawn(engine_id="prefill", address=addr).start()  # same engine id, new generation
    assert b.address == addr
    assert b.generation != a.generation

    # the router retries a request that ended PEER_LOST/FAILED with the same ids
    names = [f"r{i}" for i in range(1, 6)]
    b.hold([(n, 2) for n in names])
    failures = 0
    for i, name in enumerate(names):
        lids, rids = ids(10 + 2 * i, 11 + 2 * i), ids(i, i + 7)
        for _ in range(MAX_ATTEMPTS):
            t = cons.read(name, addr, local_block_ids=lids, remote_block_ids=rids)
            if t.wait(20) is RequestState.DONE:
                break
            assert t.state in (RequestState.PEER_LOST, RequestState.FAILED), (t.state, t.error)
            failures += 1
        assert t.state is RequestState.DONE, (name, t.error)
        assert verify(ranks, b.remote_spec(), lids, rids) == 0
    print(f"[measure] restart: {failures} failed attempt(s) before recovery")
    assert failures <= 1
    assert cons.connect(addr).generation == b.generation

    # the pre-restart Transfer must not complete against the new incarnation
    assert old.wait(10) in (RequestState.PEER_LOST, RequestState.FAILED), old.state
    assert all(np.count_nonzero(buf) == 0 for buf in _blocks(ranks, 8, 10))
    stats = b.stop()
    assert stats["held_blocks"] == 0
    assert stats["freed_by_reason"] == {"read": 5}
    assert stats["num_rejected"] == 0  # nothing stale (old generation) reached B's table


def _blocks(ranks, lo: int, hi: int):  # type: ignore[no-untyped-def]
    """Bytes of local blocks [lo, hi) in every region of every rank (split K/V)."""
    for s, bufs in ranks:
        n = s.kernel_block_bytes
        for buf in bufs:
            yield buf[lo * n : hi * n]


def test_read_pinned_to_generation(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """A request knows its producer generation (the router got it with the prefill).

    After a restart: a request of the old generation is refused (PEER_LOST) even when the
    consumer has already re-handshaked, and a request of the new generation succeeds on the
    first attempt (the stale cached peer is replaced, not reported as a failure).
    """
    addr = f"tcp://127.0.0.1:{free_port()}"
    a = spawn(engine_id="prefill", address=addr).start()
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0)
    closing(cons)
    a.hold([("r0", 2), ("stale", 2)])
    t = cons.read("r0", addr, local_block_ids=ids(0, 1), remote_block_ids=ids(3, 4), generation=a.generation)  # fmt: skip
    assert t.wait(20) is RequestState.DONE
    a.kill()
    b = spawn(engine_id="prefill", address=addr).start()
    b.hold([("r1", 2), ("r2", 2)])
    t = cons.read("r1", addr, local_block_ids=ids(2, 3), remote_block_ids=ids(3, 4), generation=b.generation)  # fmt: skip
    assert t.wait(20) is RequestState.DONE  # first attempt, no PEER_LOST
    assert verify(ranks, b.remote_spec(), ids(2, 3), ids(3, 4)) == 0
    stale = cons.read("stale", addr, local_block_ids=ids(4, 5), remote_block_ids=ids(3, 4), generation=a.generation)  # fmt: skip
    assert stale.wait(20) is RequestState.PEER_LOST


def test_heartbeat_notices_restart_while_idle(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """With no request in flight, side-channel heartbeats notice the new generation, so
    the first request after the restart succeeds on its first attempt."""
    import time

    addr = f"tcp://127.0.0.1:{free_port()}"
    a = spawn(engine_id="prefill", address=addr).start()
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0, heartbeat_s=0.2)
    closing(cons)
    a.hold([("r0", 2)])
    assert (
        cons.read("r0", addr, local_block_ids=ids(0, 1), remote_block_ids=ids(3, 4)).wait(20)
        is RequestState.DONE
    )
    a.kill()
    b = spawn(engine_id="prefill", address=addr).start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:  # the monitor drops the stale peer within a few beats
        with cons._lock:
            peer = cons._peers.get(addr)
        if peer is None:
            break
        time.sleep(0.05)
    detect_s = time.monotonic() - t0
    print(
        f"[measure] heartbeat noticed the restart {detect_s * 1e3:.0f} ms after the new producer started"
    )
    assert detect_s < 5
    b.hold([("r1", 2)])
    t = cons.read("r1", addr, local_block_ids=ids(5, 6), remote_block_ids=ids(7, 8))
    assert t.wait(20) is RequestState.DONE, t.error
    assert verify(ranks, b.remote_spec(), ids(5, 6), ids(7, 8)) == 0
    assert cons.connect(addr).generation == b.generation
