"""The kvxfer exception tree.

Every error kvxfer raises derives from :class:`KvxferError`. Bad caller input
(layouts, plans, ids, files) also derives from :class:`ValueError`, so code that
already catches ``ValueError`` keeps working.

::

    KvxferError
    +-- LayoutError(ValueError)       a layout or plan input is malformed
    |   +-- IncompatibleError         two sides cannot be paired (TP, heads, hash...)
    +-- ProtocolError(ValueError)     a message from a peer failed to decode/validate
    |   +-- AuthError                 a frame failed authentication (key, MAC, replay)
    +-- TransferError                 NIXL reported a failure for a transfer
    |   +-- PeerLostError             the peer died or restarted (stale generation)
    +-- DeadlineError(TimeoutError)   a request passed its deadline
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "DeadlineError",
    "IncompatibleError",
    "KvxferError",
    "LayoutError",
    "PeerLostError",
    "ProtocolError",
    "TransferError",
]


class KvxferError(Exception):
    """Root of every error raised by kvxfer."""


class LayoutError(KvxferError, ValueError):
    """A layout, plan, id list or input file is malformed; the message names the field."""


class IncompatibleError(LayoutError):
    """Two valid layouts cannot be paired (TP sizes, heads, block sizes, hash...)."""


class ProtocolError(KvxferError, ValueError):
    """A message from a peer is malformed, truncated, oversized or of another version."""


class AuthError(ProtocolError):
    """A frame was not authenticated: no or wrong deployment key, a forged or replayed frame."""


class TransferError(KvxferError):
    """NIXL reported a failure while preparing, posting or polling a transfer."""


class PeerLostError(TransferError):
    """The peer disconnected, died or restarted; its old handles are invalid."""


class DeadlineError(KvxferError, TimeoutError):
    """A request did not complete before its deadline."""
