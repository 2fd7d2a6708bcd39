"""The vLLM worker side on a step with nothing else to run (no tokens scheduled) waits,
bounded, for its transfers instead of returning at once: vLLM steps without pause while a
request waits for its KV (decode) or while a finished request's blocks wait to be read
(prefill), so every empty step returned at once is a spin of the worker's thread. The
wait ends as soon as something ends (a ReadDone frees a hold, a READ completes), and
never happens when nothing is in flight. Real NIXL engines in one process; no vLLM."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from kvxfer.engine import Consumer, EngineConfig, Producer, allocate_cache
from kvxfer.integrations.vllm.params import RemotePrefill
from kvxfer.integrations.vllm.scheduler import LoadJob
from kvxfer.integrations.vllm.worker import WorkerSettings, WorkerSide
from kvxfer.layout.presets import spec_for
from kvxfer.testing import fill, mismatches

pytestmark = pytest.mark.timeout(60)

SPEC = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)


def _side() -> WorkerSide:
    settings = WorkerSettings("e", 0, 1, 16, 2, "CPU_ATTN", True, True, "tiny-gqa", "float16")
    return WorkerSide(settings)


def _remote(address: str, request_id: str, blocks: tuple[int, ...], gen: int = 0) -> RemotePrefill:
    return RemotePrefill("p", request_id, address, (gen,), blocks, 16, 1, 16 * len(blocks))


@pytest.fixture
def producer():  # type: ignore[no-untyped-def]
    bufs = allocate_cache(SPEC)
    fill(SPEC, bufs)
    with Producer(EngineConfig("iwp", model_name="tiny-gqa"), [(SPEC, bufs)]) as p:
        yield p, bufs


def test_nothing_in_flight_means_no_wait() -> None:
    side = _side()
    t0 = time.monotonic()
    assert side.finished(idle_wait_s=2.0) == (set(), set())
    assert time.monotonic() - t0 < 0.5


def test_a_prefill_step_waits_for_the_read_done_and_reports_the_free(producer) -> None:  # type: ignore[no-untyped-def]
    prod, _ = producer
    side = _side()
    side.producer = prod
    prod.hold("r1", block_ids=[3, 4])
    d_bufs = allocate_cache(SPEC)
    with Consumer(EngineConfig("iwd", model_name="tiny-gqa"), [(SPEC, d_bufs)]) as cons:
        cons.connect(prod.address)  # first contact before the clock starts

        def read_later() -> None:
            time.sleep(0.3)
            cons.read("r1", prod.address, local_block_ids=np.array([5, 6]),
                      remote_block_ids=np.array([3, 4])).wait(10)  # fmt: skip

        reader = threading.Thread(target=read_later)
        reader.start()
        t0 = time.monotonic()
        sending, recving = side.finished(idle_wait_s=5.0)
        waited = time.monotonic() - t0
        reader.join()
    assert sending == {"r1"} and recving == set()
    assert 0.2 <= waited < 3.0, waited  # woken by the ReadDone, not by the 5 s bound
    assert side.finished(idle_wait_s=2.0) == (set(), set())  # nothing held: no wait


def test_a_busy_step_does_not_wait(producer) -> None:  # type: ignore[no-untyped-def]
    prod, _ = producer
    side = _side()
    side.producer = prod
    prod.hold("r2", block_ids=[1])
    t0 = time.monotonic()
    assert side.finished() == (set(), set())  # idle_wait_s=0: vLLM had tokens to run
    assert time.monotonic() - t0 < 0.5
    prod.release("r2")


def test_a_decode_step_waits_for_its_load_and_reports_it_done(producer) -> None:  # type: ignore[no-untyped-def]
    prod, p_bufs = producer
    d_bufs = allocate_cache(SPEC)
    with Consumer(EngineConfig("iwd2", model_name="tiny-gqa"), [(SPEC, d_bufs)]) as cons:
        side = _side()
        side.consumer = cons
        prod.hold("r3", block_ids=[7, 8, 9])
        side.start(
            [
                LoadJob(
                    "d3",
                    _remote(prod.address, "r3", (7, 8, 9), prod.generation),
                    (1, 2, 3),
                    (7, 8, 9),
                )
            ],
            [],
        )
        sending, recving = side.finished(idle_wait_s=5.0)  # first contact + READ inside
        if not recving:  # a loaded machine: the bound (5 s) passed first; never wrong
            sending, recving = side.finished(idle_wait_s=5.0)
        assert recving == {"d3"}
        assert side.take_load_errors() == set()
        assert mismatches(SPEC, d_bufs, SPEC, np.array([1, 2, 3]), np.array([7, 8, 9])) == 0


def test_a_load_stuck_in_first_contact_waits_no_longer_than_the_bound() -> None:
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        d_bufs = allocate_cache(SPEC)
        with Consumer(EngineConfig("iwd3", model_name="tiny-gqa", handshake_timeout_s=20.0),
                      [(SPEC, d_bufs)]) as cons:  # fmt: skip
            side = _side()
            side.consumer = cons
            address = f"tcp://127.0.0.1:{port}"
            side.start([LoadJob("d4", _remote(address, "r4", (1,)), (1,), (1,))], [])
            t0 = time.monotonic()
            assert side.finished(idle_wait_s=0.3) == (set(), set())
            waited = time.monotonic() - t0
            assert 0.25 <= waited < 2.0, waited
    finally:
        silent.close(0)


def test_a_busy_step_yields_only_to_a_contact_past_its_fetch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A busy step waits up to 2 ms for a first contact's CPU work (build, add agent,
    prepare), which starves for the GIL beside vLLM's loop. A contact still fetching
    waits on the network and needs no GIL: a client naming a silent host in its params
    taxed every busy step 2 ms for 10 s (found by a review). Now it costs nothing."""
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Consumer(EngineConfig("iwd5", model_name="tiny-gqa", handshake_timeout_s=20.0),
                      [(SPEC, allocate_cache(SPEC))]) as cons:  # fmt: skip
            side = _side()
            side.consumer = cons
            address = f"tcp://127.0.0.1:{port}"
            side.start([LoadJob("d5", _remote(address, "r5", (1,)), (1,), (1,))], [])
            side.finished()  # posts the load: its first contact starts
            (load,) = side._loads.values()
            peer = load.transfer.peer
            waits: list[float] = []
            real = type(peer.ready).wait

            def wait(self, timeout=None):  # type: ignore[no-untyped-def]
                if self is peer.ready:
                    waits.append(timeout)
                return real(self, timeout)

            monkeypatch.setattr(type(peer.ready), "wait", wait)
            assert peer.phase == "fetch"
            side.finished()  # a busy step (idle_wait_s 0)
            assert waits == [], "a busy step waited on a contact that is fetching"
            peer.enter("build")  # as the handshake thread does once records arrived
            side.finished()
            assert waits == [0.002]
    finally:
        silent.close(0)
