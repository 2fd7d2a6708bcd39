"""``close()`` leaves no kvxfer thread behind: a side-channel fetch in flight (a first
contact, a recheck, a push's consumer fetch, a heartbeat probe) to a peer that does not
answer is cut short by close, and close waits for the thread that made it. Before, each
such thread outlived close by up to its timeout (``handshake_timeout_s``). Real NIXL
engines in this process, real ZMQ sockets that accept and never answer."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvxfer.engine import Consumer, EngineConfig, RequestState, allocate_cache
from kvxfer.errors import ClosedError, KvxferError
from kvxfer.layout.presets import spec_for
from kvxfer.testing import MemoryBackend
from kvxfer.transport.side_client import fetch_records
from kvxfer.wire import PushRequest, encode_msg
from tests.engines import local_pair, silent_endpoints, until

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 8.0  # handshake_timeout_s: how long each fetch would wait without close


@pytest.fixture
def silent() -> Iterator[str]:
    """An endpoint that accepts TCP connections and never answers."""
    with silent_endpoints(1) as (address,):
        yield address


def _alive(name: str) -> int:
    return sum(t.name == name and t.is_alive() for t in threading.enumerate())


def _close_leaves_none(close: Callable[[], None], name: str, base: int = 0) -> None:
    """``close()`` returns within 3 s and no thread named ``name`` (past ``base`` of
    them) outlives it."""
    t0 = time.monotonic()
    close()
    took = time.monotonic() - t0
    left = _alive(name) - base
    assert left == 0, f"{left} {name} thread(s) outlived close ({took:.2f} s)"
    assert took < 3.0, f"close took {took:.2f} s"


def test_a_cancelled_fetch_ends_at_once_saying_so(silent: str) -> None:
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(ClosedError, match=r"side channel .*: cancelled"):
        fetch_records(silent, None, "h", TIMEOUT_S, cancel=cancel)
    assert time.monotonic() - t0 < 1.0


def test_close_ends_a_first_contact_in_flight(silent: str) -> None:
    with local_pair(handshake_timeout_s=TIMEOUT_S) as (_, _, _, cons):
        base = _alive("kvxfer-handshake")
        t = cons.read("r", silent, local_block_ids=[0], remote_block_ids=[0], deadline_s=30)
        assert until(lambda: _alive("kvxfer-handshake") > base, 2)
        _close_leaves_none(cons.close, "kvxfer-handshake", base)
        assert t.state is RequestState.ABORTED


def test_close_ends_a_recheck_in_flight() -> None:
    with local_pair(handshake_timeout_s=TIMEOUT_S) as (_, _, prod, cons):
        t = cons.read("warm", prod.address, local_block_ids=[0], remote_block_ids=[0])
        assert t.wait(10) is RequestState.DONE, t.error
        prod.server.stop()  # the producer's side channel no longer answers
        other = prod.generation ^ 1  # a request pinned elsewhere: the consumer rechecks
        t = cons.read("pinned", prod.address, local_block_ids=[1], remote_block_ids=[1],
                      generation=other, deadline_s=30)  # fmt: skip
        assert until(lambda: (t.poll(), _alive("kvxfer-recheck"))[1] > 0, 2)
        _close_leaves_none(cons.close, "kvxfer-recheck")


def test_close_ends_a_push_fetch_in_flight(silent: str) -> None:
    with local_pair(handshake_timeout_s=TIMEOUT_S) as (_, _, prod, cons):
        t = cons.read("warm", prod.address, local_block_ids=[0], remote_block_ids=[0])
        assert t.wait(10) is RequestState.DONE, t.error
        peer, backend = cons._peers[prod.address], cons.ranks[0].backend
        kw = {"attempt": 1, "budget_ms": 30000, "sent_at_ns": time.time_ns()}
        bad = PushRequest("f", peer.generations[0], silent, 0, 1, (2,), (3,), **kw)
        backend.send_notif(peer.agents[0], encode_msg(bad))  # the producer fetches `silent`
        assert until(lambda: _alive("kvxfer-push-fetch") > 0, 3)
        _close_leaves_none(prod.close, "kvxfer-push-fetch")


def test_close_ends_a_heartbeat_probe_in_flight() -> None:
    """A probe waits up to ``heartbeat_s`` for a silent producer; close cuts it short."""
    with local_pair(handshake_timeout_s=TIMEOUT_S, heartbeat_s=TIMEOUT_S / 2) as (
        _, _, prod, cons,
    ):  # fmt: skip
        t = cons.read("warm", prod.address, local_block_ids=[0], remote_block_ids=[0])
        assert t.wait(10) is RequestState.DONE, t.error
        prod.server.stop()
        time.sleep(TIMEOUT_S / 2 + 0.5)  # the first probe is now waiting for its reply
        t0 = time.monotonic()
        cons.close()
        took = time.monotonic() - t0
        assert _alive("kvxfer-heartbeat") == 0, f"the heartbeat outlived close ({took:.2f} s)"
        assert took < 3.0, f"close took {took:.2f} s"


def _memory_consumer(**config: object) -> Consumer:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    cfg = EngineConfig("md", model_name="tiny-gqa", **config)  # type: ignore[arg-type]
    return Consumer(cfg, [(spec, allocate_cache(spec))], backend_factory=MemoryBackend)


def test_close_while_another_thread_starts_contacts_closes_everything() -> None:
    """close() joined a helper thread registered but not started yet: RuntimeError,
    with the engine half closed (found by a review: 1 run in about 100)."""
    for _ in range(40):
        cons = _memory_consumer(heartbeat_s=0.05)
        stop = threading.Event()

        def spam(c: Consumer = cons, s: threading.Event = stop) -> None:
            while not s.is_set():
                with contextlib.suppress(KvxferError):
                    c.preconnect(["tcp://127.0.0.1:1"], retry_for_s=0.01, interval_s=0.01)

        spammers = [threading.Thread(target=spam) for _ in range(2)]
        for th in spammers:
            th.start()
        time.sleep(0.01)
        try:
            cons.close()
        finally:
            stop.set()
            for th in spammers:
                th.join()
        assert cons.ranks == {} and cons.server is None


def test_close_from_an_end_callback_does_not_wait_for_contacts(silent: str) -> None:
    """Callbacks run under the engine lock, which a cancelled contact needs to end: close()
    from one must not wait for it (it took 5 s, then logged the thread as stuck)."""
    with local_pair(handshake_timeout_s=TIMEOUT_S) as (_, _, prod, cons):
        cons.connect(prod.address)
        stuck = cons.read("s", silent, local_block_ids=[1], remote_block_ids=[2], deadline_s=20)
        time.sleep(0.2)
        took: list[float] = []

        def on_end() -> None:
            t0 = time.monotonic()
            cons.close()
            took.append(time.monotonic() - t0)

        t = cons.read("r", prod.address, local_block_ids=[1], remote_block_ids=[2], deadline_s=5)
        t.on_end(on_end)
        assert t.wait(10) is RequestState.DONE
        assert until(lambda: took, 7), "the end callback did not run"
        assert took[0] < 1.0, took
        assert stuck.state is RequestState.ABORTED
        assert until(lambda: _alive("kvxfer-handshake") == 0, 2)


def test_close_ends_contacts_queued_behind_max_contacts() -> None:
    """A producer queued behind ``max_contacts`` was never failed at close: a preconnect
    waiting on it kept close 5 s and outlived it by 2 x handshake_timeout_s."""
    with silent_endpoints(2) as addresses:
        before = set(threading.enumerate())  # other tests' engines may still be closing
        cons = _memory_consumer(handshake_timeout_s=TIMEOUT_S, max_contacts=1)
        for a in addresses:
            cons.preconnect([a])
            time.sleep(0.2)
        t0 = time.monotonic()
        cons.close()
        took = time.monotonic() - t0
        left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("kvxfer")]
        assert took < 2.0, f"close took {took:.2f} s"
        assert not left, f"threads outlived close: {left}"
