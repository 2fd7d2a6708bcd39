"""A pull READ that ended without DONE must not land in blocks the caller reuses.

Found by a review, reproduced here on real NIXL between processes: over UCX's TCP
transport, releasing a READ in flight does not stop it. The producer's worker serves
the GET when the producer runs again, and the bytes land in the consumer's blocks
after the request ended TIMEOUT, in blocks that another request (from another
producer) had meanwhile filled and reported DONE: 8,355,734 wrong bytes in the
reviewer's run. (The same-host default, CMA, copies out of a stopped process at once,
so the READ finishes before its deadline and the tests on it never saw this.)

Now a READ still in progress when its request ends is not released: the request is
``quarantined`` until NIXL reports it ended (or ``deadline + lease_s``), like a push
whose producer has not confirmed. The vLLM connector already holds back a quarantined
load's blocks."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from kvxfer.engine.config import RequestState
from kvxfer.errors import TransferError
from kvxfer.transport.nixl import NixlBackend, XferOp, XferState
from kvxfer.wire import encode_msg
from tests.engines import local_pair, until

from .procs import clear, ids, make_consumer, start_all, verify, wait_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

NB = 256


def test_a_timed_out_read_over_tcp_never_lands_in_reused_blocks(
    monkeypatch: pytest.MonkeyPatch, spawn, closing
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by each UCX context: producers and consumer
    a, b = start_all([spawn(engine_id="pa", num_blocks=NB), spawn(engine_id="pb", num_blocks=NB)])
    cons, ranks = make_consumer("tiny-gqa", NB, handshake_timeout_s=2.0)
    closing(cons)
    n = NB // 2
    lids = np.arange(n)
    a.hold([("warm", 2), ("stalled", n)])
    b.hold([("warmb", 2), ("new", n)])
    for rid, p in (("warm", a), ("warmb", b)):
        t = cons.read(rid, p.address, local_block_ids=ids(0, 1), remote_block_ids=ids(5, 6))
        assert t.wait(20) is RequestState.DONE, t.error
    clear(ranks)
    a.stop_process()
    try:
        t0 = time.monotonic()
        stalled = cons.read("stalled", a.address, local_block_ids=lids,
                            remote_block_ids=np.arange(n), deadline_s=1.0)  # fmt: skip
        wait_all([stalled], 6)
        assert stalled.state is RequestState.TIMEOUT, (stalled.state, stalled.error)
        assert time.monotonic() - t0 < 1.0 + 1.5, "not ended by its deadline"
        # the READ is still in progress at the stopped producer: the blocks are not free
        assert stalled.quarantined
        time.sleep(0.5)
        assert stalled.quarantined
    finally:
        a.signal(signal.SIGCONT)
    # the producer runs again: its GET is served, NIXL reports the READ ended, and only
    # then are the blocks free
    assert until(lambda: not stalled.quarantined, 20), "the quarantine did not end"
    t = cons.read("new", b.address, local_block_ids=lids, remote_block_ids=np.arange(n, 2 * n))
    assert t.wait(20) is RequestState.DONE, t.error
    time.sleep(1.0)  # a late READ would land now
    wrong = verify(ranks, b.remote_spec(), lids, np.arange(n, 2 * n))
    print(f"[measure] wrong bytes in the reused blocks 1 s after the producer resumed: {wrong}")
    assert wrong == 0


def test_a_read_nixl_cannot_cancel_keeps_its_blocks_quarantined(
    monkeypatch: pytest.MonkeyPatch, spawn, closing
) -> None:  # type: ignore[no-untyped-def]
    """NIXL's release of a transfer it cannot cancel raises and keeps the handle (its
    documented contract). kvxfer forgot the handle first, so it could neither poll nor
    release it again, and the request's blocks were free at once (found by a review)."""
    a = spawn(engine_id="pa", num_blocks=64).start()
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0)
    closing(cons)
    a.hold([("warm", 2), ("stuck", 4)])
    t = cons.read("warm", a.address, local_block_ids=ids(0, 1), remote_block_ids=ids(5, 6))
    assert t.wait(20) is RequestState.DONE, t.error
    stuck: dict[int, bool] = {}  # id(handle) -> whether NIXL may release it yet
    real_post, real_poll, real_release = NixlBackend.post, NixlBackend.poll, NixlBackend.release

    def post(self: NixlBackend, x):  # type: ignore[no-untyped-def]
        state = real_post(self, x)
        if x.num_descriptors > 1:  # the data READ (not a one-word hold check)
            stuck[id(x)] = False
            return XferState.IN_PROGRESS
        return state

    def poll(self: NixlBackend, x):  # type: ignore[no-untyped-def]
        if id(x) in stuck and not stuck[id(x)]:
            return XferState.IN_PROGRESS
        return real_poll(self, x)

    def release(self: NixlBackend, x):  # type: ignore[no-untyped-def]
        if id(x) in stuck and not stuck[id(x)]:
            # NIXL's UCX plugin (nixlAgent::releaseXferReq): cannot cancel, handle kept
            raise TransferError("release_xfer_handle failed: transfer in progress")
        return real_release(self, x)

    monkeypatch.setattr(NixlBackend, "post", post)
    monkeypatch.setattr(NixlBackend, "poll", poll)
    monkeypatch.setattr(NixlBackend, "release", release)
    t = cons.read("stuck", a.address, local_block_ids=ids(2, 3, 4, 5),
                  remote_block_ids=ids(8, 9, 10, 11), deadline_s=0.5)  # fmt: skip
    wait_all([t], 5)
    assert t.state is RequestState.TIMEOUT, (t.state, t.error)
    assert t.quarantined and t.quarantined
    for k in stuck:  # NIXL finished it: now it can be released, without anyone asking
        stuck[k] = True  # (the consumer's inbox thread polls READs left running)
    backend = cons.ranks[0].backend
    assert until(lambda: backend._xfers == {}, 5), "the READ's handle was not released"
    assert not t.quarantined and t.lingering == []


@pytest.mark.parametrize("ends", ["peer_lost", "timeout"])
def test_a_read_released_with_its_dropped_peer_stays_quarantined_until_it_is_gone(
    monkeypatch: pytest.MonkeyPatch, spawn, closing, ends: str
) -> None:  # type: ignore[no-untyped-def]
    """The heartbeat drops a stopped producer (silence, not proof of death) and releases
    its agent's transfers with it: the READ cannot be polled any more and may still land
    when the producer runs again, so the blocks stay quarantined until its process is
    proven gone (here: killed, so its port refuses connections). "timeout": the request
    ended first, its READ left running, and the drop came after."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    a = spawn(engine_id="pa", num_blocks=NB).start()
    cons, ranks = make_consumer("tiny-gqa", NB, handshake_timeout_s=0.5, heartbeat_s=0.2)
    closing(cons)
    n = NB // 2
    a.hold([("warm", 2), ("stalled", n)])
    t = cons.read("warm", a.address, local_block_ids=ids(0, 1), remote_block_ids=ids(5, 6))
    assert t.wait(20) is RequestState.DONE, t.error
    a.stop_process()
    try:
        t = cons.read("stalled", a.address, local_block_ids=np.arange(n),
                      remote_block_ids=np.arange(n),
                      deadline_s=5.0 if ends == "peer_lost" else 0.3)  # fmt: skip
        want = RequestState.PEER_LOST if ends == "peer_lost" else RequestState.TIMEOUT
        assert t.wait(10) is want, (t.state, t.error)
        assert t.quarantined
        # the heartbeat drops the silent producer (its READs go with its agent)
        assert until(lambda: a.address not in cons._peers, 10)
        assert all(x.is_lost for _, x in t.lingering) and t.quarantined
    finally:
        a.signal(signal.SIGCONT)
    time.sleep(1.0)  # running again: the same process, not proven gone
    assert t.quarantined
    a.kill()
    assert until(lambda: not t.quarantined, 10), "not released once the producer was gone"


def _hold_in_progress(
    monkeypatch: pytest.MonkeyPatch,
    op: XferOp,
    *,
    first_only: bool = False,
    drop_notif: bool = False,
) -> dict[int, bool]:
    """Transfers of ``op`` posted from now on (data READs: more than one descriptor; only
    the first one with ``first_only``) report IN_PROGRESS until their gate opens (set
    True): NIXL still runs them, as to a slow or stopped peer. Their bytes have landed;
    with ``drop_notif`` their notification is not sent (NIXL sends it when they end)."""
    gate: dict[int, bool] = {}
    real_post, real_poll, real_make = NixlBackend.post, NixlBackend.poll, NixlBackend.make_xfer

    def make_xfer(self: NixlBackend, xop, local, lids, remote, rids, notif=b""):  # type: ignore[no-untyped-def]
        drop = drop_notif and xop is op
        return real_make(self, xop, local, lids, remote, rids, b"" if drop else notif)

    def post(self: NixlBackend, x):  # type: ignore[no-untyped-def]
        state = real_post(self, x)
        data = op is XferOp.WRITE or x.num_descriptors > 1
        if x.op is op and data and not (first_only and gate):
            gate[id(x)] = False
            return XferState.IN_PROGRESS
        return state

    def poll(self: NixlBackend, x):  # type: ignore[no-untyped-def]
        state = real_poll(self, x)
        return XferState.IN_PROGRESS if gate.get(id(x)) is False else state

    monkeypatch.setattr(NixlBackend, "make_xfer", make_xfer)
    monkeypatch.setattr(NixlBackend, "post", post)
    monkeypatch.setattr(NixlBackend, "poll", poll)
    return gate


def _gate_writes(monkeypatch: pytest.MonkeyPatch) -> dict[int, bool]:
    return _hold_in_progress(monkeypatch, XferOp.WRITE, drop_notif=True)


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_push_is_confirmed_cancelled_only_once_its_write_ended(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The producer released a WRITE in flight and sent Cancelled at once (on the
    consumer's Abort, or at the deadline), which ended the consumer's quarantine while
    the WRITE could still land (found by a review, by the same reasoning as pull). Now
    Cancelled goes once NIXL reports the WRITE ended."""
    with local_pair() as (_, _, prod, cons):
        t = cons.push("warm", prod.address, local_block_ids=[0], remote_block_ids=[0])
        assert t.wait(10) is RequestState.DONE, t.error
        gate = _gate_writes(monkeypatch)
        t = cons.push("slow", prod.address, local_block_ids=[1, 2], remote_block_ids=[3, 4],
                      deadline_s=5.0 if how == "cancel" else 1.0)  # fmt: skip
        assert until(lambda: (t.poll(), gate)[1], 5), "no WRITE was posted"
        if how == "cancel":
            assert t.cancel() is RequestState.ABORTED
        else:
            assert t.wait(5) is RequestState.TIMEOUT, (t.state, t.error)
        time.sleep(1.0)  # the producer's deadline passes too
        assert t.quarantined, "the producer confirmed while its WRITE still ran"
        for k in gate:
            gate[k] = True
        assert until(lambda: not t.quarantined, 5), "no confirmation once the WRITE ended"


def test_an_abort_of_a_queued_push_survives_a_flood_of_other_aborts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A queued push's cancel was a mark in a 4,096-entry LRU that every Abort (pull ones
    too) fed: past 4,096 others before the job was dequeued, it was written into blocks
    whose quarantine had ended (found by a review). Marks of queued attempts are exact."""
    with local_pair() as (_, local, prod, cons):
        t = cons.push("warm", prod.address, local_block_ids=[0], remote_block_ids=[0])
        assert t.wait(10) is RequestState.DONE, t.error
        for b in local:
            b[:] = 0
        pusher = prod._pusher
        go = threading.Event()
        real_do = pusher._do

        def do(cmd):  # type: ignore[no-untyped-def]
            if cmd[0] == "block":
                go.wait(20)
                return
            real_do(cmd)

        monkeypatch.setattr(pusher, "_do", do)
        pusher._jobs.put(("block", None))  # the push thread is busy: jobs stay queued
        t = cons.push("victim", prod.address, local_block_ids=[1, 2], remote_block_ids=[3, 4])

        def queued(kind: str) -> bool:
            return any(c is not None and c[0] == kind for c in list(pusher._jobs.queue))

        assert until(lambda: (t.poll(), queued("push"))[1], 5)
        assert t.cancel() is RequestState.ABORTED
        assert until(lambda: queued("cancel"), 5)  # the producer thread passed its Abort
        for i in range(5000):  # other consumers' Aborts, as the producer thread passes them
            pusher.cancel(0, "another-agent", f"r{i}", i + 1)
        go.set()
        assert until(lambda: pusher._jobs.qsize() == 0, 5)
        time.sleep(0.5)
        landed = sum(int(np.count_nonzero(b)) for b in local)
        assert landed == 0, f"{landed} bytes of a cancelled push were written"
        assert until(lambda: not t.quarantined, 5)


def test_a_push_the_producer_cancelled_ends_at_once_not_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every producer rank confirmed a cancel the consumer never asked for (its deadline,
    on its own clock, passed first): nothing more is written, so the request fails now,
    saying so, instead of waiting for its own deadline (found by a review)."""
    from kvxfer.wire import Cancelled

    with local_pair() as (_, _, prod, cons):
        t = cons.push("warm", prod.address, local_block_ids=[0], remote_block_ids=[0])
        assert t.wait(10) is RequestState.DONE, t.error
        gate = _gate_writes(monkeypatch)
        t = cons.push("slow", prod.address, local_block_ids=[1, 2], remote_block_ids=[3, 4],
                      deadline_s=20.0)  # fmt: skip
        assert until(lambda: (t.poll(), gate)[1], 5), "no WRITE was posted"
        for k in gate:
            gate[k] = True
        peer = cons._peers[prod.address]
        backend, agent = prod.ranks[0].backend, cons.ranks[0].backend.name
        t0 = time.monotonic()
        backend.send_notif(agent, encode_msg(Cancelled("slow", peer.generations[0], t.attempt, 0)))
        assert t.wait(5) is RequestState.FAILED, (t.state, t.error)
        assert "cancelled the push" in str(t.error)
        assert time.monotonic() - t0 < 2.0
        assert not t.quarantined


def _stuck_reads(monkeypatch: pytest.MonkeyPatch) -> dict[int, bool]:
    """The next data READ posted reports IN_PROGRESS for good (NIXL still runs it)."""
    return _hold_in_progress(monkeypatch, XferOp.READ, first_only=True)


@pytest.mark.parametrize("where", ["caller", "end callback"])
def test_close_with_a_read_still_running_is_prompt(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The inbox thread polls READs left running under the engine lock, and close() joins
    the inbox thread under that lock: close() took 5 s (from an end callback, every time;
    from a caller, 3 runs in 26), found by a review of this change."""
    with local_pair() as (_, _, prod, cons):
        prod.hold("a", 2)
        prod.hold("b", 2)
        stuck = _stuck_reads(monkeypatch)
        a = cons.read("a", prod.address, local_block_ids=ids(0, 1), remote_block_ids=ids(0, 1))
        assert until(lambda: (a.poll(), stuck)[1], 5)
        assert a.cancel() is RequestState.ABORTED and a.quarantined
        took: list[float] = []

        def close() -> None:
            time.sleep(0.05)  # the inbox thread comes to poll `a` (the engine lock is held)
            t0 = time.monotonic()
            cons.close()
            took.append(time.monotonic() - t0)

        if where == "caller":
            close()
        else:  # `a` stays running; `b` ends, and its end callback closes the consumer
            b = cons.read("b", prod.address, local_block_ids=ids(2, 3),
                          remote_block_ids=ids(2, 3))  # fmt: skip
            b.on_end(close)
            assert b.wait(20) is RequestState.DONE, b.error
            assert until(lambda: took, 10)
        assert took[0] < 1.0, f"close took {took[0]:.2f} s"
        assert not a.quarantined  # closed: its agent and worker are gone, nothing lands


def test_a_read_that_ended_before_its_sibling_failed_leaves_no_quarantine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TP 2 -> 2: rank 0's READ completed (and was released) and rank 1's failed in the
    same poll; the released handle was counted as one released with a dropped peer, so
    the request stayed quarantined until deadline + lease_s with nothing running (found
    by a review of this change)."""
    from kvxfer.engine import Consumer, EngineConfig, Producer, allocate_cache
    from kvxfer.layout.presets import spec_for
    from kvxfer.testing import fill

    specs = [spec_for("tiny-gqa", tp_rank=r, tp_size=2, num_blocks=16) for r in range(2)]
    pr = []
    for s in specs:
        b = allocate_cache(s)
        fill(s, b)
        pr.append((s, b))
    with (
        Producer(EngineConfig("p", model_name="tiny-gqa"), pr) as prod,
        Consumer(
            EngineConfig("d", model_name="tiny-gqa"), [(s, allocate_cache(s)) for s in specs]
        ) as cons,  # fmt: skip
    ):
        prod.hold("warm", 4)
        t = cons.read("warm", prod.address, local_block_ids=np.arange(4),
                      remote_block_ids=np.arange(4))  # fmt: skip
        assert t.wait(20) is RequestState.DONE, t.error
        prod.hold("r", 4)
        real_poll = NixlBackend.poll
        rank1 = cons.ranks[1].backend

        def poll(self: NixlBackend, x):  # type: ignore[no-untyped-def]
            state = real_poll(self, x)
            if x.op is not XferOp.READ or x.num_descriptors < 2:
                return state
            if self is rank1:
                raise TransferError("injected: the READ of rank 1 failed")
            end = time.monotonic() + 5  # rank 0's READ ends (and is released) first
            while state is XferState.IN_PROGRESS and time.monotonic() < end:
                state = real_poll(self, x)
            return state

        monkeypatch.setattr(NixlBackend, "poll", poll)
        t = cons.read("r", prod.address, local_block_ids=np.arange(4),
                      remote_block_ids=np.arange(4))  # fmt: skip
        assert t.wait(10) is RequestState.FAILED, (t.state, t.error)
        assert t.lingering == [] and not t.quarantined


def test_a_read_left_running_stays_quarantined_until_close_has_closed_the_agents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() marks the consumer closed first and closes its agents last (after joining
    its threads, up to seconds): a poll in between took "closed" for "the agents are
    gone" and freed blocks a running READ could still land in (found by a review)."""
    from kvxfer.engine import waiting

    with local_pair() as (_, _, prod, cons):
        prod.hold("a", 2)
        stuck = _stuck_reads(monkeypatch)
        a = cons.read("a", prod.address, local_block_ids=ids(0, 1), remote_block_ids=ids(0, 1))
        assert until(lambda: (a.poll(), stuck)[1], 5)
        assert a.cancel() is RequestState.ABORTED and a.quarantined
        real_close = waiting.Progress.close

        def slow_close(self: waiting.Progress) -> None:
            time.sleep(0.6)  # close() is between marking itself closed and closing agents
            real_close(self)

        monkeypatch.setattr(waiting.Progress, "close", slow_close)
        closer = threading.Thread(target=cons.close)
        closer.start()
        time.sleep(0.2)
        during = a.quarantined
        closer.join(10)
        assert during, "quarantine ended while the agent (and its READ) still ran"
        assert not a.quarantined  # closed now: the agent and its worker are gone
