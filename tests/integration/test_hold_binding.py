"""A hold binds its ticket to the request id, block ids and an opaque binding (in vLLM:
the prompt's hash); a READ or push is DONE only for params that match what was held
(:mod:`kvxfer.engine.holds`), over real NIXL in this process, with a deployment key.

The case this closes (a security review, 2026-12-07): params pass through clients and
proxies, and a client could forge them. With any live ticket of a prefill and another
request's block ids, a decode READ those blocks, its hold check passed (the ticket's
slot word said held), and the load was DONE: another tenant's KV in the forger's
request. The same through a push. A key did not help: the decode holds it and reads
on the client's behalf.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, allocate_cache
from kvxfer.errors import ConfigError, HoldMismatchError
from kvxfer.layout.presets import spec_for
from kvxfer.testing import fill, mismatches

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32
VICTIM = [9, 10]


def _pair(mode: str):  # type: ignore[no-untyped-def]
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    pb, db = allocate_cache(spec), allocate_cache(spec)
    fill(spec, pb)
    prod = Producer(EngineConfig("p", model_name="tiny-gqa", auth_key=KEY), [(spec, pb)])
    cons = Consumer(EngineConfig("d", model_name="tiny-gqa", auth_key=KEY), [(spec, db)])
    go = cons.push if mode == "push" else cons.read
    return spec, db, prod, cons, go


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(
    "forge",
    ["another ticket", "another request id", "another binding", "blocks not held"],
)
def test_forged_params_are_never_done(mode: str, forge: str) -> None:
    spec, db, prod, cons, go = _pair(mode)
    with prod, cons:
        victim = prod.hold("victim", block_ids=VICTIM, binding=b"prompt-A")
        mine = prod.hold("mine", block_ids=[1, 2], binding=b"prompt-B")
        rid, ticket, binding, held = "victim", victim.ticket, b"prompt-A", VICTIM
        if forge == "another ticket":  # a live ticket of the forger's own request
            rid, ticket, binding = "mine", mine.ticket, b"prompt-B"
        elif forge == "another request id":
            rid = "forged"
        elif forge == "another binding":  # the victim's params, the forger's prompt
            binding = b"prompt-B"
        else:  # the victim's params naming blocks beside them
            held = [*VICTIM, 11]
        t = go(rid, prod.address, local_block_ids=[2, 3], remote_block_ids=VICTIM,
               generation=prod.generation, hold_ticket=ticket, hold_block_ids=held,
               hold_binding=binding)  # fmt: skip
        assert t.wait(20) is RequestState.FAILED, (t.state, t.error)
        if mode == "push" and forge == "another ticket":  # the producer sees it first:
            assert "blocks [9, 10] are not held for it" in str(t.error)  # 'mine' holds others
        else:
            assert isinstance(t.error, HoldMismatchError), t.error
            assert f"hold {ticket}" in str(t.error) and "do not match" in str(t.error)
        assert prod.held_block_ids("victim") is not None  # not freed by the forgery
        # the genuine reader still gets its bytes
        t2 = go("victim", prod.address, local_block_ids=[4, 5], remote_block_ids=VICTIM,
                generation=prod.generation, hold_ticket=victim.ticket,
                hold_block_ids=VICTIM, hold_binding=b"prompt-A")  # fmt: skip
        assert t2.wait(20) is RequestState.DONE, t2.error
        assert mismatches(spec, db, spec, np.array([4, 5]), np.array(VICTIM)) == 0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_read_of_part_of_a_hold_is_done(mode: str) -> None:
    """A decode with a prefix of the prompt cached reads only the rest of the held
    blocks: the params' whole list binds, the read names a part of it."""
    spec, db, prod, cons, go = _pair(mode)
    with prod, cons:
        held = [6, 7, 8, 9]
        lease = prod.hold("r", block_ids=held, binding=b"p")
        t = go("r", prod.address, local_block_ids=[1, 2], remote_block_ids=[8, 9],
               generation=prod.generation, hold_ticket=lease.ticket, hold_block_ids=held,
               hold_binding=b"p", num_cached_blocks=0)  # fmt: skip
        assert t.wait(20) is RequestState.DONE, t.error
        assert mismatches(spec, db, spec, np.array([1, 2]), np.array([8, 9])) == 0


def test_a_read_naming_blocks_outside_its_hold_list_is_refused_at_once() -> None:
    _, _, prod, cons, _ = _pair("pull")
    with prod, cons:
        lease = prod.hold("r", block_ids=[6, 7], binding=b"p")
        with pytest.raises(Exception, match=r"remote blocks \[9\] are not in hold_block_ids"):
            cons.read("r", prod.address, local_block_ids=[1, 2], remote_block_ids=[6, 9],
                      hold_ticket=lease.ticket, hold_block_ids=[6, 7], hold_binding=b"p")  # fmt: skip


def test_a_hold_without_block_ids_binds_nothing() -> None:
    """``hold(num_blocks=N)`` names no blocks: its readers are checked by ticket only
    (the behaviour before bindings; documented)."""
    spec, db, prod, cons, go = _pair("pull")
    with prod, cons:
        lease = prod.hold("r", num_blocks=2)
        t = go("r", prod.address, local_block_ids=[1, 2], remote_block_ids=[6, 7],
               hold_ticket=lease.ticket, hold_binding=b"anything")  # fmt: skip
        assert t.wait(20) is RequestState.DONE, t.error
        assert mismatches(spec, db, spec, np.array([1, 2]), np.array([6, 7])) == 0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_params_with_the_held_blocks_reordered_are_never_done(mode: str) -> None:
    """The digest bound the held ids as a set: params listing them in another order
    passed, and the decode put the right blocks in the wrong places, DONE, then cached
    them under the prompt's block hashes (a poisoned prefix). Params naming one twice
    passed too; they are refused at once now."""
    spec, db, prod, cons, go = _pair(mode)
    with prod, cons:
        lease = prod.hold("r", block_ids=[9, 10, 11], binding=b"p")
        forged = [11, 10, 9]
        t = go("r", prod.address, local_block_ids=[1, 2, 3], remote_block_ids=forged,
               generation=prod.generation, hold_ticket=lease.ticket, hold_block_ids=forged,
               hold_binding=b"p")  # fmt: skip
        assert t.wait(20) is RequestState.FAILED, (t.state, t.error)
        assert isinstance(t.error, HoldMismatchError), t.error
        with pytest.raises(ConfigError, match=r"hold_block_ids repeats block ids"):
            go("r", prod.address, local_block_ids=[1, 2, 3], remote_block_ids=[9, 10, 11],
               generation=prod.generation, hold_ticket=lease.ticket,
               hold_block_ids=[9, 9, 10, 11], hold_binding=b"p")  # fmt: skip


def test_read_ids_out_of_the_held_order_are_refused_at_once() -> None:
    _, _, prod, cons, _ = _pair("pull")
    with prod, cons:
        lease = prod.hold("r", block_ids=[9, 10, 11], binding=b"p")
        with pytest.raises(ConfigError, match=r"not in the order of hold_block_ids"):
            cons.read("r", prod.address, local_block_ids=[1, 2], remote_block_ids=[10, 9],
                      hold_ticket=lease.ticket, hold_block_ids=[9, 10, 11], hold_binding=b"p")  # fmt: skip
        with pytest.raises(ConfigError, match=r"hold_block_ids repeats block ids"):
            cons.read("r", prod.address, local_block_ids=[1], remote_block_ids=[9],
                      hold_ticket=lease.ticket, hold_block_ids=[9, 9], hold_binding=b"p")  # fmt: skip
        with pytest.raises(ConfigError, match=r"hold_block_ids must be integers"):
            cons.read("r", prod.address, local_block_ids=[1], remote_block_ids=[9],
                      hold_ticket=lease.ticket, hold_block_ids=np.array([9.0, 10.0]),
                      hold_binding=b"p")  # fmt: skip


def test_a_slot_whose_digest_reads_as_zeros_binds_no_params() -> None:
    """A fresh slot is zeros, and zeros meant "binds nothing": a check whose READ fetched
    the digest before the producer's stores and the word after them (no read order on
    RDMA) passed any params. Unbound holds write a marker of their own ticket now."""
    from kvxfer.engine.holds import DIGEST, slot_of

    spec, db, prod, cons, go = _pair("pull")
    with prod, cons:
        lease = prod.hold("r", block_ids=[9, 10], binding=b"p")
        words = prod.ranks[0].words
        words[slot_of(lease.ticket, len(words)), DIGEST] = 0  # the torn read's view
        t = go("r2", prod.address, local_block_ids=[1, 2], remote_block_ids=[9, 10],
               hold_ticket=lease.ticket, hold_block_ids=[9, 10], hold_binding=b"forged")  # fmt: skip
        assert t.wait(20) is RequestState.FAILED, (t.state, t.error)
        assert isinstance(t.error, HoldMismatchError), t.error


def test_a_peer_dropped_while_a_check_waits_leaks_no_check_slot() -> None:
    """A hold not started yet (vLLM hands out params first) makes the reader check again
    1 ms later; a peer dropped meanwhile made that check take a landing slot, then fail
    (KeyError) before the slot was recorded: it stayed in use for good (4,096 such
    drops, and every ticketed load on the rank failed)."""
    _, _, prod, cons, _ = _pair("pull")
    with prod, cons:
        cache = cons.ranks[0]
        for k in range(3):
            peer = cons.connect(prod.address)
            t = cons.read(f"r{k}", prod.address, local_block_ids=[3, 4], remote_block_ids=[1, 2],
                          hold_ticket=100 + k, hold_block_ids=[1, 2])  # fmt: skip
            for _ in range(2000):  # until its first check said "not yet"
                t.poll()
                if t.check_after:
                    break
                time.sleep(0.001)
            assert t.check_after, (t.state, t.error)
            cons._drop_peer(peer)
            time.sleep(0.005)
            assert t.poll() is RequestState.PEER_LOST, t.error
        assert cache.words_busy == {}


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_forged_request_that_gives_up_frees_nothing(mode: str) -> None:
    """A forged request (the victim's request id, ticket and blocks, another prompt's
    binding) that ends before its check (cancelled: its client went away; or its
    deadline) sent an Abort the producer obeyed: the victim's hold was freed and its
    genuine reader failed. Abort and LeaseRenew carry the params' digest now."""
    spec, db, prod, cons, go = _pair(mode)
    with prod, cons:
        victim = prod.hold("victim", block_ids=VICTIM, binding=b"prompt-A")
        cons.connect(prod.address)
        t = go("victim", prod.address, local_block_ids=[2, 3], remote_block_ids=VICTIM,
               generation=prod.generation, hold_ticket=victim.ticket, hold_block_ids=VICTIM,
               hold_binding=b"prompt-B")  # fmt: skip
        while not t.posted_at and not t.state.is_terminal:  # posted, not judged yet
            t.poll()
        assert t.cancel() is RequestState.ABORTED
        time.sleep(0.5)  # the Abort is in; a freed hold would be reported here
        assert prod.held_block_ids("victim") is not None
        assert [rid for rid, _ in prod.pop_freed()] == []
        t2 = go("victim", prod.address, local_block_ids=[4, 5], remote_block_ids=VICTIM,
                generation=prod.generation, hold_ticket=victim.ticket,
                hold_block_ids=VICTIM, hold_binding=b"prompt-A")  # fmt: skip
        assert t2.wait(20) is RequestState.DONE, t2.error
        assert mismatches(spec, db, spec, np.array([4, 5]), np.array(VICTIM)) == 0


def test_a_bound_hold_obeys_no_unticketed_notice_and_refuses_an_unticketed_push() -> None:
    """A hold made with a binding (vLLM's always are) is the params' alone: an
    unticketed read's ReadDone, an unticketed abort or renew, freed or extended it, and
    an unticketed push wrote from it (the binding bypassed by leaving the ticket out)."""
    spec, db, prod, cons, _ = _pair("pull")
    with prod, cons:
        prod.hold("victim", block_ids=VICTIM, binding=b"prompt-A")
        t = cons.read("victim", prod.address, local_block_ids=[2, 3], remote_block_ids=VICTIM)
        t.wait(20)  # a one-sided READ without a ticket cannot be checked: documented
        p = cons.push("victim", prod.address, local_block_ids=[4, 5], remote_block_ids=VICTIM)
        assert p.wait(20) is RequestState.FAILED, (p.state, p.error)
        assert "names no hold ticket" in str(p.error)
        time.sleep(0.3)
        assert prod.held_block_ids("victim") is not None  # not freed by either
        assert [rid for rid, _ in prod.pop_freed()] == []


def test_a_ticketed_read_of_nothing_frees_no_hold() -> None:
    """Nothing to read: no hold check, and its ReadDone (to every rank it notifies) freed
    the hold whatever params it named. ReadDone carries the params' digest now."""
    _, _, prod, cons, go = _pair("pull")
    with prod, cons:
        victim = prod.hold("victim", block_ids=VICTIM, binding=b"prompt-A")
        t = go("victim", prod.address, local_block_ids=[], remote_block_ids=[],
               hold_ticket=victim.ticket, hold_block_ids=VICTIM, hold_binding=b"forger")  # fmt: skip
        t.wait(20)
        time.sleep(0.3)
        assert prod.held_block_ids("victim") is not None
        assert [rid for rid, _ in prod.pop_freed()] == []


def test_a_block_id_past_int64_is_refused_and_nothing_is_held() -> None:
    _, _, prod, cons, _ = _pair("pull")
    with prod, cons:
        with pytest.raises(ConfigError, match="must fit int64"):
            prod.hold("r", block_ids=[2**63], binding=b"p")
        assert prod.num_held == 0
        assert prod.hold("r", block_ids=[1], binding=b"p").ticket > 0  # the id is free


@pytest.mark.parametrize("ticketed", [True, False])
def test_requests_of_a_dropped_peer_end_peer_lost(ticketed: bool) -> None:
    """A peer dropped while a request was about to post (a restart another request's
    recheck found) released its lists; the request then failed with a misleading
    error ("publishes no hold table (an older kvxfer?)", or an internal KeyError)."""
    _, _, prod, cons, _ = _pair("pull")
    with prod, cons:
        cons.connect(prod.address)
        lease = prod.hold("r", block_ids=[1, 2])
        with cons._engine_lock:
            t = cons.read("r", prod.address, local_block_ids=[3, 4], remote_block_ids=[1, 2],
                          generation=prod.generation,
                          hold_ticket=lease.ticket if ticketed else None)  # fmt: skip
            cons._drop_peer(t.peer)  # as _recheck does for another request
        assert t.wait(10) is RequestState.PEER_LOST, (t.state, t.error)
        assert "dropped" in str(t.error)
