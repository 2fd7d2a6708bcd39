"""A real side-channel server on loopback: valid fetches, junk input, dead peers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvxfer.errors import ConfigError, IncompatibleError, LayoutError, PeerLostError, ProtocolError
from kvxfer.layout.model import CacheLayout
from kvxfer.layout.spec import AttnKind, LayoutSpec
from kvxfer.transport.side_channel import SideChannelServer
from kvxfer.transport.side_client import fetch_records
from kvxfer.wire import (
    ErrorReply,
    GetRecords,
    Records,
    compat_hash,
    decode_side,
    encode_record,
    encode_side,
    layout_from_record,
    model_facts,
    record_from_layout,
)
from tests.engines import free_port

SPEC = LayoutSpec(AttnKind.SPLIT_KV, 4, 64, 16, 8, 128, tp_size=2)
H = compat_hash(model_facts(SPEC, model_name="m", dtype="bf16", kv_dtype="bf16"))
TIMEOUT_S = 2.0


def layout(rank: int) -> CacheLayout:
    spec = SPEC.with_rank(rank)
    addrs = [(1 << 32) + i * (1 << 24) for i in range(len(spec.region_bytes()))]
    return spec.build(addrs, engine_id="prefill-0")


def records(generation: int) -> dict[int, bytes]:
    return {
        r: encode_record(
            record_from_layout(
                layout(r), agent_name=f"p{r}", agent_metadata=b"m" * 2048, generation=generation
            ),
            H,
        )
        for r in range(2)
    }


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    srv = SideChannelServer("tcp://127.0.0.1:0", records(1)).start()
    yield srv
    srv.stop()


def raw_exchange(address: str, frames: list[bytes], kind: int = zmq.DEALER) -> list[bytes] | None:
    """Send ``frames`` from a raw socket; return the reply frames or None after 1 s."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not sock.poll(1000, zmq.POLLIN):
            return None
        return sock.recv_multipart()
    finally:
        sock.close()


def assert_serves(srv: SideChannelServer) -> None:
    recs = fetch_records(srv.address, [0, 1], H, TIMEOUT_S)
    assert [layout_from_record(r) for r in recs] == [layout(0), layout(1)]


def test_valid_fetch(server: SideChannelServer) -> None:
    assert server.address.startswith("tcp://127.0.0.1:") and not server.address.endswith(":0")
    assert_serves(server)
    (only,) = fetch_records(server.address, [1], H, TIMEOUT_S)
    assert (only.tp_rank, only.agent_name, only.generation) == (1, "p1", 1)
    assert only.agent_metadata == b"m" * 2048 and only.engine_id == "prefill-0"
    assert [r.tp_rank for r in fetch_records(server.address, None, H, TIMEOUT_S)] == [0, 1]
    assert server.num_served == 3 and server.num_rejected == 0


def test_refusals_are_typed(server: SideChannelServer) -> None:
    with pytest.raises(ProtocolError, match=r"unknown_rank.*\[7\]"):
        fetch_records(server.address, [0, 7], H, TIMEOUT_S)
    with pytest.raises(IncompatibleError, match=f"{H}.*'other'"):
        fetch_records(server.address, [0], "other", TIMEOUT_S)
    assert_serves(server)


def test_repeated_ranks_are_refused_before_any_reply_is_built(
    monkeypatch: pytest.MonkeyPatch, server: SideChannelServer
) -> None:
    # GetRecords((0,) * 4096): 4,096 copies of a record of up to 1 MiB, a reply of GBs
    # encoded (then refused as too large) by the server thread, for a 4 KiB request
    from kvxfer.transport import side_channel

    encoded: list[int] = []
    real = side_channel.encode_side

    def counting(msg: object) -> bytes:
        buf = real(msg)  # type: ignore[arg-type]
        encoded.append(len(buf))
        return buf

    monkeypatch.setattr(side_channel, "encode_side", counting)
    with pytest.raises(ProtocolError, match="ranks repeat: 4096 given, 1 distinct"):
        fetch_records(server.address, [0] * 4096, H, TIMEOUT_S)
    assert max(encoded) < 1024  # only the short refusal was encoded
    # a reply over the limit is refused from the records' sizes, before encoding it
    monkeypatch.setattr(side_channel, "MAX_SIDE_REPLY_BYTES", 4096)
    encoded.clear()
    with pytest.raises(ProtocolError, match="too_large"):
        fetch_records(server.address, [0, 1], H, TIMEOUT_S)
    assert max(encoded) < 1024
    assert server.num_rejected == 1
    monkeypatch.undo()
    assert_serves(server)


JUNK = [
    [b"garbage"],
    [b""],
    [b"", b""],
    [b"a", b"b", b"c"],
    [encode_side(GetRecords((0,), H))[:-3]],  # truncated
    [encode_side(GetRecords((0,), H)) + b"\x00"],  # trailing junk
    [encode_side(Records(()))],  # a reply is not a request
    [msgspec.msgpack.encode({"t": "get", "ranks": [-1], "expected_hash": H})],
    [msgspec.msgpack.encode({"t": "get", "ranks": list(range(5000)), "expected_hash": H})],
    [b"\x91" * 60_000],
    [bytes(range(256)) * 10],
]


@pytest.mark.parametrize("frames", JUNK, ids=range(len(JUNK)))
def test_junk_gets_error_reply_and_server_survives(
    server: SideChannelServer, frames: list[bytes]
) -> None:
    reply = raw_exchange(server.address, frames)
    assert reply is not None and len(reply) in (1, 2)  # [b"", body] is taken as a REQ envelope
    err = decode_side(reply[-1])
    assert isinstance(err, ErrorReply) and err.code == "malformed"
    assert server.num_rejected == 1
    assert_serves(server)


def test_oversized_and_non_zmtp_input_dropped(server: SideChannelServer) -> None:
    small = SideChannelServer("tcp://127.0.0.1:0", records(1), max_request_bytes=1024).start()
    try:
        assert raw_exchange(small.address, [b"\x00" * 4096]) is None  # ZMQ drops the peer
        assert_serves(small)
    finally:
        small.stop()
    host, port = server.address.removeprefix("tcp://").rsplit(":", 1)
    for junk in (b"\xff" * 10_000, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256))):
        with socket.create_connection((host, int(port)), timeout=1) as s:
            s.sendall(junk)
    assert_serves(server)


def test_req_client_accepted(server: SideChannelServer) -> None:
    reply = raw_exchange(server.address, [encode_side(GetRecords(None, H))], zmq.REQ)
    assert reply is not None
    got = decode_side(reply[0])
    assert isinstance(got, Records) and len(got.records) == 2


def test_set_records_and_callable_source(server: SideChannelServer) -> None:
    server.set_records(records(2))
    assert {r.generation for r in fetch_records(server.address, None, H, TIMEOUT_S)} == {2}
    calls = []

    def source() -> dict[int, bytes]:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("engine not ready")
        return records(3)

    server.set_records(source)
    assert fetch_records(server.address, [0], H, TIMEOUT_S)[0].generation == 3
    with pytest.raises(ProtocolError, match=r"internal.*engine not ready"):
        fetch_records(server.address, [0], H, TIMEOUT_S)
    assert fetch_records(server.address, [1], H, TIMEOUT_S)[0].generation == 3


def test_concurrent_fetches(server: SideChannelServer) -> None:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(20):
                assert_serves(server)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and server.num_served == 120


def test_nobody_listening_is_peer_lost() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match=rf"{address}.*0\.5"):
        fetch_records(address, None, H, 0.5)
    assert time.monotonic() - t0 < 0.5 + 1.0


def test_stopped_server_is_peer_lost_and_stop_idempotent(server: SideChannelServer) -> None:
    address = server.address
    server.stop()
    server.stop()
    t0 = time.monotonic()
    with pytest.raises(PeerLostError):
        fetch_records(address, None, H, 0.3)
    assert time.monotonic() - t0 < 1.3


def test_bad_addresses() -> None:
    with pytest.raises(ConfigError, match="bad address"):
        fetch_records("not-an-endpoint", None, H, 0.5)
    with pytest.raises(ConfigError, match="cannot bind"):
        SideChannelServer("nope://x", {}).start()
    with pytest.raises(ConfigError, match="ranks"):
        fetch_records("tcp://127.0.0.1:1", [-1], H, 0.5)


def test_stopped_server_cannot_restart() -> None:
    srv = SideChannelServer("tcp://127.0.0.1:0", {}).start()
    srv.stop()
    with pytest.raises(LayoutError, match="restart"):
        srv.start()


def test_a_caller_held_up_before_waiting_still_waits_for_the_reply(
    server: SideChannelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeout is the time given to the peer to answer, from the request being sent:
    a caller descheduled before it could wait (here the clock jumps 2 s, past the whole
    timeout, between two readings) is not told the peer did not answer. On a loaded
    machine (vLLM TP workers spinning) this made heartbeats report live peers lost."""
    real, me, calls = time.monotonic, threading.get_ident(), [0]

    def late_clock() -> float:  # this thread's readings after its first: 2 s later
        if threading.get_ident() != me:
            return real()
        calls[0] += 1
        return real() + (2.0 if calls[0] > 1 else 0.0)

    monkeypatch.setattr(time, "monotonic", late_clock)
    (rec,) = fetch_records(server.address, [1], H, 0.5)
    monkeypatch.undo()
    assert (rec.tp_rank, rec.agent_name) == (1, "p1")
