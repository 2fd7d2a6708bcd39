"""Hold tickets (kvxfer.engine.holds): slot words, verdicts, the ticket book, and the
words a producer writes (in-memory backend: no NIXL needed for the bookkeeping)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.engine import EngineConfig, Producer, allocate_cache
from kvxfer.engine.holds import (
    HoldVerdict,
    TicketBook,
    held_word,
    released_word,
    slot_of,
    verdict,
)
from kvxfer.errors import ConfigError
from kvxfer.layout.presets import spec_for
from kvxfer.testing import MemoryBackend


@given(st.integers(1, 2**61), st.integers(1, 2**61))
def test_verdict_of_a_slot_word(ticket: int, other: int) -> None:
    assert verdict(held_word(ticket), ticket) is HoldVerdict.HELD
    assert verdict(released_word(ticket), ticket) is HoldVerdict.RELEASED
    # another ticket's word: a newer one means ours ended, an older one that ours has
    # not started (whether that ticket is held or released)
    want = HoldVerdict.RELEASED if other > ticket else HoldVerdict.NOT_YET
    if other != ticket:
        assert verdict(held_word(other), ticket) is want
        assert verdict(released_word(other), ticket) is want
    assert verdict(0, ticket) is HoldVerdict.NOT_YET  # a slot never used


def test_ticket_book_takes_free_slots_with_growing_tickets() -> None:
    book = TicketBook(3)
    assert [book.take() for _ in range(3)] == [1, 2, 3]
    with pytest.raises(ConfigError, match="all 3 hold slots are in use"):
        book.take()
    assert book.free(2) and not book.free(2)  # idempotent
    assert book.take() == 5  # 4 is slot 1 (ticket 1 lives there): skipped
    assert slot_of(5, 3) == 2


def test_ticket_book_refuses_tickets_a_reader_could_confuse() -> None:
    book = TicketBook(4)
    book.claim(6)  # slot 2
    with pytest.raises(ConfigError, match="slot 2 is in use by ticket 6"):
        book.claim(10)
    book.free(6)
    with pytest.raises(ConfigError, match="not newer than slot 2's last"):
        book.claim(2)  # a reader of ticket 6 would take its word for ticket 2's
    for bad in (0, -3, 2**62, True, "7"):
        with pytest.raises(ConfigError, match="hold ticket must be an integer"):
            book.claim(bad)  # type: ignore[arg-type]
    book.claim(10)
    assert book.take() == 11  # the next ticket is past every claimed one


def _producer(slots: int = 8) -> tuple[Producer, object]:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    bufs = allocate_cache(spec)
    cfg = EngineConfig("p", model_name="tiny-gqa", hold_slots=slots, lease_s=30)
    return Producer(cfg, [(spec, bufs)], backend_factory=MemoryBackend), bufs


def test_producer_writes_the_slot_word_before_reporting_a_release() -> None:
    prod, _bufs = _producer()
    with prod:
        words = prod.ranks[0].words
        assert len(words) == 8
        a = prod.hold("a", block_ids=[1])
        b = prod.hold("b", block_ids=[2], ticket=20)
        assert (a.ticket, b.ticket) == (1, 20)
        assert int(words[1, 0]) == held_word(1) and int(words[20 % 8, 0]) == held_word(20)
        assert prod.release("a")  # the caller frees the blocks itself
        assert int(words[1, 0]) == released_word(1)
        c = prod.hold("c", block_ids=[3], lease_s=0.01)  # next ticket: 21 (slot 5)
        assert c.ticket == 21
        end = time.monotonic() + 5
        freed: list[str] = []
        while "c" not in freed and time.monotonic() < end:
            prod.wait_freed(0.05)
            freed += [rid for rid, _ in prod.pop_freed()]
        assert "c" in freed
        assert int(words[21 % 8, 0]) == released_word(21)  # written before pop_freed had it
        assert int(words[20 % 8, 0]) == held_word(20)  # b untouched


def test_producer_refuses_a_bad_ticket_and_holds_nothing() -> None:
    prod, _bufs = _producer(slots=4)
    with prod:
        prod.hold("a", block_ids=[1], ticket=5)  # slot 1
        with pytest.raises(ConfigError, match="slot 1 is in use"):
            prod.hold("b", block_ids=[2], ticket=9)
        assert prod.num_held == 1 and prod.held_block_ids("b") is None
        with pytest.raises(ConfigError, match="already held"):
            prod.hold("a", block_ids=[2], ticket=6)
        assert prod.num_held == 1
        with pytest.raises(ConfigError, match="hold_slots must be an integer"):
            EngineConfig("p", hold_slots=0).check()


def test_a_request_id_held_again_right_after_release_stays_held() -> None:
    """release() then hold() of the same id before the engine thread ran: the first
    hold's end must not be taken for the second's (it was, with the release reported
    into the lease table and collected later under the id)."""
    prod, _bufs = _producer()
    with prod:
        prod.hold("r", block_ids=[1])
        assert prod.release("r")
        prod.hold("r", block_ids=[1])
        time.sleep(0.05)  # the engine thread collects (every 2 ms)
        assert prod.num_held == 1 and prod.pop_freed() == []


def test_ticket_book_refuses_a_ticket_whose_hold_never_starts() -> None:
    # the slot then says the ticket ended: it may not be claimed later (its word would
    # go back from "released" to "held"), nor refused while a live hold uses the slot
    book = TicketBook(4)
    assert book.refuse(3) is True
    with pytest.raises(ConfigError, match="not newer than slot 3's last"):
        book.claim(3)
    assert book.refuse(3) is False  # already past
    assert book.take() == 4  # tickets go on past the refused one
    assert book.refuse(8) is False  # slot 0 is live
    book.claim(7)  # slot 3, newer: fine
    book.free(7)
    assert book.refuse(3) is False  # slot 3 is past it


def test_a_check_slot_in_use_is_never_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Check slots were handed out round-robin: after 4,096 checks a slot still waiting
    for its READ (a stalled producer) was zeroed and given to another check, whose word
    (another producer's, the same ticket number) could then be judged for the first."""
    from kvxfer.engine.rank import RankCache
    from kvxfer.errors import TransferError

    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=4)
    cache = RankCache(spec, allocate_cache(spec), "d", EngineConfig("d", model_name="m"),
                      MemoryBackend, words=3)  # fmt: skip
    try:
        taken = [cache.next_word() for _ in range(3)]
        assert sorted(taken) == [0, 1, 2]
        with pytest.raises(TransferError, match="all 3 hold-check slots are in use"):
            cache.next_word()
        cache.free_word(1)
        assert cache.next_word() == 1
        cache.free_word(2, quarantine_s=30.0)  # released in flight: may still land
        with pytest.raises(TransferError):
            cache.next_word()
        now = time.monotonic()
        monkeypatch.setattr(time, "monotonic", lambda: now + 31.0)
        assert cache.next_word() == 2
    finally:
        cache.close()


def test_hold_digest_binds_each_field() -> None:
    from kvxfer.engine.holds import hold_digest, unbound_digest

    base = hold_digest(b"k" * 16, 7, "req", [1, 2, 3], b"prompt")
    assert len(base) == 16 and base != bytes(16)
    assert hold_digest(b"k" * 16, 7, "req", (1, 2, 3), b"prompt") == base
    for other in (
        hold_digest(b"k" * 16, 7, "req", [3, 1, 2], b"prompt"),  # the order is bound
        hold_digest(b"k" * 16, 7, "req", [1, 2, 3, 3], b"prompt"),
        unbound_digest(b"k" * 16, 7),
        hold_digest(b"j" * 16, 7, "req", [1, 2, 3], b"prompt"),
        hold_digest(b"k" * 16, 8, "req", [1, 2, 3], b"prompt"),
        hold_digest(b"k" * 16, 7, "req2", [1, 2, 3], b"prompt"),
        hold_digest(b"k" * 16, 7, "req", [1, 2, 4], b"prompt"),
        hold_digest(b"k" * 16, 7, "req", [1, 2], b"prompt"),
        hold_digest(b"k" * 16, 7, "req", [1, 2, 3], b"prompt2"),
        hold_digest(None, 7, "req", [1, 2, 3], b"prompt"),
    ):
        assert other != base
