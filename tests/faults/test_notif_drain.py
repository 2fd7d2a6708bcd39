"""A pull-only consumer drains unsolicited notifications in the background (issue 9,
item 13): they are counted and dropped, never piled up in NIXL's queue."""

from __future__ import annotations

import time

import pytest

from kvxfer.transport.nixl import NixlBackend

from .procs import make_consumer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NUM = 2000


def test_unsolicited_notifications_are_drained(closing) -> None:  # type: ignore[no-untyped-def]
    cons, _ = make_consumer("tiny-gqa", 16)
    closing(cons)
    spammer = closing(NixlBackend("spammer", progress_delay_us=100))
    target = spammer.add_remote(cons.ranks[0].backend.metadata())
    junk = b"\x00" * 60_000
    for _ in range(NUM):
        spammer.send_notif(target, junk)
    until = time.monotonic() + 10
    while cons.num_rejected < NUM and time.monotonic() < until:
        time.sleep(0.02)
    print(f"[measure] {cons.num_rejected} of {NUM} unsolicited 60 KB notices drained")
    assert cons.num_rejected == NUM  # no request ever polled: the inbox thread drained them
