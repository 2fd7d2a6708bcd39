"""SIGKILL a producer between requests and mid-transfer; a second producer is unaffected.

The consumer must end the killed producer's requests PEER_LOST (or FAILED) within
``DETECT_BOUND_S`` of the kill, hang nowhere, and keep completing the other
producer's requests byte-exact.
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from kvxfer.engine.config import RequestState

from .procs import clear, ids, make_consumer, start_all, states, verify, wait_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

DETECT_BOUND_S = 5.0
LOST = (RequestState.PEER_LOST, RequestState.FAILED)


def _b_requests(cons, b, base: int, n: int, tag: str):  # type: ignore[no-untyped-def]
    """``n`` two-block requests to producer ``b`` into local blocks ``base ..``."""
    b.hold([(f"{tag}{i}", 2) for i in range(n)])
    return [
        (
            cons.read(f"{tag}{i}", b.address, local_block_ids=ids(base + 2 * i, base + 2 * i + 1),
                      remote_block_ids=ids(i % b.num_blocks, (i + 1) % b.num_blocks)),
            ids(base + 2 * i, base + 2 * i + 1),
            ids(i % b.num_blocks, (i + 1) % b.num_blocks),
        )
        for i in range(n)
    ]  # fmt: skip


def _check_b(ranks, b, reqs) -> None:  # type: ignore[no-untyped-def]
    assert states(t for t, _, _ in reqs) == {"done": len(reqs)}
    for t, lids, rids in reqs:
        assert verify(ranks, b.remote_spec(), lids, rids) == 0, t.request_id


def test_kill_between_requests(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    a, b = start_all([spawn(engine_id="pa"), spawn(engine_id="pb")])
    cons, ranks = make_consumer("tiny-gqa", 128, handshake_timeout_s=2.0)
    closing(cons)
    a.hold([("a0", 4), ("a1", 4), ("a2", 4)])
    t = cons.read(
        "a0", a.address, local_block_ids=ids(0, 1, 2, 3), remote_block_ids=ids(9, 8, 7, 6)
    )
    before = _b_requests(cons, b, 64, 8, "b-before-")
    wait_all([t] + [x for x, _, _ in before], 20)
    assert t.state is RequestState.DONE
    assert verify(ranks, a.remote_spec(), ids(0, 1, 2, 3), ids(9, 8, 7, 6)) == 0
    _check_b(ranks, b, before)

    a.kill()  # between requests: nothing of A's is in flight
    t_kill = time.perf_counter()
    lost = cons.read("a1", a.address, local_block_ids=ids(4, 5, 6, 7), remote_block_ids=ids(1, 2, 3, 4))  # fmt: skip
    during = _b_requests(cons, b, 80, 8, "b-during-")
    wait_all([lost] + [x for x, _, _ in during], DETECT_BOUND_S + 5)
    detect_s = lost.finished_at - t_kill
    print(f"[measure] kill between requests: {lost.state.value} after {detect_s * 1e3:.1f} ms ({lost.error})")  # fmt: skip
    assert lost.state in LOST, (lost.state, lost.error)
    assert detect_s < DETECT_BOUND_S
    _check_b(ranks, b, during)

    # A is gone for good: the next request re-handshakes, gets no reply, ends in bounded time
    t0 = time.perf_counter()
    again = cons.read("a2", a.address, local_block_ids=ids(4, 5), remote_block_ids=ids(1, 2))
    wait_all([again], 10)
    print(f"[measure] request to a dead address: {again.state.value} after {time.perf_counter() - t0:.2f} s")  # fmt: skip
    assert again.state in (*LOST, RequestState.TIMEOUT), again.state
    assert time.perf_counter() - t0 < cons.config.handshake_timeout_s + 1.5

    after = _b_requests(cons, b, 96, 8, "b-after-")
    wait_all([x for x, _, _ in after], 20)
    _check_b(ranks, b, after)
    stats = b.stop()
    assert stats["held_blocks"] == 0
    assert stats["freed_by_reason"] == {"read": 24}
    assert all(not c.backend._xfers for c in cons.ranks.values())


def test_kill_mid_transfer(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """A 128 MiB read (llama3-8b, 64 blocks of 2 MiB) is cut by SIGKILL once bytes land."""
    nb = 64
    a, b = start_all([
        spawn(engine_id="pa", preset="llama3-8b", num_blocks=nb, fill="const"),
        spawn(engine_id="pb", preset="llama3-8b", num_blocks=8),
    ])  # fmt: skip
    cons, ranks = make_consumer("llama3-8b", nb + 24, handshake_timeout_s=2.0)
    closing(cons)
    cons.connect(a.address)
    cons.connect(b.address)
    warm = _b_requests(cons, b, nb, 4, "b-warm-")
    wait_all([x for x, _, _ in warm], 20)
    _check_b(ranks, b, warm)

    a.hold([("big", nb)])
    first = ranks[0][1][0]  # region 0 is read first: its first byte turns 0xAB
    during = _b_requests(cons, b, nb + 8, 4, "b-during-")
    big = cons.read("big", a.address, local_block_ids=np.arange(nb), remote_block_ids=np.arange(nb))  # fmt: skip
    killed: dict[str, float] = {}

    def killer() -> None:
        until = time.monotonic() + 10
        while first[0] == 0 and time.monotonic() < until:
            pass  # the poster releases the GIL inside NIXL's post
        a.signal(signal.SIGKILL)
        killed["at"] = time.perf_counter()

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    wait_all([x for x, _, _ in during] + [big], DETECT_BOUND_S + 10)
    th.join(15)
    landed = sum(int(np.count_nonzero(buf[: big.num_bytes // len(ranks[0][1])])) for buf in ranks[0][1])  # fmt: skip
    detect_s = big.finished_at - killed["at"]
    print(f"[measure] kill mid-transfer: {big.state.value} after {detect_s * 1e3:.1f} ms, "
          f"{landed / 2**20:.1f} of {big.num_bytes / 2**20:.0f} MiB had landed ({big.error})")  # fmt: skip
    assert big.state in LOST, (big.state, big.error)
    assert 0 < landed < big.num_bytes  # the kill did cut the transfer
    assert detect_s < DETECT_BOUND_S
    _check_b(ranks, b, during)

    clear(ranks)
    after = _b_requests(cons, b, nb, 8, "b-after-")
    wait_all([x for x, _, _ in after], 20)
    _check_b(ranks, b, after)
    a.proc.join(10)
    assert b.stop()["freed_by_reason"] == {"read": 16}
    assert all(not c.backend._xfers for c in cons.ranks.values())
