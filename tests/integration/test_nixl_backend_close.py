"""``NixlBackend.close`` stops the agent even while an error raised by one of its calls is
still kept (a first contact's ``peer.error``, a request's ``t.error``): the error's
traceback held the method's ``agent`` local, so the agent, its progress thread and its
UCX worker outlived close, while the consumer took the agents for gone and ended the
quarantine of READs still running on them (found by a review). Real NIXL."""

from __future__ import annotations

import gc
import os
import time

from kvxfer.errors import KvxferError
from kvxfer.transport.nixl import NixlBackend


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))  # native ones too (NIXL's progress thread)


def test_close_stops_the_agent_while_an_error_of_its_calls_is_kept() -> None:
    base = _threads()
    b = NixlBackend("close-probe", progress_delay_us=100)
    assert _threads() > base  # the agent runs threads of its own
    kept = None
    try:
        b.add_remote(b"\x00not-metadata" * 4)
    except KvxferError as e:
        kept = e  # as a failed first contact keeps it
    assert kept is not None
    b.close()
    end = time.monotonic() + 5
    while _threads() > base and time.monotonic() < end:
        gc.collect()
        time.sleep(0.05)
    assert _threads() <= base, f"{_threads() - base} agent thread(s) outlived close"
