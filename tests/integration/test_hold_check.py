"""A READ is DONE only if the producer's hold was alive after the bytes were copied
(kvxfer.engine.holds), over real NIXL in this process.

The case this closes: the same params read twice (a router retrying on another decode
engine, a client sending them again). The producer frees the blocks at the first
reader's ReadDone and reuses them; before hold tickets, the second reader's READ copied
the reused bytes and was reported DONE.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer.engine import Consumer, EngineConfig, RequestState, allocate_cache
from kvxfer.errors import HoldEndedError
from kvxfer.testing import mismatches

from ..engines import local_pair

pytestmark = pytest.mark.timeout(60)

BLOCKS = [3, 4, 5]


def _wait_freed(prod, rid: str, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if any(r == rid for r, _ in prod.pop_freed()):
            return
        prod.wait_freed(0.05)
    raise AssertionError(f"{rid} was never freed")


def _reuse(prod_bufs) -> None:  # type: ignore[no-untyped-def]
    """The producer's engine reuses every block: other bytes everywhere (0xA5 is not the
    pattern's byte at most positions, so the count of mismatches below is large)."""
    for b in prod_bufs:
        b[:] = 0xA5


def test_second_reader_of_the_same_params_is_never_done() -> None:
    with local_pair(num_blocks=16) as (spec, local, prod, cons):
        other = allocate_cache(spec)
        with Consumer(EngineConfig("d2", model_name="tiny-gqa"), [(spec, other)]) as cons2:
            lease = prod.hold("r", block_ids=BLOCKS)
            assert lease.ticket > 0
            t = cons.read("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                          lease_expires_at_ns=lease.expires_at_ns, hold_ticket=lease.ticket)  # fmt: skip
            assert t.wait(10) is RequestState.DONE, t.error
            assert mismatches(spec, local, spec, BLOCKS, BLOCKS) == 0  # the first reader
            _wait_freed(prod, "r")
            _reuse(prod.ranks[0].bufs)
            t2 = cons2.read("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                            lease_expires_at_ns=lease.expires_at_ns, hold_ticket=lease.ticket)  # fmt: skip
            assert t2.wait(10) is RequestState.FAILED, (t2.state, t2.error)
            assert isinstance(t2.error, HoldEndedError)
            assert "another reader" in str(t2.error) and f"hold {lease.ticket}" in str(t2.error)
            # it did copy the reused bytes: they are there, and were not reported DONE
            assert mismatches(spec, other, spec, BLOCKS, BLOCKS) > 0


def test_read_of_an_aborted_hold_fails() -> None:
    with local_pair(num_blocks=16) as (spec, local, prod, cons):
        lease = prod.hold("r", block_ids=BLOCKS)
        assert prod.release("r")
        t = cons.read("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                      hold_ticket=lease.ticket)  # fmt: skip
        assert t.wait(10) is RequestState.FAILED, (t.state, t.error)
        assert isinstance(t.error, HoldEndedError)


def test_read_of_an_expired_hold_fails() -> None:
    """The consumer is not told the lease (so it posts); the check still catches it."""
    with local_pair(num_blocks=16) as (spec, local, prod, cons):
        lease = prod.hold("r", block_ids=BLOCKS, lease_s=0.05)
        _wait_freed(prod, "r")  # expired (after lease_margin_s)
        t = cons.read("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                      hold_ticket=lease.ticket)  # fmt: skip
        assert t.wait(10) is RequestState.FAILED, (t.state, t.error)
        assert isinstance(t.error, HoldEndedError)


def test_a_hold_that_starts_after_the_read_is_waited_for() -> None:
    """Params handed out before the hold starts (vLLM's scheduler side does): the check
    waits for the hold, then the request is DONE and the producer frees the blocks."""
    with local_pair(num_blocks=16) as (spec, local, prod, cons):
        t = cons.read("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                      hold_ticket=7)  # fmt: skip
        end = time.monotonic() + 0.3
        while time.monotonic() < end:  # the caller drives it, as vLLM's worker does
            assert t.poll() is RequestState.PENDING
            time.sleep(0.002)
        assert t.posted_at and t.num_checks >= 2  # read, checked, not held yet: checked again
        assert prod.hold("r", block_ids=BLOCKS, ticket=7).ticket == 7
        assert t.wait(10) is RequestState.DONE, t.error
        assert mismatches(spec, local, spec, BLOCKS, BLOCKS) == 0
        _wait_freed(prod, "r")  # its ReadDone came after the check


def test_a_hold_that_never_starts_times_out() -> None:
    with local_pair(num_blocks=16) as (spec, local, prod, cons):
        t = cons.read("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                      hold_ticket=9, deadline_s=0.5)  # fmt: skip
        assert t.wait(5) is RequestState.TIMEOUT, (t.state, t.error)
        assert "checking hold 9" in str(t.error)


def test_many_ticketed_reads_are_done_and_right() -> None:
    """The ordinary path: 12 holds, each read once with its ticket; every byte checked
    and every hold freed by its reader (not by the lease)."""
    with local_pair(num_blocks=48) as (spec, local, prod, cons):
        ts, leases = [], []
        for i in range(12):
            blocks = [4 * i, 4 * i + 1, 4 * i + 2]
            lease = prod.hold(f"r{i}", block_ids=blocks)
            leases.append(lease)
            ts.append((blocks, cons.read(f"r{i}", prod.address, local_block_ids=blocks,
                                         remote_block_ids=blocks, hold_ticket=lease.ticket)))  # fmt: skip
        assert len({lease.ticket for lease in leases}) == 12
        for blocks, t in ts:
            assert t.wait(10) is RequestState.DONE, t.error
            assert mismatches(spec, local, spec, blocks, blocks) == 0
        freed: dict[str, object] = {}
        end = time.monotonic() + 5
        while len(freed) < 12 and time.monotonic() < end:
            freed.update(prod.pop_freed())
            prod.wait_freed(0.05)
        assert sorted(freed) == sorted(f"r{i}" for i in range(12))
        assert {str(getattr(v, "value", v)) for v in freed.values()} == {"read"}
        words = prod.ranks[0].words
        assert all(int(words[lease.ticket % len(words), 0]) & 1 for lease in leases)  # released


def test_without_a_ticket_the_reuse_goes_unseen() -> None:
    """Why tickets: the same second read without one is DONE with the reused bytes (the
    hazard the tests above close; a caller that drops the ticket keeps it)."""
    with local_pair(num_blocks=16) as (spec, local, prod, cons):
        prod.hold("r", block_ids=BLOCKS)
        t = cons.read("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS)
        assert t.wait(10) is RequestState.DONE, t.error
        _wait_freed(prod, "r")
        _reuse(prod.ranks[0].bufs)
        local[0][:] = 0
        t2 = cons.read("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS)
        assert t2.wait(10) is RequestState.DONE, t2.error
        assert mismatches(spec, local, spec, BLOCKS, BLOCKS) > 0


def test_a_stale_readers_abort_does_not_free_a_newer_hold_of_the_same_id() -> None:
    """A client reused a request id: the reader of the ended hold fails its check and
    sends Abort naming that hold's ticket; the producer keeps the new hold, whose own
    reader is then DONE (before, the Abort named the id alone and freed the new hold)."""
    with local_pair(num_blocks=16) as (spec, local, prod, cons):
        old = prod.hold("r", block_ids=BLOCKS)
        assert prod.release("r")
        new = prod.hold("r", block_ids=BLOCKS)
        stale = cons.read("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                          hold_ticket=old.ticket)  # fmt: skip
        assert stale.wait(10) is RequestState.FAILED, (stale.state, stale.error)
        time.sleep(0.1)  # its Abort has reached the producer's engine thread
        assert prod.num_held == 1 and prod.pop_freed() == []
        t = cons.read("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                      hold_ticket=new.ticket)  # fmt: skip
        assert t.wait(10) is RequestState.DONE, t.error
        assert mismatches(spec, local, spec, BLOCKS, BLOCKS) == 0
        _wait_freed(prod, "r")


def test_a_stale_readers_renew_does_not_extend_a_newer_hold_of_the_same_id() -> None:
    """The reader of an ended hold renews the lease when it posts its READ (over its own
    deadline); the renew names that hold's ticket, so the newer hold of the same id keeps
    its own lease and is freed when it ends (before, the renew named the id alone and
    stretched the newer hold to the stale reader's deadline)."""
    with local_pair(num_blocks=16) as (_spec, _local, prod, cons):
        old = prod.hold("r", block_ids=BLOCKS)
        assert prod.release("r")
        prod.hold("r", block_ids=BLOCKS, lease_s=0.5)
        rejected = prod.num_rejected
        stale = cons.read("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                          hold_ticket=old.ticket, deadline_s=30.0)  # fmt: skip
        assert stale.wait(10) is RequestState.FAILED, (stale.state, stale.error)
        end, freed = time.monotonic() + 5.0, []
        while not freed and time.monotonic() < end:
            prod.wait_freed(0.05)
            freed = prod.pop_freed()
        assert [(rid, reason.value) for rid, reason in freed] == [("r", "expired")]
        assert prod.num_rejected >= rejected + 1  # its renew was dropped
        # its Abort names the ended hold's ticket: kept for a hold of that ticket, which
        # never comes (tickets only grow), so it freed nothing
        assert ("r", old.ticket) in prod._early


# -- push: the producer WRITEs into the consumer's blocks --------------------------------


def test_without_a_ticket_a_second_push_of_ended_params_is_done_with_reused_bytes() -> None:
    """The hazard in push mode: the producer counts a WRITE as the read and frees the
    hold; a second push of the same params (another engine, a retry) is written from
    the reused blocks and reported DONE. The tickets below close it."""
    with local_pair(num_blocks=16) as (spec, local, prod, cons):
        prod.hold("r", block_ids=BLOCKS)
        t = cons.push("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS)
        assert t.wait(10) is RequestState.DONE, t.error
        _wait_freed(prod, "r")
        _reuse(prod.ranks[0].bufs)
        local[0][:] = 0
        t2 = cons.push("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS)
        assert t2.wait(10) is RequestState.DONE, t2.error
        assert mismatches(spec, local, spec, BLOCKS, BLOCKS) > 0


def test_second_push_of_the_same_params_is_never_done() -> None:
    with local_pair(num_blocks=16) as (spec, local, prod, cons):
        other = allocate_cache(spec)
        d2 = EngineConfig("d2", model_name="tiny-gqa")
        with Consumer(d2, [(spec, other)]) as cons2:
            lease = prod.hold("r", block_ids=BLOCKS)
            t = cons.push("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                          hold_ticket=lease.ticket)  # fmt: skip
            assert t.wait(10) is RequestState.DONE, t.error
            assert mismatches(spec, local, spec, BLOCKS, BLOCKS) == 0
            _wait_freed(prod, "r")  # by the consumer's ReadDone, after its check
            _reuse(prod.ranks[0].bufs)
            t2 = cons2.push("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                            hold_ticket=lease.ticket)  # fmt: skip
            assert t2.wait(10) is RequestState.FAILED, (t2.state, t2.error)
            assert f"hold {lease.ticket}" in str(t2.error), t2.error
            assert not t2.quarantined  # the producer wrote nothing, and said so


def test_a_ticketed_push_frees_the_hold_only_after_its_check() -> None:
    """With a ticket the WRITE's completion does not free the hold (a check that came
    after the free would fail every push): the consumer's ReadDone does, after it
    checked the slot word; 6 pushes, every byte right, every hold freed as read."""
    with local_pair(num_blocks=32) as (spec, local, prod, cons):
        ts, leases = [], []
        for i in range(6):
            blocks = [4 * i, 4 * i + 1, 4 * i + 2]
            lease = prod.hold(f"r{i}", block_ids=blocks)
            leases.append(lease)
            ts.append((blocks, cons.push(f"r{i}", prod.address, local_block_ids=blocks,
                                         remote_block_ids=blocks, hold_ticket=lease.ticket)))  # fmt: skip
        for blocks, t in ts:
            assert t.wait(10) is RequestState.DONE, t.error
            assert t.num_checks == 1
            assert mismatches(spec, local, spec, blocks, blocks) == 0
        freed: dict[str, object] = {}
        end = time.monotonic() + 5
        while len(freed) < 6 and time.monotonic() < end:
            freed.update(prod.pop_freed())
            prod.wait_freed(0.05)
        assert {k: str(getattr(v, "value", v)) for k, v in freed.items()} == {
            f"r{i}": "read" for i in range(6)
        }


def test_a_push_before_its_hold_starts_is_checked_until_the_hold_starts() -> None:
    with local_pair(num_blocks=16) as (spec, local, prod, cons):
        t = cons.push("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                      hold_ticket=11)  # fmt: skip
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            assert t.poll() is RequestState.PENDING
            time.sleep(0.002)
        assert t.num_checks >= 2, t.num_checks  # written, checked, not held yet: again
        assert prod.hold("r", block_ids=BLOCKS, ticket=11).ticket == 11
        assert t.wait(10) is RequestState.DONE, t.error
        assert mismatches(spec, local, spec, BLOCKS, BLOCKS) == 0
        _wait_freed(prod, "r")


def test_a_push_of_an_expired_hold_is_refused_by_the_producer() -> None:
    with local_pair(num_blocks=16) as (spec, local, prod, cons):
        lease = prod.hold("r", block_ids=BLOCKS, lease_s=0.05)
        _wait_freed(prod, "r")
        t = cons.push("r", prod.address, local_block_ids=BLOCKS, remote_block_ids=BLOCKS,
                      hold_ticket=lease.ticket)  # fmt: skip
        assert t.wait(10) is RequestState.FAILED, (t.state, t.error)
        assert "HoldEndedError" in str(t.error) and f"hold {lease.ticket}" in str(t.error)
        assert int(local[0].view(np.uint8).max()) == 0  # nothing was written
