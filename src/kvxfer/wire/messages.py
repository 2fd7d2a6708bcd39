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
    U64,
    HashStr,
    Name,
    Reason,
    RequestId,
    SmallInt,
)
from kvxfer.wire.limits import decode_bounded as _decode

# ---------------------------------------------------------------- notifications
# Tags in use (never reuse one): rd wd ab fl lr hb | get recs err


class _Msg(Struct, frozen=True, tag_field="t"):
    pass


class ReadDone(_Msg, frozen=True, tag="rd"):
    """Consumer rank ``consumer_rank`` of ``consumer_size`` finished reading a request."""

    request_id: RequestId
    generation: U64
    consumer_rank: SmallInt
    consumer_size: SmallInt


class WriteDone(_Msg, frozen=True, tag="wd"):
    """Producer rank ``producer_rank`` of ``producer_size`` finished writing a request (push)."""

    request_id: RequestId
    generation: U64
    producer_rank: SmallInt
    producer_size: SmallInt


class Abort(_Msg, frozen=True, tag="ab"):
    """The sender gave up on a request (deadline, cancel): the receiver frees its blocks."""

    request_id: RequestId
    generation: U64
    reason: Reason = ""


class Failed(_Msg, frozen=True, tag="fl"):
    """A transfer of a request failed on the sender's side."""

    request_id: RequestId
    generation: U64
    reason: Reason = ""


class LeaseRenew(_Msg, frozen=True, tag="lr"):
    """The consumer still wants these requests' blocks: extend their leases."""

    request_ids: Annotated[tuple[RequestId, ...], Meta(max_length=MAX_LEASE_IDS)]
    generation: U64


class Heartbeat(_Msg, frozen=True, tag="hb"):
    """The sender (of incarnation ``generation``) is alive."""

    generation: U64


BlockIds = Annotated[
    tuple[Annotated[int, Meta(ge=0, le=1 << 40)], ...], Meta(max_length=MAX_PUSH_IDS)
]


class PushRequest(_Msg, frozen=True, tag="pr"):
    """Push mode: consumer rank ``consumer_rank`` asks a producer rank to WRITE a request.

    ``consumer_address`` is the consumer engine's side channel (the producer fetches its
    records there on first contact). ``*_block_ids`` are logical ids as in
    :func:`kvxfer.planning.request.plan_request` (``local`` = the consumer's).
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


Msg = ReadDone | WriteDone | Abort | Failed | LeaseRenew | Heartbeat | PushRequest
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


SideMsg = GetRecords | Records | ErrorReply
_SIDE = msgspec.msgpack.Decoder(SideMsg)


def encode_side(msg: SideMsg) -> bytes:
    """Return the msgpack bytes of a side-channel request or reply."""
    return _ENCODER.encode(msg)


def decode_side(buf: bytes, max_bytes: int = MAX_SIDE_REPLY_BYTES) -> SideMsg:
    """Decode a side-channel message of at most ``max_bytes``; ProtocolError otherwise."""
    return _decode(_SIDE, buf, "side-channel message", max_bytes)
