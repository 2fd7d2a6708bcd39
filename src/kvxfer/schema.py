"""Everything that crosses a process: msgspec Structs, versioning, limits (no pickle).

Wire format of a handshake record (msgpack)::

    envelope = [compat_hash: str, payload: bin]      payload = msgpack(LayoutRecord)

:func:`decode_record` decodes the envelope only, compares ``compat_hash`` with the
local one, and only then decodes the payload; every size is bounded before
anything is allocated (see the ``MAX_*`` constants). Notifications are a tagged
union (tag field ``"t"``) of small Structs, as are side-channel requests/replies.

Schema evolution rules (``SCHEMA_VERSION`` = 1):

1. A new field is appended with a default, so old payloads still decode; decoders
   ignore fields they do not know, so new payloads decode on old peers.
2. A field's type and meaning never change; a field is never renamed or removed
   (deprecate it and keep decoding it).
3. Tags (``"t"``) are never reused; a new message gets a new tag.
4. Anything else (a changed meaning, a removed field) bumps ``SCHEMA_VERSION``,
   which is part of :func:`compat_hash`, so old and new peers refuse each other
   with :class:`IncompatibleError` instead of misreading each other.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta, Struct

from .errors import IncompatibleError, LayoutError, ProtocolError
from .layout import MAX_ADDR, CacheLayout, Region, Shard, TokenLayout, View, ViewKind
from .spec import AttnKind, LayoutSpec

__all__ = [
    "MAX_AGENT_METADATA_BYTES",
    "MAX_COUNT",
    "MAX_DESCRIPTORS",
    "MAX_LEASE_IDS",
    "MAX_MSG_BYTES",
    "MAX_RECORD_BYTES",
    "MAX_REGIONS",
    "MAX_SIDE_REPLY_BYTES",
    "MAX_SIDE_REQUEST_BYTES",
    "MAX_VIEWS",
    "SCHEMA_VERSION",
    "Abort",
    "ErrorReply",
    "Failed",
    "GetRecords",
    "Heartbeat",
    "LayoutRecord",
    "LeaseRenew",
    "ModelFacts",
    "Msg",
    "PushRequest",
    "ReadDone",
    "Records",
    "RegionRecord",
    "SideMsg",
    "ViewRecord",
    "WriteDone",
    "compat_hash",
    "decode_msg",
    "decode_record",
    "decode_side",
    "encode_msg",
    "encode_record",
    "encode_side",
    "layout_from_record",
    "model_facts",
    "peek_hash",
    "record_from_layout",
]

SCHEMA_VERSION = 1

MAX_RECORD_BYTES = 16 << 20  # one encoded envelope
MAX_AGENT_METADATA_BYTES = 8 << 20  # NIXL agent blobs: a few KB to ~1 MB
MAX_REGIONS = 65536
MAX_VIEWS = 1 << 20
MAX_COUNT = 1 << 32  # blocks in one view
MAX_DESCRIPTORS = 1 << 32  # sum of view counts (flat descriptor indices)
MAX_NAME_LEN = 256  # names, engine ids, agent names
MAX_HASH_LEN = 128
MAX_REQUEST_ID_LEN = 200
MAX_REASON_LEN = 1024
MAX_LEASE_IDS = 256
MAX_PUSH_IDS = 4096  # block ids per list in one PushRequest (fits MAX_MSG_BYTES)
MAX_MSG_BYTES = 64 << 10  # one notification / control message
MAX_RANKS = 4096  # ranks named in one side-channel request or reply
MAX_SIDE_REQUEST_BYTES = 64 << 10
MAX_SIDE_REPLY_BYTES = 64 << 20

U64 = Annotated[int, Meta(ge=0)]  # msgpack cannot carry more than 2**64 - 1
SmallInt = Annotated[int, Meta(ge=0, le=1 << 32)]
Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Name = Annotated[str, Meta(max_length=MAX_NAME_LEN)]
HashStr = Annotated[str, Meta(max_length=MAX_HASH_LEN)]
RequestId = Annotated[str, Meta(max_length=MAX_REQUEST_ID_LEN)]
Reason = Annotated[str, Meta(max_length=MAX_REASON_LEN)]


# ---------------------------------------------------------------- records


class RegionRecord(Struct, frozen=True):
    """Wire form of :class:`kvxfer.layout.Region`."""

    base_addr: U64
    num_bytes: U64
    device_id: SmallInt = 0
    name: Name = ""


class ViewRecord(Struct, frozen=True):
    """Wire form of :class:`kvxfer.layout.View`."""

    region: Annotated[int, Meta(ge=0, lt=MAX_REGIONS)]
    offset: U64
    length: U64
    stride: U64
    count: Count
    kind: ViewKind = ViewKind.ATTN
    shard: Shard = Shard.HEADS
    name: Name = ""


class LayoutRecord(Struct, frozen=True, kw_only=True):
    """One TP rank's handshake record: its :class:`CacheLayout` plus NIXL agent facts.

    ``generation`` is a random 64-bit id per producer process incarnation: a
    restarted peer publishes a new one, and handles of the old one are stale.
    """

    regions: Annotated[tuple[RegionRecord, ...], Meta(max_length=MAX_REGIONS)]
    views: Annotated[tuple[ViewRecord, ...], Meta(max_length=MAX_VIEWS)]
    block_size: SmallInt
    num_kv_heads: SmallInt
    head_dim: SmallInt
    dtype_bytes: SmallInt
    tp_rank: SmallInt
    tp_size: SmallInt
    token_layout: TokenLayout
    ppl: SmallInt
    is_mla: bool
    is_cross_layer: bool
    engine_id: Name
    agent_name: Name
    agent_metadata: Annotated[bytes, Meta(max_length=MAX_AGENT_METADATA_BYTES)]
    generation: U64
    schema_version: SmallInt
    device_kind: Annotated[str, Meta(max_length=16)] = "DRAM"


class _VersionOnly(Struct):
    schema_version: SmallInt


class ModelFacts(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What both sides must agree on; hashed by :func:`compat_hash`.

    TP size, block size and token layout are deliberately absent: they differ
    legitimately and are validated when pairing. State sizes are TP-total.
    """

    model_name: Name
    dtype: Name
    kv_dtype: Name
    num_layers: SmallInt
    num_kv_heads: SmallInt
    head_dim: SmallInt
    is_mla: bool = False
    num_state_layers: SmallInt = 0
    conv_cols: tuple[SmallInt, ...] = ()
    conv_kernel: SmallInt = 0
    ssm_bytes: U64 = 0


_CANONICAL = msgspec.msgpack.Encoder(order="sorted")


def compat_hash(facts: ModelFacts) -> str:
    """Return the hex sha256 of a canonical msgpack encoding of ``facts`` and SCHEMA_VERSION."""
    return hashlib.sha256(_CANONICAL.encode((SCHEMA_VERSION, facts))).hexdigest()


def model_facts(spec: LayoutSpec, *, model_name: str, dtype: str, kv_dtype: str) -> ModelFacts:
    """Return the :class:`ModelFacts` of the model a :class:`LayoutSpec` describes."""
    st = spec.state
    return ModelFacts(
        model_name=model_name,
        dtype=dtype,
        kv_dtype=kv_dtype,
        num_layers=spec.num_layers,
        num_kv_heads=1 if spec.kind is AttnKind.MLA else spec.num_kv_heads,
        head_dim=spec.head_dim,
        is_mla=spec.kind is AttnKind.MLA,
        num_state_layers=st.num_layers if st else 0,
        conv_cols=st.conv_cols if st else (),
        conv_kernel=st.conv_kernel if st else 0,
        ssm_bytes=st.ssm_bytes if st else 0,
    )


_ENVELOPE = msgspec.msgpack.Decoder(
    tuple[HashStr, Annotated[bytes, Meta(max_length=MAX_RECORD_BYTES)]]
)
_PEEK = msgspec.msgpack.Decoder(tuple[HashStr, msgspec.Raw])
_VERSION = msgspec.msgpack.Decoder(_VersionOnly)
_RECORD = msgspec.msgpack.Decoder(LayoutRecord)
_ENCODER = msgspec.msgpack.Encoder()

T = TypeVar("T")


def _decode(dec: msgspec.msgpack.Decoder[T], buf: Any, what: str, max_bytes: int) -> T:
    """Decode ``buf`` with ``dec``; any failure or oversize becomes ProtocolError."""
    if not isinstance(buf, bytes | bytearray | memoryview):
        raise ProtocolError(f"{what}: expected bytes, got {type(buf).__name__}")
    if len(buf) > max_bytes:
        raise ProtocolError(f"{what}: {len(buf)} bytes exceeds the limit of {max_bytes}")
    try:
        return dec.decode(buf)
    except (msgspec.MsgspecError, RecursionError, ValueError, OverflowError) as e:
        raise ProtocolError(f"{what}: {e}") from None


def check_record(rec: LayoutRecord, error: type[Exception] = ProtocolError) -> None:
    """Raise ``error`` naming the field unless every bound holds (before building anything)."""
    if len(rec.regions) > MAX_REGIONS:
        raise error(f"regions: {len(rec.regions)} exceeds the limit of {MAX_REGIONS}")
    if len(rec.views) > MAX_VIEWS:
        raise error(f"views: {len(rec.views)} exceeds the limit of {MAX_VIEWS}")
    if len(rec.agent_metadata) > MAX_AGENT_METADATA_BYTES:
        raise error(f"agent_metadata: {len(rec.agent_metadata)} bytes exceeds the limit")
    if not 0 <= rec.generation <= MAX_ADDR:
        raise error(f"generation {rec.generation} not a uint64")
    for i, r in enumerate(rec.regions):
        if not (0 <= r.base_addr <= MAX_ADDR and 0 <= r.num_bytes <= MAX_ADDR - r.base_addr):
            raise error(f"regions[{i}]: base_addr {r.base_addr} + num_bytes {r.num_bytes} > 2**64")
    total = 0
    for i, v in enumerate(rec.views):
        if not 0 <= v.count <= MAX_COUNT:
            raise error(f"views[{i}].count {v.count} not in [0, {MAX_COUNT}]")
        if min(v.offset, v.length, v.stride) < 0:
            raise error(f"views[{i}]: negative offset, length or stride")
        if v.offset + max(v.count - 1, 0) * v.stride + v.length > MAX_ADDR:
            raise error(f"views[{i}]: last block ends past 2**64")
        total += v.count
    if total > MAX_DESCRIPTORS:
        raise error(f"views: {total} descriptors in all exceeds the limit of {MAX_DESCRIPTORS}")


def peek_hash(buf: bytes) -> str:
    """Return the compat hash of an encoded envelope without decoding its payload."""
    return _decode(_PEEK, buf, "record envelope", MAX_RECORD_BYTES)[0]


def encode_record(rec: LayoutRecord, compat_hash: str) -> bytes:
    """Return the envelope ``[compat_hash, msgpack(rec)]``; LayoutError if a bound fails."""
    check_record(rec, LayoutError)
    if len(compat_hash) > MAX_HASH_LEN:
        raise LayoutError(f"compat_hash longer than {MAX_HASH_LEN} characters")
    try:
        payload = _ENCODER.encode(rec)
        _RECORD.decode(payload)  # what we publish must pass the peers' decoder
    except (msgspec.MsgspecError, OverflowError) as e:
        raise LayoutError(f"layout record: {e}") from None
    buf = _ENCODER.encode((compat_hash, payload))
    if len(buf) > MAX_RECORD_BYTES:
        raise LayoutError(f"encoded record of {len(buf)} bytes exceeds {MAX_RECORD_BYTES}")
    return buf


def decode_record(buf: bytes, expected_hash: str) -> LayoutRecord:
    """Decode an envelope: hash first, then version, then the bounded payload.

    Raises:
        IncompatibleError: the peer's compat hash differs (both hashes named).
        ProtocolError: anything malformed, oversized or of another schema version.
    """
    peer_hash, payload = _decode(_ENVELOPE, buf, "record envelope", MAX_RECORD_BYTES)
    if peer_hash != expected_hash:
        raise IncompatibleError(
            f"compat hash mismatch: peer has {peer_hash!r}, expected {expected_hash!r}"
        )
    version = _decode(_VERSION, payload, "layout record", MAX_RECORD_BYTES).schema_version
    if version != SCHEMA_VERSION:
        raise ProtocolError(f"schema_version: peer has {version}, expected {SCHEMA_VERSION}")
    rec = _decode(_RECORD, payload, "layout record", MAX_RECORD_BYTES)
    check_record(rec)
    return rec


def record_from_layout(
    layout: CacheLayout, *, agent_name: str, agent_metadata: bytes, generation: int
) -> LayoutRecord:
    """Return the record a producer publishes for ``layout``."""
    return LayoutRecord(
        regions=tuple(
            RegionRecord(r.base_addr, r.num_bytes, r.device_id, r.name) for r in layout.regions
        ),
        views=tuple(
            ViewRecord(v.region, v.offset, v.length, v.stride, v.count, v.kind, v.shard, v.name)
            for v in layout.views
        ),
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype_bytes=layout.dtype_bytes,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp_size,
        token_layout=layout.token_layout,
        ppl=layout.ppl,
        is_mla=layout.is_mla,
        is_cross_layer=layout.is_cross_layer,
        engine_id=layout.engine_id,
        agent_name=agent_name,
        agent_metadata=agent_metadata,
        generation=generation,
        schema_version=SCHEMA_VERSION,
    )


def layout_from_record(rec: LayoutRecord) -> CacheLayout:
    """Build the peer's :class:`CacheLayout`; ProtocolError ("peer record: ...") if invalid."""
    check_record(rec)
    try:
        return CacheLayout(
            regions=tuple(
                Region(r.base_addr, r.num_bytes, r.device_id, r.name) for r in rec.regions
            ),
            views=tuple(
                View(v.region, v.offset, v.length, v.stride, v.count, v.kind, v.shard, v.name)
                for v in rec.views
            ),
            block_size=rec.block_size,
            num_kv_heads=rec.num_kv_heads,
            head_dim=rec.head_dim,
            dtype_bytes=rec.dtype_bytes,
            tp_rank=rec.tp_rank,
            tp_size=rec.tp_size,
            token_layout=rec.token_layout,
            ppl=rec.ppl,
            is_mla=rec.is_mla,
            is_cross_layer=rec.is_cross_layer,
            engine_id=rec.engine_id,
        )
    except LayoutError as e:
        raise ProtocolError(f"peer record: {e}") from None


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
    :func:`kvxfer.plan.plan_request` (``local`` = the consumer's).
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
