"""Engine API from issue 8: cancel, caller wait timeouts vs deadlines, hold with block
ids, release. Real NIXL; the producer runs in this process where nothing is faulted."""

from __future__ import annotations

import time

import pytest

from kvxfer import errors
from kvxfer.engine.config import EngineConfig, RequestState, allocate_cache
from kvxfer.engine.producer import Producer

from .procs import MODEL, free_port, ids, make_consumer, spec, wait_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _producer(closing):  # type: ignore[no-untyped-def]
    s = spec("tiny-gqa", 64)
    cfg = EngineConfig("pa", model_name=MODEL, lease_s=30.0)
    return closing(Producer(cfg, [(s, allocate_cache(s))]))


def test_cancel_ends_aborted_and_tells_the_producer(closing) -> None:  # type: ignore[no-untyped-def]
    prod = _producer(closing)
    cons, _ = make_consumer("tiny-gqa", 64)
    closing(cons)
    prod.hold("warm", 1)
    assert (
        cons.read("warm", prod.address, local_block_ids=ids(0), remote_block_ids=ids(1)).wait(20)
        is RequestState.DONE
    )
    prod.hold("c", 2)
    t = cons.push("c", prod.address, local_block_ids=ids(2, 3), remote_block_ids=ids(4, 5))
    t.cancel()
    assert t.state is RequestState.ABORTED
    assert isinstance(t.error, errors.KvxferError)
    with pytest.raises(errors.KvxferError):
        t.result()
    pending = f"tcp://127.0.0.1:{free_port()}"
    t2 = cons.read("x", pending, local_block_ids=ids(0), remote_block_ids=ids(1), deadline_s=30)
    t2.cancel()
    assert t2.poll() is RequestState.ABORTED


def test_wait_timeout_is_not_a_deadline(closing) -> None:  # type: ignore[no-untyped-def]
    cons, _ = make_consumer("tiny-gqa", 16, handshake_timeout_s=5.0)
    closing(cons)
    silent = f"tcp://127.0.0.1:{free_port()}"
    t = cons.read("w", silent, local_block_ids=ids(0), remote_block_ids=ids(1), deadline_s=0.5)
    with pytest.raises(errors.WaitTimeout):
        t.result(0.05)  # the caller's wait ran out; the request is still live
    assert t.state is RequestState.PENDING
    with pytest.raises(errors.DeadlineError):
        t.result()  # its own deadline
    assert t.state is RequestState.TIMEOUT


def test_hold_block_ids_refuses_other_blocks_and_release(closing) -> None:  # type: ignore[no-untyped-def]
    prod = _producer(closing)
    cons, _ = make_consumer("tiny-gqa", 64)
    closing(cons)
    lease = prod.hold("h", block_ids=[4, 5])
    assert lease.request_id == "h" and prod.held_blocks == 2
    ok = cons.push("h", prod.address, local_block_ids=ids(0, 1), remote_block_ids=ids(4, 5))
    assert ok.wait(20) is RequestState.DONE, ok.error
    prod.hold("h2", block_ids=[6])
    bad = cons.push("h2", prod.address, local_block_ids=ids(2, 3), remote_block_ids=ids(6, 7))
    wait_all([bad], 10)
    assert bad.state is RequestState.FAILED, (bad.state, bad.error)
    assert "not held" in str(bad.error)
    prod.hold("h3", block_ids=[7, 8])  # (h2 was freed by the consumer's Abort)
    assert prod.release("h3") is True
    assert prod.release("h3") is False
    until = time.monotonic() + 5
    while prod.held_blocks and time.monotonic() < until:
        time.sleep(0.01)
    assert prod.held_blocks == 0
    assert all(rid != "h3" for rid, _ in prod.pop_freed())  # the caller released it itself
