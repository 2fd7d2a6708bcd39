"""A flood of requests naming addresses nobody answers (what any client of vLLM's API
can send in ``kv_transfer_params``): first contacts run ``max_contacts`` at a time, at
most ``MAX_QUEUED_CONTACTS`` wait, every request still ends by its deadline, and a real
producer is served afterwards. Real NIXL engines and ZMQ sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvxfer.engine import Consumer, EngineConfig, RequestState, allocate_cache
from kvxfer.engine import contact as contact_mod
from kvxfer.errors import ConfigError
from kvxfer.layout.presets import spec_for
from kvxfer.testing import mismatches
from tests.engines import local_pair, silent_endpoints

pytestmark = pytest.mark.timeout(60)

SPEC = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)


@pytest.fixture
def silent() -> Iterator[list[str]]:
    """40 endpoints that accept TCP connections and never answer (wedged side channels)."""
    with silent_endpoints(40) as addresses:
        yield addresses


def _contact_threads() -> int:
    return sum(t.name == "kvxfer-handshake" and t.is_alive() for t in threading.enumerate())


def test_max_contacts_must_be_positive() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="max_contacts"):
            EngineConfig("c", max_contacts=bad).check()  # type: ignore[arg-type]


def test_a_flood_of_silent_addresses_runs_a_few_contacts_and_ends_every_request(
    silent: list[str],
) -> None:
    cfg = EngineConfig("flood", model_name="tiny-gqa", max_contacts=3, handshake_timeout_s=0.5)
    with Consumer(cfg, [(SPEC, allocate_cache(SPEC))]) as cons:
        base = _contact_threads()
        t0 = time.monotonic()
        reads = [cons.read(f"r{i}", a, local_block_ids=[0], remote_block_ids=[0], deadline_s=2.0)
                 for i, a in enumerate(silent)]  # fmt: skip
        most = 0
        while not all(t.state.is_terminal for t in reads) and time.monotonic() - t0 < 10:
            most = max(most, _contact_threads() - base)
            for t in reads:
                t.poll()
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        assert most <= 3, f"{most} first contacts at once (max_contacts 3)"
        assert all(t.state in (RequestState.TIMEOUT, RequestState.PEER_LOST) for t in reads)
        assert elapsed < 2.0 + 1.0, f"the requests ended {elapsed:.2f} s after they started"
        # queued contacts whose requests all ended are dropped, not run: the contact
        # threads are gone soon after the last request ended
        end = time.monotonic() + 2
        while _contact_threads() > base and time.monotonic() < end:
            time.sleep(0.02)
        assert _contact_threads() == base


def test_past_the_queue_a_new_address_fails_at_once_with_the_reason(
    silent: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(contact_mod, "MAX_QUEUED_CONTACTS", 5)
    cfg = EngineConfig("q", model_name="tiny-gqa", max_contacts=1, handshake_timeout_s=1.0)
    with Consumer(cfg, [(SPEC, allocate_cache(SPEC))]) as cons:
        reads = [cons.read(f"r{i}", a, local_block_ids=[0], remote_block_ids=[0], deadline_s=3.0)
                 for i, a in enumerate(silent[:10])]  # fmt: skip
        # 1 contacting, 5 queued; the other 4 fail without waiting for their deadline
        time.sleep(0.2)
        failed = [t for t in reads if t.poll() is RequestState.PEER_LOST]
        assert len(failed) == 4
        assert all("first contacts are waiting" in str(t.error) for t in failed), failed[0].error
        assert all(not t.state.is_terminal for t in reads[:6])


def test_a_real_producer_is_served_after_a_flood(silent: list[str]) -> None:
    with local_pair(max_contacts=2, handshake_timeout_s=0.5) as (spec, local, prod, cons):
        flood = [cons.read(f"f{i}", a, local_block_ids=[0], remote_block_ids=[0], deadline_s=1.0)
                 for i, a in enumerate(silent)]  # fmt: skip
        for t in flood:
            t.wait(5)
        prod.hold("real", block_ids=[3, 4])
        t = cons.read("real", prod.address, local_block_ids=[1, 2], remote_block_ids=[3, 4])
        assert t.wait(10) is RequestState.DONE
        assert mismatches(spec, local, spec, [1, 2], [3, 4]) == 0
