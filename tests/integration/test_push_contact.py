"""A push consumer's first contact asks the producer to contact it back at once
(``EngineConfig.push_contact``), so its first push does not fetch its records on the way;
announcements never replace a known consumer and a bad one costs nothing but a log line."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvxfer.engine import RequestState
from kvxfer.testing import mismatches
from kvxfer.wire import Heartbeat, encode_msg
from tests.engines import free_port, local_pair

pytestmark = pytest.mark.timeout(60)


def _count_fetches(prod: Any) -> list[str]:
    """Record every consumer-records fetch the producer's push worker starts."""
    pusher = prod._pusher
    calls: list[str] = []
    real: Callable[[str], None] = pusher._fetch

    def counted(address: str) -> None:
        calls.append(address)
        real(address)

    pusher._fetch = counted
    return calls


def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def _push_ok(spec: Any, local: Any, cons: Any, prod: Any, rid: str, lid: int, rid_: int) -> None:
    t = cons.push(rid, prod.address, local_block_ids=[lid], remote_block_ids=[rid_])
    assert t.wait(10) is RequestState.DONE, t.error
    assert mismatches(spec, local, spec, np.array([lid]), np.array([rid_])) == 0


def test_a_push_consumer_is_contacted_back_at_first_contact() -> None:
    with local_pair(16, push_contact=True) as (spec, local, prod, cons):
        fetches = _count_fetches(prod)
        cons.connect(prod.address)
        assert _until(lambda: cons.address in prod._pusher._peers)
        assert fetches == [cons.address]
        _push_ok(spec, local, cons, prod, "r1", 2, 9)
        assert fetches == [cons.address]  # the first push fetched nothing on its path
        cons._drop_peer(cons._peers[prod.address])  # contact again: already known there
        _push_ok(spec, local, cons, prod, "r2", 3, 10)
        time.sleep(0.2)
        assert fetches == [cons.address]


def test_without_push_contact_the_first_push_contacts_on_its_path() -> None:
    with local_pair(16) as (spec, local, prod, cons):
        fetches = _count_fetches(prod)
        cons.connect(prod.address)
        time.sleep(0.5)
        assert cons.address not in prod._pusher._peers and fetches == []
        _push_ok(spec, local, cons, prod, "r1", 2, 9)
        assert fetches == [cons.address]


def test_an_announcement_naming_a_dead_address_costs_only_a_log_line() -> None:
    with local_pair(16) as (spec, local, prod, cons):
        fetches = _count_fetches(prod)
        peer = cons.connect(prod.address)
        dead = f"tcp://127.0.0.1:{free_port()}"
        agent = peer.agents[0]
        for _ in range(20):  # one fetch at most, however often it is announced
            cons.ranks[0].backend.send_notif(agent, encode_msg(Heartbeat(prod.generation, dead, 7)))
        assert _until(lambda: fetches == [dead])
        time.sleep(cons.config.handshake_timeout_s + 0.5)  # that fetch fails meanwhile
        assert dead not in prod._pusher._peers and prod._pusher.num_errors == 0
        assert fetches == [dead]
        _push_ok(spec, local, cons, prod, "r1", 4, 11)  # the producer serves on
        assert prod.num_rejected == 0


def test_an_announced_consumer_of_another_model_is_refused_naming_what_differs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the producer's own contact with a consumer (here announced ahead of its pushes)
    # names the model facts that differ, as a consumer's contact does; nothing is added
    from kvxfer.engine import Consumer, EngineConfig, allocate_cache

    with local_pair(16) as (spec, local, prod, cons):
        fetches = _count_fetches(prod)
        peer = cons.connect(prod.address)
        other_cfg = EngineConfig("d2", model_name="tiny-gqa", kv_dtype="fp8_e5m2")
        with Consumer(other_cfg, [(spec, allocate_cache(spec))]) as other:
            with caplog.at_level("INFO", logger="kvxfer.engine.pusher"):
                announce = Heartbeat(prod.generation, other.address, 7)
                cons.ranks[0].backend.send_notif(peer.agents[0], encode_msg(announce))
                assert _until(lambda: "differ in" in caplog.text)
            assert fetches == [other.address]
            assert other.address not in prod._pusher._peers
            line = next(r.getMessage() for r in caplog.records if "differ in" in r.getMessage())
            assert f"contacting consumer {other.address} ahead of its pushes failed" in line
            assert "the models differ in kv_dtype: 'fp8_e5m2' there, 'bfloat16' here" in line, line
            assert "model_name" not in line.split("differ in", 1)[1], line
        _push_ok(spec, local, cons, prod, "r1", 4, 11)  # the producer serves on


def test_a_restarted_consumer_announcing_itself_is_contacted_again_before_its_first_push() -> None:
    """A decode restarted at the same side-channel address announces its new incarnation
    at first contact; the producer fetches it then (it had skipped every known address),
    so the new decode's first push does not pay the contact on its path (review finding
    of stop 29). A repeated announcement of the incarnation it has costs nothing."""
    from kvxfer.engine import Consumer, EngineConfig, allocate_cache
    from kvxfer.errors import KvxferError

    with local_pair(16) as (spec, _, prod, _):
        fetches = _count_fetches(prod)
        addr = f"tcp://127.0.0.1:{free_port()}"

        def start() -> Consumer:
            cfg = EngineConfig("dr", model_name="tiny-gqa", side_channel_addr=addr,
                               push_contact=True)  # fmt: skip
            end = time.monotonic() + 5.0
            while True:  # the old incarnation's port is freed by ZMQ's IO thread
                try:
                    return Consumer(cfg, [(spec, allocate_cache(spec))])
                except KvxferError:  # its port still bound: a ConfigError
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.05)

        with start() as old:
            old.connect(prod.address)
            assert _until(lambda: addr in prod._pusher._peers)
        with start() as new:
            new.connect(prod.address)
            assert _until(lambda: prod._pusher._peers.get(addr) is not None
                          and prod._pusher._peers[addr].generation == new.generation)  # fmt: skip
            assert fetches == [addr, addr]
            local = new.ranks[0].bufs
            t = new.push("r1", prod.address, local_block_ids=[2], remote_block_ids=[9])
            assert t.wait(10) is RequestState.DONE, t.error
            assert mismatches(spec, local, spec, np.array([2]), np.array([9])) == 0
            new._drop_peer(new._peers[prod.address])  # announced again: the same incarnation
            new.connect(prod.address)
            time.sleep(0.3)
            assert fetches == [addr, addr]  # neither the push nor the repeat fetched
