"""A producer that stops answering for a while but lives (starved on a busy host, a GC
pause, a stopped container resumed): the heartbeat's silence verdict waits
``silence_s`` before it drops the producer, so a load that waits on it ends DONE and
byte-exact once the producer runs again; a producer silent for longer is still dropped
(PEER_LOST) well before the load's deadline.

Push mode makes the load depend on the producer running: its process does the WRITE, so
nothing lands while it is stopped (a pull READ may be served by CMA from a stopped
process, and would end DONE whatever the heartbeat said).
"""

from __future__ import annotations

import logging
import signal
import time

import numpy as np
import pytest

from kvxfer.engine.config import RequestState

from .procs import clear, ids, make_consumer, verify, wait_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

HEARTBEAT_S = 0.2  # three unanswered probes take about 1 s
STOPPED_S = 2.0  # longer than three probes, shorter than SILENCE_S
SILENCE_S = 4.0
DEADLINE_S = 20.0


def _push_while_stopped(spawn, closing, silence_s: float, stopped_s: float):  # type: ignore[no-untyped-def]
    """Push 128 blocks to a producer stopped for ``stopped_s``; the transfer, the ranks,
    the producer and the blocks used."""
    a = spawn(engine_id="pa", num_blocks=256).start()
    cons, ranks = make_consumer("tiny-gqa", 256, handshake_timeout_s=2.0,
                                heartbeat_s=HEARTBEAT_S, silence_s=silence_s)  # fmt: skip
    closing(cons)
    t = cons.push("warm", a.address, local_block_ids=ids(0, 1), remote_block_ids=ids(5, 6))
    assert t.wait(20) is RequestState.DONE, t.error  # connected, and watched by the heartbeat
    clear(ranks)
    lids, rids = np.arange(10, 138), np.arange(0, 128)
    a.stop_process()
    try:
        t = cons.push("r", a.address, local_block_ids=lids, remote_block_ids=rids,
                      deadline_s=DEADLINE_S)  # fmt: skip
        end = time.monotonic() + stopped_s
        while time.monotonic() < end and not t.poll().is_terminal:
            time.sleep(0.01)
    finally:
        a.signal(signal.SIGCONT)
    return t, ranks, a, lids, rids


def test_a_producer_silent_for_less_than_silence_s_is_kept(spawn, closing, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="kvxfer.engine.liveness")
    t0 = time.monotonic()
    t, ranks, a, lids, rids = _push_while_stopped(spawn, closing, SILENCE_S, STOPPED_S)
    wait_all([t], DEADLINE_S)
    print(f"[measure] push to a producer stopped {STOPPED_S} s (silence_s {SILENCE_S}): "
          f"{t.state.value} after {time.monotonic() - t0:.2f} s")  # fmt: skip
    assert t.state is RequestState.DONE, (t.state, t.error)
    assert verify(ranks, a.remote_spec(), lids, rids) == 0
    # the silence that silence_s forgave is in the log: what an operator tunes it by
    # (the heartbeat's next probe may answer after the push's completion)
    end = time.monotonic() + 5
    while not (
        lines := [r.getMessage() for r in caplog.records if "answered again" in r.getMessage()]
    ):
        assert time.monotonic() < end, "no 'answered again' line"
        time.sleep(0.05)
    (line,) = lines
    assert f"{a.address}" in line and "unanswered heartbeats" in line, line
    silent = float(line.rsplit("(", 1)[1].split(" s ")[0])
    assert 1.0 <= silent <= STOPPED_S + 1.0, line


def test_a_producer_silent_past_silence_s_is_dropped_before_the_deadline(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    """The same stop with the verdict at three unanswered probes (``silence_s`` 0: the
    behaviour before ``silence_s``, and the control that the stop above is long enough
    to draw a verdict), and a stop longer than ``silence_s``: PEER_LOST, by the verdict,
    long before the deadline."""
    for silence_s, stopped_s in ((0.0, STOPPED_S), (SILENCE_S, SILENCE_S + 2.0)):
        t0 = time.monotonic()
        t, ranks, a, _, _ = _push_while_stopped(spawn, closing, silence_s, stopped_s)
        took = time.monotonic() - t0
        print(f"[measure] push to a producer stopped {stopped_s} s (silence_s {silence_s}): "
              f"{t.state.value} after {took:.2f} s: {t.error}")  # fmt: skip
        assert t.state is RequestState.PEER_LOST, (silence_s, t.state, t.error)
        assert "no heartbeat reply" in str(t.error), t.error
        assert took < DEADLINE_S / 2, took
        # the producer runs again and may still write the blocks reported lost: they stay
        # quarantined until it confirms, and nothing lands once the quarantine has ended
        until = time.monotonic() + 10
        while t.quarantined and time.monotonic() < until:
            time.sleep(0.01)
        assert not t.quarantined
        snap = [b.copy() for _, bufs in ranks for b in bufs]
        time.sleep(0.5)
        assert all(np.array_equal(s, b) for s, b in zip(snap, [b for _, bs in ranks for b in bs],
                                                         strict=True))  # fmt: skip
        a.close()
