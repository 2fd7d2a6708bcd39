"""Wire schema: round trips, bounds, typed errors, and fuzzing of every decoder."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.errors import IncompatibleError, LayoutError, ProtocolError
from kvxfer.layout.model import CacheLayout
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec
from kvxfer.wire import (
    MAX_AGENT_METADATA_BYTES,
    MAX_LEASE_IDS,
    MAX_RECORD_BYTES,
    SCHEMA_VERSION,
    Abort,
    ErrorReply,
    Failed,
    GetPushStatus,
    GetRecords,
    Heartbeat,
    LayoutRecord,
    LeaseRenew,
    PushFailure,
    PushRequest,
    PushStatus,
    ReadDone,
    Records,
    WriteDone,
    compat_hash,
    decode_msg,
    decode_record,
    decode_side,
    encode_msg,
    encode_record,
    encode_side,
    layout_from_record,
    model_facts,
    record_from_layout,
)

HYBRID_STATE = StateSpec(num_layers=3, conv_cols=(1024, 256, 256), conv_kernel=4, ssm_bytes=65536)
SPECS = {
    "split_kv": LayoutSpec(AttnKind.SPLIT_KV, 4, 64, 16, 8, 128, tp_rank=1, tp_size=2),
    "blocks_first": LayoutSpec(AttnKind.BLOCKS_FIRST, 3, 32, 16, 4, 64),
    "packed": LayoutSpec(AttnKind.PACKED, 2, 16, 16, 8, 64, tp_rank=3, tp_size=4),
    "mla": LayoutSpec(AttnKind.MLA, 4, 100, 64, 1, 576, ppl=2),
    "cross_layer": LayoutSpec(AttnKind.CROSS_LAYER, 8, 10, 16, 8, 128),
    "hybrid": LayoutSpec(
        AttnKind.BLOCKS_FIRST, 4, 50, 64, 8, 128, tp_rank=1, tp_size=2, ppl=4, state=HYBRID_STATE
    ),
}
ALLOWED = (ProtocolError, IncompatibleError)


def build(spec: LayoutSpec, engine_id: str = "engine-p") -> CacheLayout:
    """Fake but valid base addresses: regions back to back from 4 GiB, 4 KiB apart."""
    addrs, addr = [], 1 << 32
    for n in spec.region_bytes():
        addrs.append(addr)
        addr += n + 4096
    return spec.build(addrs, engine_id=engine_id)


def hash_of(spec: LayoutSpec, **kw: Any) -> str:
    facts = {"model_name": "m", "dtype": "bf16", "kv_dtype": "bf16", **kw}
    return compat_hash(model_facts(spec, **facts))


def record(spec: LayoutSpec, **kw: Any) -> LayoutRecord:
    rec = record_from_layout(
        build(spec), agent_name="agent-0", agent_metadata=b"\x01nixl" * 50, generation=(1 << 64) - 1
    )
    return msgspec.structs.replace(rec, **kw) if kw else rec


def raw_envelope(h: str, payload: Any) -> bytes:
    """An envelope around any payload object, bypassing encode_record's checks."""
    return msgspec.msgpack.encode((h, msgspec.msgpack.encode(payload)))


H = hash_of(SPECS["split_kv"])
VALID_RECORD = encode_record(record(SPECS["split_kv"]), H)
VALID_MSGS = [
    ReadDone("req-1", 7, 0, 2),
    WriteDone("req-2", 7, 1, 4),
    Abort("req-3", 7, "deadline"),
    Failed("req-4", 7, "nixl: remote disconnect"),
    LeaseRenew(("a", "b", "c"), 7),
    LeaseRenew(("a",), 7, (2,), 1500, (9,)),
    Heartbeat(7),
]
VALID_SIDE = [
    GetRecords((0, 1), H),
    GetRecords(None, H),
    Records((VALID_RECORD,)),
    ErrorReply("x", "y"),
    GetPushStatus((1, 2**63 - 1)),
    PushStatus(()),
    PushStatus((PushFailure("req-5", 9, 7, 0, 1, "side channel tcp://h:1: no reply"),)),
]


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(SPECS))
def test_layout_round_trip(name: str) -> None:
    spec = SPECS[name]
    layout = build(spec)
    h = hash_of(spec)
    rec = record_from_layout(layout, agent_name="a", agent_metadata=b"\0" * 4096, generation=42)
    buf = encode_record(rec, h)
    back = decode_record(buf, h)
    assert back == rec
    layout2 = layout_from_record(back)
    assert layout2 == layout
    assert layout2.engine_id == layout.engine_id  # not part of CacheLayout equality
    assert (back.agent_name, back.agent_metadata, back.generation) == ("a", b"\0" * 4096, 42)
    assert back.schema_version == SCHEMA_VERSION and back.device_kind == "DRAM"


def test_compat_hash_covers_model_not_tp_block_size_or_layout() -> None:
    spec = SPECS["split_kv"]
    h = hash_of(spec)
    assert len(h) == 64 and h == hash_of(spec)
    assert hash_of(spec.with_rank(0, 8)) == h
    assert hash_of(LayoutSpec(AttnKind.PACKED, 4, 999, 64, 8, 128)) == h
    assert hash_of(spec, kv_dtype="fp8") != h
    assert hash_of(spec, model_name="other") != h
    assert hash_of(LayoutSpec(AttnKind.SPLIT_KV, 5, 64, 16, 8, 128)) != h
    assert hash_of(SPECS["hybrid"]) != hash_of(LayoutSpec(AttnKind.BLOCKS_FIRST, 4, 50, 64, 8, 128))


@pytest.mark.parametrize("msg", VALID_MSGS, ids=lambda m: type(m).__name__)
def test_msg_round_trip_and_small(msg: Any) -> None:
    buf = encode_msg(msg)
    assert decode_msg(buf) == msg
    assert len(buf) < 128


@pytest.mark.parametrize("msg", VALID_SIDE, ids=lambda m: type(m).__name__)
def test_side_round_trip(msg: Any) -> None:
    assert decode_side(encode_side(msg)) == msg


def test_push_status_is_bounded_like_lease_ids() -> None:
    """A push-status question or answer longer than MAX_LEASE_IDS is refused typed."""
    from kvxfer.wire import MAX_LEASE_IDS

    with pytest.raises(ProtocolError):
        decode_side(encode_side(GetPushStatus(tuple(range(1, MAX_LEASE_IDS + 2)))))
    one = PushFailure("r", 1, 2, 0, 0, "x")
    with pytest.raises(ProtocolError):
        decode_side(encode_side(PushStatus((one,) * (MAX_LEASE_IDS + 1))))
    with pytest.raises(ProtocolError):  # a reason past its bound
        decode_side(encode_side(PushStatus((PushFailure("r", 1, 2, 0, 0, "x" * 5000),))))


# ---------------------------------------------------------------- typed errors


def test_wrong_hash_names_both() -> None:
    with pytest.raises(IncompatibleError, match=f"{H}.*'other'"):
        decode_record(VALID_RECORD, "other")


def test_wrong_schema_version_names_both() -> None:
    buf = encode_record(record(SPECS["split_kv"], schema_version=SCHEMA_VERSION + 1), H)
    with pytest.raises(
        ProtocolError, match=rf"schema_version.*{SCHEMA_VERSION + 1}.*{SCHEMA_VERSION}"
    ):
        decode_record(buf, H)


def test_absurd_block_count_rejected() -> None:
    rec = record(SPECS["split_kv"])
    views = (msgspec.structs.replace(rec.views[0], count=1 << 40), *rec.views[1:])
    bad = msgspec.structs.replace(rec, views=views)
    with pytest.raises(ProtocolError, match=r"views\[0\]\.count"):
        decode_record(raw_envelope(H, bad), H)
    with pytest.raises(LayoutError, match="count"):
        encode_record(bad, H)


def test_huge_region_count_in_small_message_fails_fast() -> None:
    for head in (b"\xdd", b"\xdc"):  # array32 / array16 headers
        n = (10**7).to_bytes(4, "big") if head == b"\xdd" else (65535).to_bytes(2, "big")
        payload = b"\x82\xaeschema_version\x01\xa7regions" + head + n + b"\x90" * 8
        for body in (payload, b"\x81\xa7regions" + head + n + b"\x90" * 8):
            buf = msgspec.msgpack.encode((H, body))
            t0 = time.perf_counter()
            with pytest.raises(ProtocolError):
                decode_record(buf, H)
            assert time.perf_counter() - t0 < 0.05 and len(buf) < 200


def test_region_bound_checked_from_header() -> None:
    d = msgspec.structs.asdict(record(SPECS["split_kv"]))
    d["regions"] = [d["regions"][0]] * 65537
    with pytest.raises(ProtocolError, match=r"regions"):
        decode_record(raw_envelope(H, d), H)


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("block_size", -1, r"block_size"),
        ("block_size", "16", r"block_size"),
        ("tp_size", 1 << 40, r"tp_size"),
        ("agent_name", "x" * 300, r"agent_name"),
        ("agent_metadata", b"x" * (MAX_AGENT_METADATA_BYTES + 1), r"agent_metadata"),
        ("token_layout", "XYZ", r"token_layout"),
        ("generation", -5, r"generation"),
        ("views", [[0, 0, 1, 1, 1]], r"views\[0\]"),
        ("regions", "nope", r"regions"),
    ],
)
def test_bad_field_named(field: str, value: Any, pattern: str) -> None:
    d = msgspec.structs.asdict(record(SPECS["split_kv"]))
    d[field] = value
    with pytest.raises(ProtocolError, match=pattern):
        decode_record(raw_envelope(H, d), H)


def test_missing_field_named() -> None:
    d = msgspec.structs.asdict(record(SPECS["split_kv"]))
    del d["ppl"]
    with pytest.raises(ProtocolError, match="ppl"):
        decode_record(raw_envelope(H, d), H)


def test_unknown_fields_ignored_for_evolution() -> None:
    d = msgspec.structs.asdict(record(SPECS["mla"]))
    d["added_in_v1_1"] = {"nested": [1, 2, 3]}
    assert decode_record(raw_envelope(H, d), H) == record(SPECS["mla"])


def test_oversized_and_non_bytes_rejected_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_record(b"\x92" + b"\0" * MAX_RECORD_BYTES, H)
    with pytest.raises(ProtocolError, match="expected bytes"):
        decode_record("text", H)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_msg(b"\0" * (1 << 20))


def test_invalid_layout_becomes_protocol_error() -> None:
    rec = record(SPECS["split_kv"])
    views = (msgspec.structs.replace(rec.views[0], offset=1 << 30), *rec.views[1:])
    bad = msgspec.structs.replace(rec, views=views)
    back = decode_record(encode_record(bad, H), H)
    with pytest.raises(ProtocolError, match=r"^peer record: view 0"):
        layout_from_record(back)
    with pytest.raises(ProtocolError, match=r"^peer record: tp_rank"):
        layout_from_record(msgspec.structs.replace(rec, tp_rank=5))


def test_bad_messages() -> None:
    with pytest.raises(ProtocolError, match="request_id"):
        decode_msg(msgspec.msgpack.encode({"t": "ab", "request_id": "r" * 500, "generation": 1}))
    with pytest.raises(ProtocolError, match="request_ids"):
        decode_msg(msgspec.msgpack.encode({"t": "lr", "request_ids": [1], "generation": 1}))
    many = msgspec.msgpack.encode(
        {"t": "lr", "request_ids": ["a"] * (MAX_LEASE_IDS + 1), "generation": 1}
    )
    with pytest.raises(ProtocolError, match="request_ids"):
        decode_msg(many)
    with pytest.raises(ProtocolError, match=r"\$\.t"):
        decode_msg(msgspec.msgpack.encode({"t": "zz", "generation": 1}))
    with pytest.raises(ProtocolError):
        decode_msg(encode_side(GetRecords(None, H)))  # a side-channel message is no notification
    with pytest.raises(LayoutError, match="request_id"):
        encode_msg(Abort("r" * 500, 1))


def test_a_write_done_counts_its_senders_ranks_not_the_tp_size() -> None:
    # a prefill worker of rank 1 holds one rank: WriteDone(rank 1, size 1) is what it sends
    msg = WriteDone("r", 1, 1, 1)
    assert decode_msg(encode_msg(msg)) == msg


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        # a ReadDone from rank 5 of 2, or of 0 ranks, counts as no reader's: one of them
        # made the producer free a hold another consumer rank was still reading
        ({"t": "rd", "consumer_rank": 5, "consumer_size": 2}, "consumer_rank 5 not in"),
        ({"t": "rd", "consumer_rank": 0, "consumer_size": 0}, "consumer_size 0 not in"),
        # a renew of 2**64-1 ms held blocks for half a billion years
        ({"t": "lr", "request_ids": ["a"], "budget_ms": (1 << 64) - 1}, r"budget_ms"),
        ({"t": "pr", "budget_ms": 3_600_001}, r"budget_ms"),
        ({"t": "pr", "consumer_rank": 1, "consumer_size": 1}, "consumer_rank 1 not in"),
    ],
)
def test_out_of_range_notification_fields_are_refused(fields: dict[str, Any], pattern: str) -> None:
    base: dict[str, Any] = {"request_id": "r", "generation": 1}
    if fields["t"] == "pr":
        push = PushRequest("r", 1, "tcp://127.0.0.1:9", 0, 1, (1,), (2,), budget_ms=3_600_000)
        assert decode_msg(encode_msg(push)) == push  # an hour is the most a budget may be
        base = msgspec.to_builtins(push)
    with pytest.raises(ProtocolError, match=pattern):
        decode_msg(msgspec.msgpack.encode({**base, **fields}))
    with pytest.raises(LayoutError):
        encode_msg(Heartbeat(1 << 64))


# ---------------------------------------------------------------- fuzzing

FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mutated(draw: st.DrawFn, base: bytes) -> bytes:
    buf = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "append", "overwrite", "insert"]))
        i = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del buf[i:]
        elif op == "append":
            buf += draw(st.binary(min_size=1, max_size=64))
        elif op == "overwrite":
            junk = draw(st.binary(min_size=1, max_size=16))
            buf[i : i + len(junk)] = junk
        else:
            buf[i:i] = draw(st.binary(min_size=1, max_size=16))
    return bytes(buf)


def check_record_bytes(buf: bytes) -> None:
    try:
        rec = decode_record(buf, H)
    except ALLOWED:
        return
    with contextlib.suppress(ProtocolError):
        assert isinstance(layout_from_record(rec), CacheLayout)


def check_msg_bytes(buf: bytes) -> None:
    for decode in (decode_msg, decode_side):
        with contextlib.suppress(ProtocolError):
            decode(buf)


SMALL_RECORD = encode_record(record(SPECS["hybrid"], agent_metadata=b"meta"), H)
MSG_BYTES = [encode_msg(m) for m in VALID_MSGS] + [encode_side(m) for m in VALID_SIDE[:2]]

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.floats(allow_nan=False),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=15), c, max_size=5),
    max_leaves=20,
)


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(buf: bytes) -> None:
    check_record_bytes(buf)
    check_record_bytes(msgspec.msgpack.encode((H, buf)))  # past the hash, into the payload
    check_msg_bytes(buf)


@FUZZ
@given(mutated(SMALL_RECORD))
def test_fuzz_mutated_record(buf: bytes) -> None:
    check_record_bytes(buf)


@FUZZ
@given(st.data())
def test_fuzz_mutated_messages(data: st.DataObject) -> None:
    check_msg_bytes(data.draw(mutated(data.draw(st.sampled_from(MSG_BYTES)))))


@settings(FUZZ, max_examples=400)
@given(msgpack_values, st.sampled_from(sorted(msgspec.structs.asdict(record(SPECS["mla"])))))
def test_fuzz_structured_payloads(value: Any, field: str) -> None:
    """Well-formed msgpack of the wrong shape: as a whole payload and as one field."""
    check_record_bytes(raw_envelope(H, value))
    d = msgspec.structs.asdict(record(SPECS["mla"]))
    d[field] = value
    check_record_bytes(raw_envelope(H, d))
    check_msg_bytes(msgspec.msgpack.encode(value))
    check_msg_bytes(msgspec.msgpack.encode({"t": "rd", "request_id": value, "generation": value}))


def test_fuzz_deep_nesting() -> None:
    for depth in (10_000, 200_000):
        check_record_bytes(msgspec.msgpack.encode((H, b"\x91" * depth + b"\x01")))
        check_record_bytes(b"\x92\xa1x" + b"\x91" * depth)
        check_msg_bytes(b"\x81\xa1t" + b"\x91" * depth)


def test_region_memory_kind_and_device_travel_in_the_record() -> None:
    import dataclasses

    from kvxfer.layout.model import MemKind
    from kvxfer.layout.presets import spec_for as _spec_for
    from kvxfer.wire import decode_record, encode_record, layout_from_record, record_from_layout

    spec = _spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=4)
    layout = spec.build([4096 * (i + 1) << 20 for i in range(len(spec.region_bytes()))])
    vram = dataclasses.replace(
        layout,
        regions=tuple(
            dataclasses.replace(r, mem_kind=MemKind.VRAM, device_id=3) for r in layout.regions
        ),
    )
    rec = record_from_layout(vram, agent_name="a", agent_metadata=b"m", generation=1)
    back = layout_from_record(decode_record(encode_record(rec, "h"), "h"))
    assert {(r.mem_kind, r.device_id) for r in back.regions} == {(MemKind.VRAM, 3)}
    # a region record from a peer that predates the field decodes as DRAM (schema rule 1)
    from kvxfer.wire import RegionRecord

    old = msgspec.msgpack.decode(
        msgspec.msgpack.encode({"base_addr": 4096, "num_bytes": 8192, "device_id": 0, "name": "r"}),
        type=RegionRecord,
    )
    assert old.mem_kind == "DRAM"


def test_a_mismatch_names_the_facts_that_differ_or_stays_as_it_was() -> None:
    from kvxfer.wire import ModelFacts, explain_mismatch, facts_differ, facts_json

    ours = ModelFacts(model_name="m", dtype="bfloat16", kv_dtype="fp8_e4m3", num_layers=2,
                      num_kv_heads=2, head_dim=8)  # fmt: skip
    theirs = ModelFacts(model_name="m", dtype="bfloat16", kv_dtype="fp8_e5m2", num_layers=4,
                        num_kv_heads=2, head_dim=8)  # fmt: skip
    assert facts_differ(facts_json(theirs), ours) == (
        "kv_dtype: 'fp8_e5m2' there, 'fp8_e4m3' here; num_layers: 4 there, 2 here"
    )
    assert facts_differ(facts_json(ours), ours) == ""
    msg = "compat hash mismatch: rank 0 has 'a', expected 'b'"
    assert explain_mismatch(f"{msg}; its model: {facts_json(theirs)}", ours) == (
        f"{msg}; the models differ in kv_dtype: 'fp8_e5m2' there, 'fp8_e4m3' here; "
        "num_layers: 4 there, 2 here"
    )
    # an older peer (no facts), a cut reply, junk: the message as it came
    assert explain_mismatch(msg, ours) == msg
    cut = f"{msg}; its model: {facts_json(theirs)[:20]}"
    assert explain_mismatch(cut, ours) == cut
    assert explain_mismatch(f"{msg}; its model: [1, 2]", ours) == f"{msg}; its model: [1, 2]"
