"""The kvxfer exception tree.

Every error kvxfer raises derives from :class:`KvxferError`. Bad caller input
(layouts, plans, ids, files) also derives from :class:`ValueError`, so code that
already catches ``ValueError`` keeps working.

::

    KvxferError
    +-- LayoutError(ValueError)       a layout or plan input is malformed
    |   +-- IncompatibleError         two sides cannot be paired (TP, heads, hash...)
    +-- ProtocolError(ValueError)     a message from a peer failed to decode/validate
    +-- TransferError                 NIXL reported a failure for a transfer
    |   +-- PeerLostError             the peer died or restarted (stale generation)
    |   +-- LeaseExpiredError         the producer's lease on the blocks ended before the read
    +-- DeadlineError(TimeoutError)   a request passed its deadline
    +-- WaitTimeout(TimeoutError)     the caller's own wait ran out; the request goes on
    +-- ClosedError(RuntimeError)     the engine was closed: a usage error, not a fault
    +-- CancelledError                the caller cancelled the request
"""

from __future__ import annotations

__all__ = [
    "CancelledError",
    "ClosedError",
    "DeadlineError",
    "IncompatibleError",
    "KvxferError",
    "LayoutError",
    "LeaseExpiredError",
    "PeerLostError",
    "ProtocolError",
    "TransferError",
    "WaitTimeout",
]


class KvxferError(Exception):
    """Root of every error raised by kvxfer."""


class LayoutError(KvxferError, ValueError):
    """A layout, plan, id list or input file is malformed; the message names the field."""


class IncompatibleError(LayoutError):
    """Two valid layouts cannot be paired (TP sizes, heads, block sizes, hash...)."""


class ProtocolError(KvxferError, ValueError):
    """A message from a peer is malformed, truncated, oversized or of another version."""


class TransferError(KvxferError):
    """NIXL reported a failure while preparing, posting or polling a transfer."""


class PeerLostError(TransferError):
    """The peer disconnected, died or restarted; its old handles are invalid."""


class LeaseExpiredError(TransferError):
    """The producer's lease on a request's blocks ended (or nearly): they may belong to
    another request now, so they are not read."""


class DeadlineError(KvxferError, TimeoutError):
    """A request did not complete before its deadline."""


class WaitTimeout(KvxferError, TimeoutError):
    """A caller's wait (``result(timeout_s)``) ran out; the request itself is still live."""


class CancelledError(KvxferError):
    """The caller cancelled the request (``Transfer.cancel``); it ended ABORTED."""


class ClosedError(KvxferError, RuntimeError):
    """The engine was closed: new requests are refused (a usage error, distinct from a
    transfer that broke)."""
