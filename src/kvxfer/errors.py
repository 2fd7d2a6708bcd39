"""The kvxfer exception tree.

Every error kvxfer raises derives from :class:`KvxferError`. Bad caller input
(layouts, plans, ids, files, settings) derives from :class:`InputError`, itself a
:class:`ValueError`, so code that already catches ``ValueError`` keeps working.

::

    KvxferError
    +-- InputError(ValueError)             bad caller input (one root for all of it)
    |   +-- LayoutError                    a layout, plan, id list or input file is malformed
    |   |   +-- IncompatibleError          two sides cannot be paired (TP, heads, hash...)
    |   +-- ConfigError                    a setting, handle use or memory kind is invalid
    +-- ProtocolError(ValueError)          a message from a peer failed to decode/validate
    |   +-- AuthError                      a frame failed authentication (key, MAC, replay)
    +-- BackendUnavailableError(ImportError)  the transfer library (NIXL) is not installed
    +-- TransferError                      NIXL reported a failure for a transfer
    |   +-- PeerLostError                  the peer died or restarted (stale generation)
    |   +-- LeaseExpiredError              the producer's lease on the blocks ended before the read
    |   +-- HoldEndedError                 the hold ended before the read was checked: not DONE
    +-- DeadlineError(TimeoutError)        a request passed its deadline
    +-- WaitTimeout(TimeoutError)          the caller's own wait ran out; the request goes on
    +-- ClosedError(RuntimeError)          the engine was closed: a usage error, not a fault
    +-- CancelledError                     the caller cancelled the request
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "BackendUnavailableError",
    "CancelledError",
    "ClosedError",
    "ConfigError",
    "DeadlineError",
    "HoldEndedError",
    "HoldMismatchError",
    "IncompatibleError",
    "InputError",
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


class InputError(KvxferError, ValueError):
    """Bad caller input; the message names the argument or field and its value."""


class LayoutError(InputError):
    """A layout, plan, id list or input file is malformed; the message names the field."""


class IncompatibleError(LayoutError):
    """Two valid layouts cannot be paired (TP sizes, heads, block sizes, hash...)."""


class ConfigError(InputError):
    """A setting is out of range, a handle is used after release, or a memory kind
    combination cannot be moved."""


class ProtocolError(KvxferError, ValueError):
    """A message from a peer is malformed, truncated, oversized or of another version."""


class BackendUnavailableError(KvxferError, ImportError):
    """The transfer library is not importable; the message gives the install line."""


class AuthError(ProtocolError):
    """A frame was not authenticated: no or wrong deployment key, a forged or replayed frame."""


class TransferError(KvxferError):
    """NIXL reported a failure while preparing, posting or polling a transfer."""


class PeerLostError(TransferError):
    """The peer disconnected, died or restarted; its old handles are invalid."""


class LeaseExpiredError(TransferError):
    """The producer's lease on a request's blocks ended (or nearly): they may belong to
    another request now, so they are not read."""


class HoldEndedError(TransferError):
    """The producer's hold on a request's blocks ended before the READ of them was
    checked (another reader read them first, an abort, the lease): they may have been
    reused under the READ, so its bytes are not reported (:mod:`kvxfer.engine.holds`)."""


class HoldMismatchError(TransferError):
    """The hold a request's ticket names was made for other params (another request id,
    other block ids, another binding such as another prompt): forged or mixed-up
    params. Its bytes are not reported (:mod:`kvxfer.engine.holds`)."""


class DeadlineError(KvxferError, TimeoutError):
    """A request did not complete before its deadline."""


class WaitTimeout(KvxferError, TimeoutError):
    """A caller's wait (``result(timeout_s)``) ran out; the request itself is still live."""


class CancelledError(KvxferError):
    """The caller cancelled the request (``Transfer.cancel``); it ended ABORTED."""


class ClosedError(KvxferError, RuntimeError):
    """The engine was closed: new requests are refused (a usage error, distinct from a
    transfer that broke)."""
