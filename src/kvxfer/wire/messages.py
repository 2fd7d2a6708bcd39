"""Notifications (over NIXL) and side-channel requests/replies (over ZMQ): tagged unions."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from kvxfer.errors import LayoutError
from kvxfer.wire.limits import (
    _ENCODER,
    MAX_LEASE_IDS,
    MAX_MSG_BYTES,
    MAX_PUSH_IDS,
    MAX_RANKS,
    MAX_RECORD_BYTES,
    MAX_SIDE_REPLY_BYTES,
    MAX_SMALL_INT,
    U64,
    BudgetMs,
    HashStr,
    HoldDigest,
    Name,
    Reason,
    RequestId,
    SmallInt,
)
from kvxfer.wire.limits import decode_bounded as _decode

# ---------------------------------------------------------------- notifications
# Tags in use (never reuse one): rd wd ab fl lr hb pr cx | get recs err gps ps
#
# Attempt ids (schema 2): every request-scoped notification carries the ``attempt`` of
# the consumer's request attempt (a random 63-bit id per read()/push() call). Receivers
# drop notices whose attempt is not live, so a retry with the same request id is never
# completed, failed or aborted by an earlier attempt's notices. 0 means "no attempt"
# (a schema-1 sender) and is never live.


class _Msg(Struct, frozen=True, tag_field="t"):
    pass


def _check_rank(what: str, rank: int, size: int) -> None:
    """A rank of ``size`` ranks: ValueError otherwise (a ProtocolError when decoded)."""
    if size < 1:
        raise ValueError(f"{what}_size {size} not in [1, {MAX_SMALL_INT}]")
    if rank >= size:
        raise ValueError(f"{what}_rank {rank} not in [0, {what}_size {size})")


class ReadDone(_Msg, frozen=True, tag="rd"):
    """Consumer rank ``consumer_rank`` of ``consumer_size`` finished reading a request."""

    request_id: RequestId
    generation: U64
    consumer_rank: SmallInt
    consumer_size: SmallInt
    attempt: U64 = 0
    ticket: U64 = 0  # the hold it read (kvxfer.engine.holds); 0: none named
    digest: HoldDigest = b""  # the params' binding digest (as in Abort)

    def __post_init__(self) -> None:
        _check_rank("consumer", self.consumer_rank, self.consumer_size)


class WriteDone(_Msg, frozen=True, tag="wd"):
    """Producer rank ``producer_rank`` of ``producer_size`` finished writing a request (push)."""

    request_id: RequestId
    generation: U64
    producer_rank: SmallInt
    producer_size: SmallInt  # the sender process's ranks (unchecked: a rank may exceed it)
    attempt: U64 = 0


class Abort(_Msg, frozen=True, tag="ab"):
    """The sender gave up on a request (deadline, cancel): the receiver frees its blocks."""

    request_id: RequestId
    generation: U64
    reason: Reason = ""
    attempt: U64 = 0
    ticket: U64 = 0  # the hold it gave up on; 0: none named
    # the binding digest of the params it read with (kvxfer.engine.holds): a producer
    # ignores an abort of a bound hold made for other params (a forger's would free it)
    digest: HoldDigest = b""


class Failed(_Msg, frozen=True, tag="fl"):
    """A transfer of a request failed on the sender's side (push: sent after the rank's
    WRITE of that attempt was released, so, like ``Cancelled``, nothing more lands)."""

    request_id: RequestId
    generation: U64
    reason: Reason = ""
    attempt: U64 = 0


class LeaseRenew(_Msg, frozen=True, tag="lr"):
    """The consumer still wants these requests' blocks: extend their leases."""

    request_ids: Annotated[tuple[RequestId, ...], Meta(max_length=MAX_LEASE_IDS)]
    generation: U64
    attempts: Annotated[tuple[U64, ...], Meta(max_length=MAX_LEASE_IDS)] = ()  # per request id
    budget_ms: BudgetMs = 0  # > 0: extend to cover this much more (the request's deadline)
    # per request id: the hold it renews (0: none named); a renew naming another hold of
    # the id (one that ended; the id was held again since) extends nothing
    tickets: Annotated[tuple[U64, ...], Meta(max_length=MAX_LEASE_IDS)] = ()
    # per request id: the binding digest of its params (as in Abort); a renew of a bound
    # hold made for other params extends nothing
    digests: Annotated[tuple[HoldDigest, ...], Meta(max_length=MAX_LEASE_IDS)] = ()


class Heartbeat(_Msg, frozen=True, tag="hb"):
    """Addressed to the recipient's incarnation ``generation``: a consumer sends one per
    producer rank at first contact, so that the notification path is wired before the
    first request needs it. With ``consumer_address`` (a consumer that will push,
    ``EngineConfig.push_contact``) it also asks the producer to contact that consumer
    now (fetch its records, add its agents) instead of on its first push; without it,
    the producer drops it."""

    generation: U64
    consumer_address: Name = ""  # appended: older producers ignore it
    consumer_generation: U64 = 0


BlockIds = Annotated[
    tuple[Annotated[int, Meta(ge=0, le=1 << 40)], ...], Meta(max_length=MAX_PUSH_IDS)
]


class PushRequest(_Msg, frozen=True, tag="pr"):
    """Push mode: consumer rank ``consumer_rank`` asks a producer rank to WRITE a request.

    ``consumer_address`` is the consumer engine's side channel (the producer fetches its
    records there on first contact). ``*_block_ids`` are logical ids as in
    :func:`kvxfer.planning.request.plan_request` (``local`` = the consumer's).

    Deadline (clocks of two processes differ, so no absolute time is trusted):
    ``budget_ms`` is what was left of the request's deadline when the consumer sent
    it; the producer's local deadline is ``receipt + budget_ms - max(0, now_wall -
    sent_at_ns)``: the relative budget bounds it, the sender's wall clock can only
    shorten it (a message that sat in a queue while the producer was stopped). The
    producer never starts a write past it. ``consumer_generation`` names the
    consumer incarnation whose records the producer must write into.
    """

    request_id: RequestId
    generation: U64
    consumer_address: Name
    consumer_rank: SmallInt
    consumer_size: SmallInt
    local_block_ids: BlockIds
    remote_block_ids: BlockIds
    local_state_ids: BlockIds | None = None
    remote_state_ids: BlockIds | None = None
    num_cached_blocks: SmallInt = 0
    attempt: U64 = 0
    budget_ms: BudgetMs = 0
    sent_at_ns: U64 = 0
    consumer_generation: U64 = 0
    # the hold to write from (0: none named): the producer refuses a hold it has ended,
    # and does not free it when the WRITE completes (the consumer checks the hold's
    # slot word, then sends ReadDone naming the ticket)
    ticket: U64 = 0

    def __post_init__(self) -> None:
        _check_rank("consumer", self.consumer_rank, self.consumer_size)


class Cancelled(_Msg, frozen=True, tag="cx"):
    """Push: producer rank ``producer_rank`` will write nothing more for this attempt
    (queued job dropped, posted WRITE released, or deadline passed)."""

    request_id: RequestId
    generation: U64
    attempt: U64
    producer_rank: SmallInt


Msg = ReadDone | WriteDone | Abort | Failed | LeaseRenew | Heartbeat | PushRequest | Cancelled
_MSG = msgspec.msgpack.Decoder(Msg)


def encode_msg(msg: Msg) -> bytes:
    """Return the msgpack bytes of a notification; LayoutError if a peer would refuse it."""
    try:
        buf = _ENCODER.encode(msg)
        if len(buf) > MAX_MSG_BYTES:
            raise LayoutError(f"message of {len(buf)} bytes exceeds {MAX_MSG_BYTES}")
        _MSG.decode(buf)  # checks every bound the receiver checks
    except (msgspec.MsgspecError, OverflowError) as e:
        raise LayoutError(f"message: {e}") from None
    return buf


def decode_msg(buf: bytes) -> Msg:
    """Decode a notification; ProtocolError on anything malformed or oversized."""
    return _decode(_MSG, buf, "message", MAX_MSG_BYTES)


# ---------------------------------------------------------------- side channel


class GetRecords(_Msg, frozen=True, tag="get"):
    """Ask a side-channel server for the records of ``ranks`` (None: all ranks)."""

    ranks: Annotated[tuple[SmallInt, ...], Meta(max_length=MAX_RANKS)] | None
    expected_hash: HashStr


class Records(_Msg, frozen=True, tag="recs"):
    """Reply to GetRecords: one encoded envelope per requested rank, in request order."""

    records: Annotated[
        tuple[Annotated[bytes, Meta(max_length=MAX_RECORD_BYTES)], ...], Meta(max_length=MAX_RANKS)
    ]


class ErrorReply(_Msg, frozen=True, tag="err"):
    """The server refused a request. ``code``: incompatible, unknown_rank, malformed, internal."""

    code: Name
    message: Reason


class PushFailure(Struct, frozen=True):
    """One push a producer process failed without being able to tell its consumer over
    NIXL (the consumer's agent was never loaded: its records could not be fetched or
    installed), as remembered for :class:`GetPushStatus`."""

    request_id: RequestId
    attempt: U64
    generation: U64  # the failing producer rank's incarnation
    producer_rank: SmallInt
    consumer_rank: SmallInt
    reason: Reason


class GetPushStatus(_Msg, frozen=True, tag="gps"):
    """Ask a producer process which of these push attempts it failed unannounced (a
    consumer asks for its pushes still waiting, at its heartbeat)."""

    attempts: Annotated[tuple[U64, ...], Meta(max_length=MAX_LEASE_IDS)]


class PushStatus(_Msg, frozen=True, tag="ps"):
    """Reply to GetPushStatus: the failures among the attempts asked for (none: empty)."""

    failed: Annotated[tuple[PushFailure, ...], Meta(max_length=MAX_LEASE_IDS)]


SideMsg = GetRecords | Records | ErrorReply | GetPushStatus | PushStatus
_SIDE = msgspec.msgpack.Decoder(SideMsg)


def encode_side(msg: SideMsg) -> bytes:
    """Return the msgpack bytes of a side-channel request or reply."""
    return _ENCODER.encode(msg)


def decode_side(buf: bytes, max_bytes: int = MAX_SIDE_REPLY_BYTES) -> SideMsg:
    """Decode a side-channel message of at most ``max_bytes``; ProtocolError otherwise."""
    return _decode(_SIDE, buf, "side-channel message", max_bytes)
