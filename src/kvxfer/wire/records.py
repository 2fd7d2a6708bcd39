"""Handshake records: a layout on the wire, in a ``(compat_hash, payload)`` envelope."""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from kvxfer.errors import IncompatibleError, LayoutError, ProtocolError
from kvxfer.layout.model import (
    MAX_ADDR,
    CacheLayout,
    MemKind,
    Region,
    Shard,
    TokenLayout,
    View,
    ViewKind,
)
from kvxfer.layout.spec import AttnKind, LayoutSpec
from kvxfer.wire.limits import (
    _ENCODER,
    HOLD_SLOT_BYTES,
    MAX_AGENT_METADATA_BYTES,
    MAX_COUNT,
    MAX_DESCRIPTORS,
    MAX_HASH_LEN,
    MAX_HOLD_SLOTS,
    MAX_RECORD_BYTES,
    MAX_REGIONS,
    MAX_VIEWS,
    SCHEMA_VERSION,
    U64,
    Count,
    HashStr,
    Name,
    SmallInt,
)
from kvxfer.wire.limits import decode_bounded as _decode

# ---------------------------------------------------------------- records


class RegionRecord(Struct, frozen=True):
    """Wire form of :class:`kvxfer.layout.model.Region`."""

    base_addr: U64
    num_bytes: U64
    device_id: SmallInt = 0
    name: Name = ""
    mem_kind: Literal["DRAM", "VRAM"] = "DRAM"  # appended with a default (evolution rule 1)


class ViewRecord(Struct, frozen=True):
    """Wire form of :class:`kvxfer.layout.model.View`."""

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
    # a producer rank's hold table (kvxfer.engine.holds): DRAM words readers check after
    # their READ; 0 slots: none published (a consumer's record, or an older producer)
    hold_addr: U64 = 0
    hold_slots: Annotated[int, Meta(ge=0, le=MAX_HOLD_SLOTS)] = 0


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
_FACTS_JSON = msgspec.json.Decoder(ModelFacts)


def facts_json(facts: ModelFacts) -> str:
    """``facts`` as compact JSON (default fields left out): what a side channel names in
    its "incompatible" reply, so that the peer can say which fact differs."""
    return msgspec.json.encode(facts).decode()


MODEL_MARK = "; its model: "  # what a side channel's "incompatible" reply ends with


def explain_mismatch(message: str, ours: ModelFacts) -> str:
    """A peer's "incompatible" ``message`` with the facts that differ from ``ours`` named
    in place of its facts' JSON (left as it is when they cannot be read)."""
    head, mark, theirs = message.partition(MODEL_MARK)
    differ = facts_differ(theirs, ours) if mark else ""
    return f"{head}; the models differ in {differ}" if differ else message


def facts_differ(theirs: str, ours: ModelFacts) -> str:
    """Which facts differ between a peer's :func:`facts_json` text and ``ours``:
    ``"kv_dtype: 'fp8_e5m2' there, 'fp8_e4m3' here"`` (``"; "``-joined), or "" when
    ``theirs`` cannot be read (an older peer, a cut message) or nothing differs."""
    try:
        peer = _FACTS_JSON.decode(theirs)
    except (msgspec.MsgspecError, ValueError):
        return ""
    mine = msgspec.structs.asdict(ours)
    return "; ".join(
        f"{k}: {v!r} there, {mine[k]!r} here"
        for k, v in msgspec.structs.asdict(peer).items()
        if v != mine[k]
    )


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
    if not 0 <= rec.hold_slots <= MAX_HOLD_SLOTS or (rec.hold_slots and rec.hold_addr <= 0):
        raise error(f"hold table: {rec.hold_slots} slots at address {rec.hold_addr}")
    if rec.hold_addr + HOLD_SLOT_BYTES * rec.hold_slots > MAX_ADDR:
        raise error(f"hold table: {rec.hold_slots} slots at {rec.hold_addr} end past 2**64")
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
    layout: CacheLayout,
    *,
    agent_name: str,
    agent_metadata: bytes,
    generation: int,
    hold_table: tuple[int, int] = (0, 0),
) -> LayoutRecord:
    """Return the record a producer publishes for ``layout`` (``hold_table``: the
    ``(address, slots)`` of its hold table; ``(0, 0)`` for none)."""
    return LayoutRecord(
        regions=tuple(
            RegionRecord(r.base_addr, r.num_bytes, r.device_id, r.name, r.mem_kind.value)
            for r in layout.regions
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
        hold_addr=hold_table[0],
        hold_slots=hold_table[1],
    )


def layout_from_record(rec: LayoutRecord) -> CacheLayout:
    """Build the peer's :class:`CacheLayout`; ProtocolError ("peer record: ...") if invalid."""
    check_record(rec)
    try:
        return CacheLayout(
            regions=tuple(
                Region(r.base_addr, r.num_bytes, r.device_id, r.name, MemKind(r.mem_kind))
                for r in rec.regions
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
