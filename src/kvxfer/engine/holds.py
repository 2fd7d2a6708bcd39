"""Hold tickets: how a reader learns, after its READ, that the blocks it read were still
held while it read them (pure).

A pull READ is one-sided: the producer's CPU never sees it. Its lease and generation
bound *when* a reader may post, but not what happens when two readers hold the same
params (a router that retried on another decode engine, a client that sent them
twice): the producer frees a request's blocks at the first reader's ``ReadDone``,
reuses them, and the second reader's READ may copy the next request's bytes, which
used to be reported DONE.

So every hold gets a **ticket**: a positive integer, increasing per producer, whose
**slot** is ``ticket % num_slots`` in a small table of 64-bit words each producer rank
registers (DRAM) and publishes in its handshake record. The producer writes the slot's
word ``held_word(ticket)`` when the hold starts, and ``released_word(ticket)`` when the
hold ends (read, aborted, expired or released), *before* the caller may reuse the
blocks. A reader with the ticket READs the blocks (no notification attached), then
READs the slot word, and only then tells the producer it has read:

- the word is ``held_word(ticket)``: the hold was alive after the blocks were copied,
  so no byte of them was reused: DONE;
- it is ``released_word(ticket)`` or any later ticket's word: the blocks may have been
  reused under the READ: the request fails and its bytes are never reported;
- it is an older ticket's word: the hold has not started yet (a reader faster than the
  producer's bookkeeping; the caller kept the blocks since it handed out the params):
  check again until the deadline.

Words in one slot only grow (tickets increase), so an old word is never mistaken for
a newer one. Ordering: the producer's store of the released word happens before the
caller learns the hold ended (under the producer's lock), so before any reuse; the
reader posts its check only after its data READ completed.

**Binding.** A ticket alone says *a* hold was alive, not *which blocks* it held: params
pass through clients and proxies, and forged ones (a live ticket, another request's
block ids) read that request's blocks with a passing check. So a slot is
:data:`SLOT_BYTES` (32): the word, 8 reserved bytes, and a 16-byte **binding digest**
(:func:`hold_digest`) of the ticket, the request id, the held block ids (in order) and
an opaque binding the caller gives (in vLLM: the prompt's hash), keyed with the
deployment key (or none). The producer writes the digest before the held word; the
reader computes the digest of the params it was given and reads the slot whole: a
held word whose digest differs means the params were not the ones held
(:func:`binding_matches`), and the request fails without telling the producer
anything (its abort would free the genuine reader's hold). The ids are bound in their
order (params that list the held blocks in another order would put the right bytes in
the wrong places). A hold that names no block ids publishes its ticket's
:func:`unbound_digest` and binds nothing (the check is by ticket alone); a slot's
zeros never match anything.
"""

from __future__ import annotations

import hashlib
import hmac
from enum import Enum

import numpy as np
import numpy.typing as npt

from kvxfer.errors import ConfigError
from kvxfer.wire.limits import HOLD_DIGEST_BYTES, HOLD_SLOT_BYTES

__all__ = [
    "CHECK_SLOTS",
    "DIGEST",
    "MAX_BINDING_BYTES",
    "SLOT_BYTES",
    "SLOT_WORDS",
    "HoldVerdict",
    "TicketBook",
    "binding_matches",
    "check_binding",
    "held_word",
    "hold_digest",
    "released_word",
    "slot_of",
    "unbound_digest",
    "verdict",
]

MAX_TICKET = (1 << 62) - 1  # words are ticket << 1 | released: they fit 63 bits
CHECK_SLOTS = 4096  # slots a consumer rank reads hold slots into (used round-robin)
SLOT_BYTES = HOLD_SLOT_BYTES  # a slot: [word, reserved, digest (2 words)]
SLOT_WORDS = SLOT_BYTES // 8
DIGEST = slice(2, 4)  # the digest's words in a slot
MAX_BINDING_BYTES = 1024  # a hold's binding (vLLM's: a 64-digit hex prompt hash)
_DIGEST_TAG = b"kvxfer.hold-binding/1\0"
_UNBOUND_TAG = b"kvxfer.hold-unbound/1\0"


def _hmac16(key: bytes | None, *parts: bytes) -> bytes:
    d = hmac.new(key or b"", b"".join(parts), hashlib.sha256).digest()[:HOLD_DIGEST_BYTES]
    return d if any(d) else b"\x01" + d[1:]  # never a fresh slot's zeros


def hold_digest(
    key: bytes | None,
    ticket: int,
    request_id: str,
    block_ids: npt.ArrayLike,
    binding: bytes = b"",
) -> bytes:
    """The 16-byte digest a hold's slot carries: HMAC-SHA256 (``key``, or the empty key)
    of the ticket, the request id, the block ids in their order (integers) and
    ``binding``, each length-prefixed; never 16 zero bytes (a fresh slot)."""
    rid = request_id.encode("utf-8", "surrogatepass")
    ids = np.asarray(block_ids, dtype=np.int64).ravel()
    return _hmac16(
        key, _DIGEST_TAG, int(ticket).to_bytes(8, "little"),
        len(rid).to_bytes(4, "little"), rid,
        len(binding).to_bytes(4, "little"), bytes(binding),
        len(ids).to_bytes(8, "little"), ids.astype("<i8").tobytes(),
    )  # fmt: skip


def unbound_digest(key: bytes | None, ticket: int) -> bytes:
    """The digest of a hold of ``ticket`` that names no blocks (it binds nothing): a
    marker of that ticket, so a slot read before any digest was written (zeros, or a
    torn read of an older hold's) never passes as unbound."""
    return _hmac16(key, _UNBOUND_TAG, int(ticket).to_bytes(8, "little"))


def binding_matches(published: bytes, expected: bytes, unbound: bytes) -> bool:
    """Whether a held slot's digest lets a reader of ``expected`` report its bytes: equal
    to it, or to the ticket's ``unbound`` marker (the hold binds nothing); constant time."""
    ok = hmac.compare_digest(published, expected)
    return hmac.compare_digest(published, unbound) or ok


def held_word(ticket: int) -> int:
    """The slot word while ``ticket``'s hold lives."""
    return ticket << 1


def released_word(ticket: int) -> int:
    """The slot word once ``ticket``'s hold has ended."""
    return (ticket << 1) | 1


def slot_of(ticket: int, num_slots: int) -> int:
    return ticket % num_slots


def check_binding(name: str, binding: object) -> bytes:
    """``binding`` as bytes; ConfigError naming ``name`` unless it is bytes of at most
    :data:`MAX_BINDING_BYTES`."""
    if not isinstance(binding, bytes) or len(binding) > MAX_BINDING_BYTES:
        raise ConfigError(f"{name} must be bytes, at most {MAX_BINDING_BYTES}")
    return binding


def check_ticket(ticket: object) -> int:
    """``ticket`` as an int; ConfigError naming it unless it is in ``[1, MAX_TICKET]``."""
    if isinstance(ticket, bool) or not isinstance(ticket, int) or not 1 <= ticket <= MAX_TICKET:
        raise ConfigError(f"hold ticket must be an integer in [1, 2**62), got {ticket!r}")
    return ticket


class HoldVerdict(str, Enum):
    """What a slot word read after a READ says about the ticket's hold."""

    HELD = "held"  # the hold was alive: the bytes read are the held ones
    RELEASED = "released"  # it ended (or a later hold took the slot): bytes may be reused
    NOT_YET = "not_yet"  # it has not started: check again


def verdict(word: int, ticket: int) -> HoldVerdict:
    if word == held_word(ticket):
        return HoldVerdict.HELD
    if word > held_word(ticket):
        return HoldVerdict.RELEASED
    return HoldVerdict.NOT_YET


class TicketBook:
    """Which slots live holds use, and the next ticket (pure; not thread-safe: the
    producer, or a vLLM scheduler side that hands tickets out, owns it).

    ``take()`` gives the next ticket whose slot is free; ``claim(t)`` records a ticket
    given by someone else (it must be newer than every ticket this slot had);
    ``free(t)`` gives its slot back; ``refuse(t)`` ends a ticket whose hold never starts.
    """

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ConfigError(f"num_slots must be a positive integer, got {num_slots!r}")
        self.num_slots = num_slots
        self._next = 1
        self._live: dict[int, int] = {}  # slot -> ticket
        self._last: dict[int, int] = {}  # slot -> newest ticket it had (bounded by num_slots)

    def __len__(self) -> int:
        return len(self._live)

    def take(self) -> int:
        """The next ticket whose slot no live hold uses (recorded as live).

        Raises:
            ConfigError: every slot is in use.
        """
        if len(self._live) >= self.num_slots:
            raise ConfigError(
                f"all {self.num_slots} hold slots are in use: raise hold_slots or free holds"
            )
        t = self._next
        while slot_of(t, self.num_slots) in self._live:
            t += 1
        self.claim(t)
        return t

    def claim(self, ticket: int) -> None:
        """Record ``ticket`` (given by the caller) as live.

        Raises:
            ConfigError: not a ticket, its slot is in use, or not newer than the slot's
                last ticket (a reader could take an old word for it).
        """
        check_ticket(ticket)
        slot = slot_of(ticket, self.num_slots)
        if slot in self._live:
            raise ConfigError(
                f"hold ticket {ticket}: slot {slot} is in use by ticket {self._live[slot]}"
            )
        if ticket <= self._last.get(slot, 0):
            raise ConfigError(
                f"hold ticket {ticket} is not newer than slot {slot}'s last ({self._last[slot]})"
            )
        self._live[slot] = ticket
        self._last[slot] = ticket
        self._next = max(self._next, ticket + 1)

    def refuse(self, ticket: int) -> bool:
        """Record that ``ticket``'s hold will never start (its params are out, its hold
        failed): True if its slot may now say it ended, which only moves the slot past
        it (a later claim of it is refused); False, changing nothing, while a live hold
        uses the slot or once the slot had this ticket or a newer one."""
        if ticket <= 0:
            return False  # 0: no ticket
        slot = slot_of(ticket, self.num_slots)
        if slot in self._live or ticket <= self._last.get(slot, 0):
            return False
        self._last[slot] = ticket
        self._next = max(self._next, ticket + 1)
        return True

    def free(self, ticket: int) -> bool:
        """Give ``ticket``'s slot back; False if it was not live."""
        slot = slot_of(ticket, self.num_slots)
        if self._live.get(slot) != ticket:
            return False
        del self._live[slot]
        return True
