"""Throw >= 10,000 malformed or mutated messages at a running producer engine.

(a) at its side-channel listener from a raw ZMQ DEALER, (b) as NIXL notifications from
an agent of our own. The producer must not crash (process and engine thread alive),
must count what it rejects, and a valid consumer must complete byte-exact transfers
during (from a thread) and after the barrage. Seeded mutator: reproducible and fast.
"""

from __future__ import annotations

import random
import threading
import time

import msgspec
import pytest
import zmq

from kvxfer.engine.config import EngineConfig, RequestState
from kvxfer.transport.nixl import NixlBackend
from kvxfer.transport.side_client import fetch_records
from kvxfer.wire import (
    MAX_LEASE_IDS,
    MAX_MSG_BYTES,
    MAX_SIDE_REQUEST_BYTES,
    Abort,
    ErrorReply,
    Failed,
    GetRecords,
    Heartbeat,
    LeaseRenew,
    ReadDone,
    Records,
    WriteDone,
    decode_side,
    encode_msg,
    encode_side,
)

from .procs import MODEL, ids, make_consumer, verify

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NUM_SIDE = 5000
NUM_NOTIF = 6000
BATCH = 250


def mutate(rng: random.Random, buf: bytes) -> bytes:
    """One random byte-level mutation: flip, insert, delete, truncate, splice or extend."""
    b = bytearray(buf)
    k = rng.randrange(6)
    if k == 0 and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif k == 1:
        b[rng.randrange(len(b) + 1) : 0] = rng.randbytes(rng.randint(1, 8))
    elif k == 2 and b:
        i = rng.randrange(len(b))
        del b[i : i + rng.randint(1, 8)]
    elif k == 3:
        b = b[: rng.randrange(len(b) + 1)]
    elif k == 4:
        b += b[: rng.randrange(len(b) + 1)]
    else:
        b += rng.randbytes(rng.randint(1, 64))
    return bytes(b)


def side_messages(rng: random.Random, expected_hash: str, n: int) -> list[list[bytes]]:
    """Frames of ``n`` junk side-channel requests (each answered by the server)."""
    valid = encode_side(GetRecords(None, expected_hash))
    shaped = [
        encode_side(GetRecords(None, "0" * 64)),  # wrong hash
        encode_side(GetRecords((0, 7, 4095), expected_hash)),  # unknown ranks
        encode_side(GetRecords((0,) * 4096, expected_hash[:-1] + "x")),
        encode_side(Records((b"x" * 100,))),  # a reply sent as a request
        encode_side(ErrorReply("internal", "boom")),
        encode_msg(ReadDone("r", 1, 0, 1)),  # a notification on the wrong channel
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4G items
        b"\x91" * 5000,  # deep nesting
    ]
    out: list[list[bytes]] = []
    for i in range(n):
        k = i % 5
        if k == 0:
            out.append([rng.randbytes(rng.randrange(0, 300))])
        elif k in (1, 2):
            out.append([mutate(rng, valid)])
        elif k == 3:
            out.append([mutate(rng, rng.choice(shaped)) if i % 2 else rng.choice(shaped)])
        else:  # several frames, or a REQ-style delimiter with junk
            out.append([b"", rng.randbytes(20)] if i % 2 else [valid, valid, b"x"])
    return out


def notif_messages(rng: random.Random, generation: int, n: int) -> list[bytes]:
    gens = [generation, generation ^ 1, 0, (1 << 64) - 1]
    out: list[bytes] = []
    for i in range(n):
        g = rng.choice(gens)
        rid = f"fuzz-{i}-" + "z" * rng.randrange(0, 150)  # never a valid consumer's id
        valid = rng.choice([
            # ranks in and out of range: raw msgpack (ReadDone refuses the latter when built)
            msgspec.msgpack.encode({"t": "rd", "request_id": rid, "generation": g,
                                    "consumer_rank": rng.randrange(8),
                                    "consumer_size": rng.randrange(0, 9)}),
            encode_msg(Abort(rid, g, "fuzz")),
            encode_msg(Failed(rid, g, "x" * rng.randrange(1024))),
            encode_msg(LeaseRenew(tuple(f"{rid}{j}" for j in range(rng.randrange(MAX_LEASE_IDS))), g)),
            encode_msg(Heartbeat(g)),
            encode_msg(WriteDone(rid, g, 0, 1)),
        ])  # fmt: skip
        k = i % 4
        if k == 0:
            out.append(valid)  # well-formed: unknown ids, wrong or right generation
        elif k in (1, 2):
            out.append(mutate(rng, valid) or b"\x00")
        elif i % 40 == 3:
            out.append(rng.randbytes(MAX_MSG_BYTES + rng.randrange(1, 4096)))  # oversized
        else:
            out.append(rng.randbytes(rng.randrange(1, 200)))
    return out


def test_fuzz_producer(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    a = spawn(engine_id="pa").start()
    remote = a.remote_spec()
    expected_hash = EngineConfig("x", model_name=MODEL).compat_hash(remote)
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0)
    closing(cons)
    num_valid = 40
    a.hold([(f"valid-{i}", 2) for i in range(num_valid)])

    # a valid consumer keeps reading (and verifying) while the barrage runs
    stop, results = threading.Event(), []

    def consume() -> None:
        i = 0
        while not stop.is_set() and i < num_valid - 5:  # keep 5 for after
            lids, rids = ids(2 * (i % 20), 2 * (i % 20) + 1), ids(i % 64, (i + 9) % 64)
            t = cons.read(f"valid-{i}", a.address, local_block_ids=lids, remote_block_ids=rids)
            st = t.wait(20)
            results.append(
                (st, verify(ranks, remote, lids, rids) if st is RequestState.DONE else -1)
            )
            i += 1
            time.sleep(0.01)

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    rng = random.Random(1234)
    t0 = time.perf_counter()

    # (a) side channel: pipelined batches on one DEALER; every request gets a reply
    replies = {"ErrorReply": 0, "Records": 0}
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(a.address)
        msgs = side_messages(rng, expected_hash, NUM_SIDE)
        for lo in range(0, len(msgs), BATCH):
            batch = msgs[lo : lo + BATCH]
            for frames in batch:
                sock.send_multipart(frames)
            for _ in batch:
                assert sock.poll(5000, zmq.POLLIN), "side channel stopped answering"
                *delim, reply = sock.recv_multipart()
                assert delim in ([], [b""])  # REQ-style requests get the delimiter back
                replies[type(decode_side(reply)).__name__] += 1
    finally:
        sock.close()
    for _ in range(3):  # oversized: ZMQ drops them (and the connection) before the server
        big = zmq.Context.instance().socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(a.address)
        big.send(b"\x00" * (MAX_SIDE_REQUEST_BYTES + 1))
        time.sleep(0.05)
        big.close()
    side_s = time.perf_counter() - t0

    # (b) NIXL notifications from an agent of our own
    recs = fetch_records(a.address, None, expected_hash, 2.0)
    fuzzer = closing(NixlBackend("fuzzer", progress_delay_us=1000))
    agent = fuzzer.add_remote(recs[0].agent_metadata)
    assert agent == a.agent_name
    t1 = time.perf_counter()
    notifs = notif_messages(rng, a.generation, NUM_NOTIF)
    for msg in notifs:
        fuzzer.send_notif(agent, msg)
    notif_s = time.perf_counter() - t1

    during = len(results)  # reads that finished while the barrage ran
    stop.set()
    reader.join(30)
    assert not reader.is_alive()
    # wait (bounded) until the producer has drained its notification queue
    until, last = time.monotonic() + 20, -1
    while time.monotonic() < until:
        s = a.stats()
        seen = s["num_rejected"] + s["num_unknown_acks"]
        if seen == last:
            break
        last = seen
        time.sleep(0.3)
    print(f"[measure] fuzz: {NUM_SIDE} side-channel msgs in {side_s:.2f} s ({replies}), "
          f"{NUM_NOTIF} notifications in {notif_s:.2f} s; {during} verified reads during; "
          f"producer: {s}")  # fmt: skip

    assert a.proc.is_alive() and s["thread_alive"]
    assert replies["ErrorReply"] + replies["Records"] == NUM_SIDE
    assert s["server_rejected"] >= NUM_SIDE // 2
    assert s["num_rejected"] >= NUM_NOTIF // 2  # malformed, oversized, wrong generation
    assert s["num_unknown_acks"] > 0  # well-formed ReadDone for unknown request ids
    assert during >= 1
    assert all(st is RequestState.DONE and bad == 0 for st, bad in results), results

    # and after the barrage: a fresh consumer connects and reads byte-exact
    cons2, ranks2 = make_consumer("tiny-gqa", 64, engine_id="decode2")
    closing(cons2)
    for j in range(len(results), num_valid):
        lids, rids = ids(0, 1), ids(j, j + 1)
        t = cons2.read(f"valid-{j}", a.address, local_block_ids=lids, remote_block_ids=rids)
        assert t.wait(20) is RequestState.DONE, t.error
        assert verify(ranks2, remote, lids, rids) == 0
    stats = a.wait_free(5)
    assert stats["held_blocks"] == 0
    assert stats["freed_by_reason"] == {"read": num_valid}
    assert a.proc.is_alive() and stats["thread_alive"]
