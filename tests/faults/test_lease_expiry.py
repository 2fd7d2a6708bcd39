"""READ after the producer's lease ended (issue 9, item 3).

The consumer knows when the lease ends (``Producer.hold`` returns it; the caller passes
it to ``read``) and never posts a READ after it: the request fails with a typed error
instead of reading blocks the producer may have handed to its next owner.
"""

from __future__ import annotations

import time

import pytest

from kvxfer.engine.config import RequestState

from .procs import ids, make_consumer, verify

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_read_after_lease_expiry_is_refused(spawn, closing) -> None:  # type: ignore[no-untyped-def]
    from kvxfer.errors import LeaseExpiredError

    a = spawn(engine_id="pa").start()
    cons, ranks = make_consumer("tiny-gqa", 64, handshake_timeout_s=2.0)
    closing(cons)
    (warm,) = a.hold([("warm", 2)])
    t = cons.read("warm", a.address, local_block_ids=ids(0, 1), remote_block_ids=ids(5, 6),
                  lease_expires_at_ns=warm)  # fmt: skip
    assert t.wait(20) is RequestState.DONE, t.error  # a live lease reads as before
    assert verify(ranks, a.remote_spec(), ids(0, 1), ids(5, 6)) == 0

    (late,) = a.hold([("late", 2)], lease_s=0.3)
    time.sleep(0.5)  # the lease ended: the producer may reuse these blocks any moment
    t = cons.read("late", a.address, local_block_ids=ids(2, 3), remote_block_ids=ids(7, 8),
                  lease_expires_at_ns=late)  # fmt: skip
    assert t.wait(5) is RequestState.FAILED, (t.state, t.error)
    assert isinstance(t.error, LeaseExpiredError)
    assert not t.posted_at  # never posted
