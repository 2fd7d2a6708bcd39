"""Side channel with a deployment key: only authenticated requests get records (real ZMQ)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import zmq

from kvxfer.errors import AuthError, IncompatibleError
from kvxfer.transport.side_channel import SideChannelServer
from kvxfer.transport.side_client import fetch_records
from kvxfer.wire import (
    ErrorReply,
    GetRecords,
    Records,
    decode_side,
    encode_record,
    encode_side,
    layout_from_record,
    record_from_layout,
)
from kvxfer.wire.auth import SIDE_REQUEST, Sealer, is_sealed
from tests.integration.test_side_channel import TIMEOUT_S, H, layout, records

KEY = b"deployment-key-0123456789abcdef"
WRONG = b"another-key-0123456789abcdef!!"


@pytest.fixture
def keyed() -> Iterator[SideChannelServer]:
    srv = SideChannelServer("tcp://127.0.0.1:0", records(1), auth_key=KEY).start()
    yield srv
    srv.stop()


def raw(address: str, frame: bytes) -> bytes | None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(frame)
        if not sock.poll(1000, zmq.POLLIN):
            return None
        return sock.recv()
    finally:
        sock.close()


def assert_generic_refusal(reply: bytes | None) -> None:
    """Silence, or a plain refusal carrying no hash, no record, no detail."""
    if reply is None:
        return
    assert not is_sealed(reply)
    msg = decode_side(reply)
    assert msg == ErrorReply("unauthorized", "authentication required")
    assert H.encode() not in reply and b"p0" not in reply


def test_valid_fetch_with_key(keyed: SideChannelServer) -> None:
    recs = fetch_records(keyed.address, [0, 1], H, TIMEOUT_S, auth_key=KEY)
    assert [layout_from_record(r) for r in recs] == [layout(0), layout(1)]
    assert keyed.num_served == 1


def test_forged_get_records_without_key_gets_nothing(keyed: SideChannelServer) -> None:
    # the wrong hash would have been echoed back in an "incompatible" reply before
    for expected in (H, "0" * 64):
        reply = raw(keyed.address, encode_side(GetRecords(None, expected)))
        assert_generic_refusal(reply)
    assert_generic_refusal(raw(keyed.address, b"junk"))
    assert keyed.num_served == 0


def test_forged_get_records_with_wrong_key_gets_nothing(keyed: SideChannelServer) -> None:
    frame = Sealer(WRONG, SIDE_REQUEST, "mallory").seal(encode_side(GetRecords(None, H)))
    assert_generic_refusal(raw(keyed.address, frame))
    with pytest.raises(AuthError, match="did not authenticate its reply"):
        fetch_records(keyed.address, [0], H, TIMEOUT_S, auth_key=WRONG)
    assert keyed.num_served == 0


def test_replayed_request_refused(keyed: SideChannelServer) -> None:
    frame = Sealer(KEY, SIDE_REQUEST, "consumer").seal(encode_side(GetRecords(None, H)))
    first = raw(keyed.address, frame)
    assert first is not None and is_sealed(first)  # the genuine one is answered, sealed
    assert_generic_refusal(raw(keyed.address, frame))  # the same bytes again: refused
    assert keyed.num_served == 1


def test_incompatible_detail_only_to_key_holders(keyed: SideChannelServer) -> None:
    with pytest.raises(IncompatibleError, match="compat hash mismatch"):
        fetch_records(keyed.address, [0], "0" * 64, TIMEOUT_S, auth_key=KEY)


def test_no_key_on_both_sides_still_works() -> None:
    with SideChannelServer("tcp://127.0.0.1:0", records(1)) as srv:
        recs = fetch_records(srv.address, [0, 1], H, TIMEOUT_S)
        assert [r.tp_rank for r in recs] == [0, 1]


def test_mixed_key_and_no_key_refuse_clearly(keyed: SideChannelServer) -> None:
    with pytest.raises(AuthError, match=r"requires authentication.*KVXFER_AUTH_KEY"):
        fetch_records(keyed.address, [0], H, TIMEOUT_S)
    with SideChannelServer("tcp://127.0.0.1:0", records(1)) as plain:
        with pytest.raises(AuthError, match=r"did not authenticate its reply.*same deployment key"):
            fetch_records(plain.address, [0], H, TIMEOUT_S, auth_key=KEY)
        assert plain.num_served == 0


def test_records_reply_is_bound_to_its_request(keyed: SideChannelServer) -> None:
    """A sealed Records reply captured from one exchange opens for no other request."""
    from kvxfer.wire.auth import SIDE_REPLY, decrypt_reply, open_frame

    s = Sealer(KEY, SIDE_REQUEST, "consumer")
    req1, req2 = (s.seal(encode_side(GetRecords(None, H))) for _ in range(2))
    reply1 = raw(keyed.address, req1)
    assert reply1 is not None
    opened = open_frame(KEY, reply1, SIDE_REPLY, context=req1[-32:], max_bytes=1 << 30)
    assert isinstance(decode_side(decrypt_reply(KEY, opened.payload)), Records)
    with pytest.raises(AuthError, match="bad MAC"):
        open_frame(KEY, reply1, SIDE_REPLY, context=req2[-32:], max_bytes=1 << 30)


def test_non_loopback_without_key_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvxfer.transport.side_channel"):
        with SideChannelServer("tcp://0.0.0.0:0", records(1)):
            pass
        assert "WITHOUT an authentication key" in caplog.text
        caplog.clear()
        with SideChannelServer("tcp://0.0.0.0:0", records(1), auth_key=KEY):
            pass
        with SideChannelServer("tcp://127.0.0.1:0", records(1)):
            pass
        assert "WITHOUT" not in caplog.text


def test_a_captured_request_replayed_to_another_server_reads_nothing() -> None:
    """A request sealed for server A, captured on its path and replayed to server B
    within its freshness window, opened there (B never saw it), and B's sealed reply
    carried its records in clear: agent metadata, and with it UCX access to B's memory.
    Replies are encrypted under the key now: the attacker reads nothing from either."""
    from kvxfer.transport.side_client import _client_sealer, _open_reply

    def secret(name: bytes) -> dict[int, bytes]:
        rec = record_from_layout(layout(0), agent_name="p0", agent_metadata=name * 64,
                                 generation=1)  # fmt: skip
        return {0: encode_record(rec, H)}

    a = SideChannelServer("tcp://127.0.0.1:0", secret(b"A-secret"), auth_key=KEY).start()
    b = SideChannelServer("tcp://127.0.0.1:0", secret(b"B-secret"), auth_key=KEY).start()
    try:
        captured = _client_sealer(KEY).seal(encode_side(GetRecords(None, H)))
        for srv, name in ((a, b"A-secret"), (b, b"B-secret")):
            reply = raw(srv.address, captured)
            assert reply is not None and is_sealed(reply)
            assert name not in reply  # was there in clear, 64 times
            plain = decode_side(_open_reply(srv.address, reply, KEY, captured))  # a key holder
            assert isinstance(plain, Records) and name * 64 in plain.records[0]
    finally:
        a.stop()
        b.stop()
