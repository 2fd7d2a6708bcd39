"""A deployment key authenticates the engines' control plane end to end: side channel
and NIXL notifications (issue 9 item 16), with real NIXL agents and real ZMQ."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxfer.engine.config import EngineConfig, RequestState, allocate_cache
from kvxfer.engine.consumer import Consumer
from kvxfer.engine.producer import Producer
from kvxfer.layout.presets import spec_for
from kvxfer.testing.pattern import fill, mismatches
from kvxfer.transport.nixl import NixlBackend
from kvxfer.wire import ReadDone, encode_msg

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

KEY = b"k" * 32


def _config(name: str, key: bytes | None) -> EngineConfig:
    return EngineConfig(name, model_name="tiny-gqa", auth_key=key, handshake_timeout_s=2.0)


def test_keyed_engines_move_verified_bytes_and_refuse_the_unkeyed() -> None:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    bufs = allocate_cache(spec)
    fill(spec, bufs)
    local = allocate_cache(spec)
    with (
        Producer(_config("p", KEY), [(spec, bufs)]) as prod,
        Consumer(_config("d", KEY), [(spec, local)]) as cons,
        Consumer(_config("x", None), [(spec, allocate_cache(spec))]) as stranger,
    ):
        prod.hold("r1", num_blocks=2)
        t = cons.read("r1", prod.address, local_block_ids=[3, 4], remote_block_ids=[7, 2])
        assert t.wait(10) is RequestState.DONE
        assert mismatches(spec, local, spec, np.array([3, 4]), np.array([7, 2])) == 0
        # the producer obeyed the consumer's sealed ReadDone: the blocks are free
        deadline = time.monotonic() + 5
        while prod.held_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prod.held_blocks == 0

        # a consumer without the key learns nothing: first contact fails, no agent added
        prod.hold("r2", num_blocks=1)
        u = stranger.read("r2", prod.address, local_block_ids=[0], remote_block_ids=[1])
        assert u.wait(10) is not RequestState.DONE
        assert "auth" in str(u.error).lower()
        assert stranger.ranks[0].backend._remotes == set()
        assert prod.held_blocks == 1


def test_unsealed_notification_from_a_metadata_holder_is_not_obeyed() -> None:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    with Producer(_config("p", KEY), [(spec, allocate_cache(spec))]) as prod:
        prod.hold("r", num_blocks=3)
        backend = prod.ranks[0].backend
        # an attacker that somehow holds the producer's agent metadata (the side channel
        # does not give it out without the key) forges a ReadDone for the request
        attacker = NixlBackend("attacker", progress_delay_us=1000)
        try:
            peer = attacker.add_remote(backend.metadata())
            forged = encode_msg(ReadDone("r", prod.generation, 0, 1))
            for _ in range(5):
                attacker.send_notif(peer, forged)
            deadline = time.monotonic() + 3
            while backend.num_unauthenticated < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert backend.num_unauthenticated == 5
            assert prod.held_blocks == 3  # never freed by the forgery
        finally:
            attacker.close()


def test_each_receiving_agent_judges_replays_alone() -> None:
    # one process-wide replay guard: a sender's counter runs across all its receivers,
    # so after 1,100 notices to one rank, the one it sent before to another rank of the
    # same process was "too old" there (dropped), when drained second
    sender = NixlBackend("s-keyed", auth_key=KEY)
    r1, r2 = NixlBackend("r1-keyed", auth_key=KEY), NixlBackend("r2-keyed", auth_key=KEY)
    try:
        to_r1, to_r2 = sender.add_remote(r1.metadata()), sender.add_remote(r2.metadata())
        sender.send_notif(to_r2, b"first, to r2")
        for i in range(1100):
            sender.send_notif(to_r1, b"%d" % i)
        got1: list[bytes] = []
        end = time.monotonic() + 20
        while len(got1) < 1100 and time.monotonic() < end:
            got1 += [m for ms in r1.get_notifs().values() for m in ms]
        assert len(got1) == 1100
        got2: list[bytes] = []
        while not got2 and time.monotonic() < end:
            got2 += [m for ms in r2.get_notifs().values() for m in ms]
            time.sleep(0.01)
        assert got2 == [b"first, to r2"] and r2.num_unauthenticated == 0
        # and a frame sent to r1 never opens at r2 (it is bound to its receiver)
        assert r1.num_unauthenticated == 0
    finally:
        for b in (sender, r1, r2):
            b.close()


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_a_backend_factory_must_carry_the_key(role: str) -> None:
    """A keyed engine given a ``backend_factory`` ran its side channel keyed but its
    notifications unkeyed: forged ReadDone/Abort/LeaseRenew/PushRequest were obeyed."""
    from kvxfer.errors import ConfigError

    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    engine = Producer if role == "producer" else Consumer
    with pytest.raises(ConfigError, match=r"backend_factory.*does not carry the config's auth_key"):
        engine(_config("e", KEY), [(spec, allocate_cache(spec))],
               backend_factory=lambda n: NixlBackend(n, num_threads=2))  # fmt: skip
    with engine(_config("e", KEY), [(spec, allocate_cache(spec))],
                backend_factory=lambda n: NixlBackend(n, auth_key=KEY)) as ok:  # fmt: skip
        assert ok.ranks[0].backend.auth_key == KEY
