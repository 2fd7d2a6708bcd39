"""First contact is lazy and never blocks requests to producers already known."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer.engine.config import EngineConfig, RequestState, allocate_cache
from kvxfer.engine.consumer import Consumer
from kvxfer.engine.producer import Producer
from kvxfer.layout.presets import spec_for
from kvxfer.testing.pattern import fill, mismatches
from tests.engines import free_port, local_pair

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def test_slow_first_contact_does_not_block_known_peer() -> None:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=32)
    bufs = allocate_cache(spec)
    fill(spec, bufs)
    local = allocate_cache(spec)
    with (
        Producer(EngineConfig("p", model_name="tiny-gqa"), [(spec, bufs)]) as prod,
        Consumer(
            EngineConfig("d", model_name="tiny-gqa", handshake_timeout_s=3.0), [(spec, local)]
        ) as cons,
    ):
        cons.connect(prod.address)
        # nobody listens here: its first contact runs in the background until its timeout
        stuck = cons.read("x", "tcp://127.0.0.1:9", local_block_ids=[0], remote_block_ids=[0])
        t0 = time.monotonic()
        lids, rids = np.array([5, 6, 7]), np.array([9, 1, 4])
        ok = cons.read("r", prod.address, local_block_ids=lids, remote_block_ids=rids)
        assert ok.wait(10) is RequestState.DONE
        took = time.monotonic() - t0
        assert stuck.poll() is RequestState.PENDING  # still waiting for its handshake
        assert took < 1.0, f"a known peer's request waited {took:.2f} s behind a first contact"
        assert mismatches(spec, local, spec, lids, rids) == 0
        assert stuck.wait(10) is RequestState.PEER_LOST  # side channel never answered
        assert "no reply within timeout" in str(stuck.error)


def test_refused_pairing_leaves_no_agent_behind() -> None:
    """Block size ratio with fan-out TP is refused before any NIXL state is created."""
    from kvxfer.errors import IncompatibleError

    p_specs = [
        spec_for("tiny-gqa", tp_rank=r, tp_size=2, num_blocks=16, block_size=8) for r in range(2)
    ]
    d_spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16, block_size=16)
    with (
        Producer(
            EngineConfig("p", model_name="tiny-gqa"), [(s, allocate_cache(s)) for s in p_specs]
        ) as prod,
        Consumer(
            EngineConfig("d", model_name="tiny-gqa"), [(d_spec, allocate_cache(d_spec))]
        ) as cons,
    ):
        t = cons.read("r", prod.address, local_block_ids=[1], remote_block_ids=[2, 3])
        assert t.wait(10) is RequestState.FAILED
        assert isinstance(t.error, IncompatibleError)
        assert "block size ratio 2 with fan-out TP" in str(t.error)
        assert cons.ranks[0].backend._remotes == set()  # no remote agent was added
        assert prod.held_blocks == 0


def test_an_incompatible_producer_is_refused_naming_what_differs() -> None:
    """A compat hash says only that the models differ; the error names which fact (here
    the KV cache dtype: fp8_e5m2 and fp8_e4m3 are both one byte, so layouts agree)."""
    from kvxfer.errors import IncompatibleError

    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    with (
        Producer(EngineConfig("p", model_name="tiny-gqa", kv_dtype="fp8_e5m2"),
                 [(spec, allocate_cache(spec))]) as prod,
        Consumer(EngineConfig("d", model_name="tiny-gqa", kv_dtype="fp8_e4m3"),
                 [(spec, allocate_cache(spec))]) as cons,
    ):  # fmt: skip
        t = cons.read("r", prod.address, local_block_ids=[1], remote_block_ids=[2])
        assert t.wait(10) is RequestState.FAILED
        assert isinstance(t.error, IncompatibleError)
        msg = str(t.error)
        assert "compat hash mismatch" in msg
        assert "the models differ in kv_dtype: 'fp8_e5m2' there, 'fp8_e4m3' here" in msg, msg
        assert "model_name" not in msg.split("differ in", 1)[1], msg  # only what differs
        assert cons.ranks[0].backend._remotes == set()
        assert prod.held_blocks == 0


def test_preconnect_then_first_request_skips_first_contact() -> None:
    """A consumer told its producer's address at start contacts it in the background and
    wires the notification path (one Heartbeat per producer rank, accepted silently): the
    first request then finds the peer ready and moves every byte."""
    with local_pair(32) as (spec, local, prod, cons):
        sent: list[tuple[str, bytes]] = []
        backend = cons.ranks[0].backend
        real_send = backend.send_notif

        def spy(agent: str, msg: bytes) -> None:  # records, then sends for real
            sent.append((agent, msg))
            real_send(agent, msg)

        backend.send_notif = spy  # type: ignore[method-assign]
        th = cons.preconnect([prod.address], interval_s=0.1)
        th.join(20)
        assert not th.is_alive()
        (fc,) = cons.stats().first_contacts
        assert fc.address == prod.address
        assert set(fc.phases_s) == {"fetch", "build", "add_agent", "prepare", "wire_up"}
        from kvxfer.wire import Heartbeat, decode_msg

        assert [type(decode_msg(m)) for _, m in sent] == [Heartbeat]
        assert decode_msg(sent[0][1]).generation == prod.generation  # type: ignore[union-attr]
        lids, rids = np.array([3, 0, 31]), np.array([7, 8, 2])
        t = cons.read("r", prod.address, local_block_ids=lids, remote_block_ids=rids)
        assert t.wait(10) is RequestState.DONE
        assert mismatches(spec, local, spec, lids, rids) == 0
        assert len(cons.stats().first_contacts) == 1  # the request made no new contact
        time.sleep(0.3)  # the producer's progress thread has seen the heartbeat
        assert prod.num_rejected == 0


def test_preconnect_waits_for_a_producer_that_starts_later() -> None:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    bufs = allocate_cache(spec)
    fill(spec, bufs)
    local = allocate_cache(spec)
    address = f"tcp://127.0.0.1:{free_port()}"
    cfg = EngineConfig("d", model_name="tiny-gqa", handshake_timeout_s=0.5)
    with Consumer(cfg, [(spec, local)]) as cons:
        th = cons.preconnect([address], retry_for_s=30, interval_s=0.1)
        time.sleep(1.5)  # at least one attempt has failed by now
        assert th.is_alive() and cons.stats().first_contacts == ()
        pcfg = EngineConfig("p", model_name="tiny-gqa", side_channel_addr=address)
        with Producer(pcfg, [(spec, bufs)]) as prod:
            assert prod.address == address
            th.join(20)
            assert not th.is_alive()
            assert [f.address for f in cons.stats().first_contacts] == [address]
            t = cons.read("r", address, local_block_ids=[4, 5], remote_block_ids=[9, 15])
            assert t.wait(10) is RequestState.DONE
            assert mismatches(spec, local, spec, np.array([4, 5]), np.array([9, 15])) == 0


def test_preconnect_does_not_retry_an_incompatible_producer() -> None:
    p_specs = [
        spec_for("tiny-gqa", tp_rank=r, tp_size=2, num_blocks=16, block_size=8) for r in range(2)
    ]
    d_spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16, block_size=16)
    with (
        Producer(
            EngineConfig("p", model_name="tiny-gqa"), [(s, allocate_cache(s)) for s in p_specs]
        ) as prod,
        Consumer(
            EngineConfig("d", model_name="tiny-gqa"), [(d_spec, allocate_cache(d_spec))]
        ) as cons,
    ):
        th = cons.preconnect([prod.address], retry_for_s=60, interval_s=0.1)
        th.join(10)
        assert not th.is_alive()  # refused once, not retried for 60 s
        assert cons.stats().first_contacts == ()
        assert cons.ranks[0].backend._remotes == set()


def test_preconnect_rejects_bad_addresses_and_stops_at_close() -> None:
    from kvxfer.errors import ConfigError

    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    cfg = EngineConfig("d", model_name="tiny-gqa", handshake_timeout_s=0.5)
    cons = Consumer(cfg, [(spec, allocate_cache(spec))])
    try:
        with pytest.raises(ConfigError, match="non-empty string"):
            cons.preconnect(["tcp://127.0.0.1:9", ""])
        with pytest.raises(ConfigError, match="retry_for_s"):
            cons.preconnect(["tcp://127.0.0.1:9"], retry_for_s=-1)
        th = cons.preconnect([f"tcp://127.0.0.1:{free_port()}"], retry_for_s=600)
        time.sleep(0.3)
    finally:
        cons.close()
    th.join(5)
    assert not th.is_alive()  # close ends the retry loop long before retry_for_s


def test_preconnect_contacts_a_restarted_producer_again() -> None:
    """An address given to preconnect stays watched: when the heartbeat drops its producer
    (here it closed), the consumer contacts the address again and finds the producer's new
    incarnation there before any request names it."""
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    bufs = allocate_cache(spec)
    fill(spec, bufs)
    local = allocate_cache(spec)
    address = f"tcp://127.0.0.1:{free_port()}"
    cfg = EngineConfig("d", model_name="tiny-gqa", handshake_timeout_s=0.5, heartbeat_s=0.2)
    pcfg = EngineConfig("p", model_name="tiny-gqa", side_channel_addr=address)
    with Consumer(cfg, [(spec, local)]) as cons:
        with Producer(pcfg, [(spec, bufs)]) as first:
            cons.preconnect([address], retry_for_s=30, interval_s=0.1).join(20)
            (fc,) = cons.stats().first_contacts
            assert (fc.address, fc.generations) == (address, {0: first.generation})
        time.sleep(1.5)  # the heartbeat drops the closed producer; nothing answers yet
        with Producer(pcfg, [(spec, bufs)]) as second:
            assert second.generation != first.generation

            def contacted() -> list[tuple[str, dict[int, int]]]:
                return [(f.address, dict(f.generations)) for f in cons.stats().first_contacts]

            end = time.monotonic() + 20
            while contacted() != [(address, {0: second.generation})] and time.monotonic() < end:
                time.sleep(0.05)
            assert contacted() == [(address, {0: second.generation})]
            phases = cons.stats().first_contacts[0].phases_s
            t = cons.read("r", address, local_block_ids=[4, 5], remote_block_ids=[9, 15],
                          generation=second.generation)  # fmt: skip
            assert t.wait(10) is RequestState.DONE
            assert mismatches(spec, local, spec, np.array([4, 5]), np.array([9, 15])) == 0
            assert cons.stats().first_contacts[0].phases_s == phases  # no new contact


def _spy_nixl(*names: str) -> tuple[list[tuple[str, str]], pytest.MonkeyPatch]:
    """Record ``(agent name, call)`` for each named NixlBackend method (``make_xfer`` with
    its op), calling the real method; undo the returned MonkeyPatch when done."""
    from kvxfer.transport import nixl

    calls: list[tuple[str, str]] = []
    real = {n: getattr(nixl.NixlBackend, n) for n in names}

    def spy(name: str):  # type: ignore[no-untyped-def]
        def call(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            what = f"make_xfer {args[0].name}" if name == "make_xfer" else name
            calls.append((self.name, what))
            return real[name](self, *args, **kwargs)

        return call

    mp = pytest.MonkeyPatch()
    for n in names:
        mp.setattr(nixl.NixlBackend, n, spy(n))
    return calls, mp


def test_a_new_consumer_has_paid_the_transports_one_time_costs_before_first_contact() -> None:
    """UCX sets itself up on an agent's first peer and first transfer (measured here:
    add_agent 18 ms and the wire-up 5 ms for a consumer's first producer, 3.5 ms and
    0.1 ms for its next ones). A consumer pays that when it starts, against a throwaway
    loopback agent: the spy sees one add_remote, one WRITE from our own memory (never
    into it: the consumer's blocks stay as they were) and one notification, all before
    the first request; the warm-up agent is removed again."""
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    local = allocate_cache(spec)
    fill(spec, local)
    before = [b.copy() for b in local]
    calls, mp = _spy_nixl("add_remote", "make_xfer", "remove_remote")
    try:
        with Consumer(EngineConfig("d", model_name="tiny-gqa"), [(spec, local)]) as cons:
            assert [c[1] for c in calls] == ["add_remote", "make_xfer WRITE", "remove_remote"]
            assert cons.ranks[0].backend._remotes == set()  # the warm-up agent is gone
            assert all(np.array_equal(a, b) for a, b in zip(before, local, strict=True))
    finally:
        mp.undo()


def test_a_new_producer_has_paid_its_first_incoming_peers_cost_in_the_background() -> None:
    """A producer's UCX worker selects its protocols for a new kind of peer on the first
    connection it accepts: in separate processes the first READ from a fresh producer
    took 16-21 ms, the next ones 1-2 ms. A producer pays that after it starts, in a
    background thread, with a throwaway agent that loads the producer's metadata and
    READs 64 bytes of its first region (never writes there); the probe is gone after."""
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    bufs = allocate_cache(spec)
    fill(spec, bufs)
    before = [b.copy() for b in bufs]
    calls, mp = _spy_nixl("add_remote", "make_xfer", "close")
    try:
        with Producer(EngineConfig("p", model_name="tiny-gqa"), [(spec, bufs)]) as prod:
            assert prod.warmed_up.wait(10), "the producer's warm-up never ended"
            own = prod.ranks[0].backend.name
            probe = [c for c in calls if c[0] != own]
            assert probe == [
                (probe[0][0], "add_remote"),
                (probe[0][0], "make_xfer READ"),
                (probe[0][0], "close"),
            ], calls
            assert probe[0][0].startswith(own)  # named after the rank it warms
            assert [c for c in calls if c[0] == own] == []  # the producer's agent: untouched
            assert all(np.array_equal(a, b) for a, b in zip(before, bufs, strict=True))
    finally:
        mp.undo()


def _read_ok(prod: Producer, cons: Consumer, spec, local, address: str, i: int) -> None:  # type: ignore[no-untyped-def]
    lids, rids = np.array([i % 16]), np.array([(i + 3) % 16])
    prod.hold(f"r{i}", block_ids=rids.tolist())
    t = cons.read(f"r{i}", address, local_block_ids=lids, remote_block_ids=rids)
    assert t.wait(10) is RequestState.DONE, (i, address, t.state, t.error)
    assert mismatches(spec, local, spec, lids, rids) == 0


def test_one_producer_under_two_spellings_of_its_address() -> None:
    """``tcp://127.0.0.1:P`` and ``tcp://localhost:P`` are one producer: two peers that
    share its agents. The second contact loaded the agent again, which released the
    first peer's lists; the first's failure then removed the agent the second used
    (DONE, DONE, PEER_LOST, then FAILED for good). Each read is DONE now, and dropping
    one spelling leaves the other working."""
    with local_pair(16) as (spec, local, prod, cons):
        a = prod.address
        b = a.replace("127.0.0.1", "localhost")
        assert a != b
        for i in range(6):
            _read_ok(prod, cons, spec, local, (a, b)[i % 2], i)
        backend = cons.ranks[0].backend
        assert len(backend._remotes) == 1  # loaded once, used by both peers
        with cons._lock:
            peer_a = cons._peers[a]
        cons._drop_peer(peer_a)  # as a failed request of that spelling would
        assert len(backend._remotes) == 1  # still in use by the other spelling
        _read_ok(prod, cons, spec, local, b, 7)
        with cons._lock:
            peer_b = cons._peers[b]
        cons._drop_peer(peer_b)
        assert backend._remotes == set()  # the last user gone: removed


def _lists(cons: Consumer) -> int:
    return sum(len(c.backend._prepared) for c in cons.ranks.values())


def test_a_dropped_peer_leaves_no_prepared_list_behind() -> None:
    """Each drop leaked the local half of every (local, remote) list pair: 3, 4, 5, 6
    lists over four drops, on NIXL (the in-memory seam holds them weakly)."""
    with local_pair(16) as (spec, local, prod, cons):
        before, counts = _lists(cons), []
        for i in range(4):
            _read_ok(prod, cons, spec, local, prod.address, i)
            with cons._lock:
                peer = cons._peers[prod.address]
            cons._drop_peer(peer)
            counts.append(_lists(cons))
        assert counts == [before + 1] * 4  # the hold-check landing slots' list stays
        assert cons.ranks[0].backend._remotes == set()


def test_a_failed_first_contact_leaves_no_agent_or_list_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvxfer.errors import TransferError

    with local_pair(16) as (spec, local, prod, cons):
        real, before = cons._wire_up, _lists(cons)

        def fails(peer) -> None:  # type: ignore[no-untyped-def]
            raise TransferError("injected: wire-up failed")

        monkeypatch.setattr(cons, "_wire_up", fails)
        t = cons.read("x", prod.address, local_block_ids=[1], remote_block_ids=[2])
        assert t.wait(10) is RequestState.FAILED and "injected" in str(t.error)
        assert cons.ranks[0].backend._remotes == set()  # the agent it had added
        assert _lists(cons) == before + 1  # nor the lists it had prepared (the landing
        # slots' list, made once, stays)
        monkeypatch.setattr(cons, "_wire_up", real)
        _read_ok(prod, cons, spec, local, prod.address, 1)  # the next contact works
