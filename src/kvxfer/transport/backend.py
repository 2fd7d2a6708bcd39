"""The transfer interface engines use: a :class:`TransferBackend` Protocol.

Two implementations: :class:`kvxfer.transport.nixl.NixlBackend` (real NIXL, between
processes and hosts) and :class:`kvxfer.transport.memory.MemoryBackend` (memmove in
one process, for tests). Both follow one contract:

- ``register`` regions, then ``metadata`` gives the blob a peer passes to ``add_remote``.
- ``prepare`` turns ``(N, 5)`` strided or ``(N, 3)`` dense rows into a list handle whose
  flat indices are view-major, block-minor; descriptors outside registered memory raise
  TransferError; malformed rows or ids raise LayoutError.
- ``make_xfer`` pairs indices of a local and a remote list; ``post`` / ``poll`` return
  :class:`XferState` (failures raise, never a state); ``release`` is idempotent and using
  a released handle raises ConfigError; handles of a removed peer raise PeerLostError.
- ``send_notif`` / ``get_notifs`` carry small messages, in order per peer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from kvxfer.errors import ConfigError, LayoutError
from kvxfer.layout.model import MemKind
from kvxfer.planning.descriptors import COUNT, U64, validate_rows

__all__ = [
    "BackendFactory",
    "MemKind",
    "TransferBackend",
    "XferHandleLike",
    "XferOp",
    "XferState",
    "check_ids",
    "check_mem_kind",
    "check_rows",
]

INT32_MAX = (1 << 31) - 1  # NIXL takes descriptor indices as int


class XferOp(str, Enum):
    """Direction of a transfer, seen from the initiator."""

    READ = "READ"
    WRITE = "WRITE"


class XferState(str, Enum):
    """State of a posted transfer. Failures are exceptions, never a state."""

    DONE = "DONE"
    IN_PROGRESS = "IN_PROGRESS"


class XferHandleLike(Protocol):
    """What the engines use of a backend's transfer handle (checked by mypy against both
    backends through their ``_conforms``)."""

    @property
    def is_released(self) -> bool: ...

    @property
    def is_lost(self) -> bool:
        """Released by ``remove_remote`` (its peer was removed): cannot be polled."""
        ...

    def release(self) -> None: ...


P = TypeVar("P")  # the backend's prepared-list handle
X = TypeVar("X", bound=XferHandleLike)  # the backend's transfer handle


def check_rows(rows: Any) -> tuple[U64, int]:
    """Validate ``(N, 5)`` strided or ``(N, 3)`` dense uint64 rows for ``prepare``.

    Returns:
        The rows and the number of descriptors they describe (sum of counts for strided).

    Raises:
        LayoutError: wrong shape, dtype or layout, a zero length / count, or more
            descriptors than int32 indices reach.
    """
    if not isinstance(rows, np.ndarray) or rows.ndim != 2 or rows.shape[1] not in (3, 5):
        shape = getattr(rows, "shape", type(rows).__name__)
        raise LayoutError(f"descriptor rows must have shape (N, 5) or (N, 3), got {shape}")
    width = rows.shape[1]
    rows = validate_rows(rows, width)  # dtype, contiguity, no zero len / count
    num = int(rows[:, COUNT].sum()) if width == 5 else rows.shape[0]
    if num > INT32_MAX:
        raise LayoutError(f"{num} descriptors exceed NIXL's int32 indices")
    return rows, num


def check_mem_kind(mem_kind: Any, supported: frozenset[MemKind], who: str) -> MemKind:
    """Return ``mem_kind`` as a MemKind if ``who`` can move it; ConfigError otherwise."""
    try:
        kind = MemKind(mem_kind)
    except ValueError:
        raise ConfigError(f"mem_kind must be one of DRAM, VRAM, got {mem_kind!r}") from None
    if kind not in supported:
        have = ", ".join(sorted(k.value for k in supported)) or "nothing"
        raise ConfigError(f"{who} cannot move {kind.value} memory (it moves {have})")
    return kind


def check_ids(ids: Any, size: int, what: str) -> np.ndarray:
    """Validate descriptor indices into a list of ``size``; return contiguous ``(N,) int32``."""
    if not isinstance(ids, np.ndarray) or ids.ndim != 1:
        shape = getattr(ids, "shape", type(ids).__name__)
        raise LayoutError(f"{what} must be a 1-D integer ndarray, got {shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise LayoutError(f"{what} must have an integer dtype, got {ids.dtype}")
    if ids.size == 0:
        raise LayoutError(f"{what} is empty")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= size:
        raise LayoutError(f"{what} spans [{lo}, {hi}], outside the prepared list [0, {size})")
    return np.ascontiguousarray(ids, dtype=np.int32)


@runtime_checkable
class TransferBackend(Protocol[P, X]):
    """One agent: registered memory, known peers, prepared lists and transfers.

    ``P`` is the prepared-list handle type (has ``release()``, ``num_descriptors``,
    ``remote_agent``), ``X`` the transfer handle type (an :class:`XferHandleLike`, and
    ``op``).
    """

    @property
    def name(self) -> str:
        """The agent name peers see (unique among agents that talk to each other)."""
        ...

    def register(
        self, regions: Sequence[tuple[int, int, int]], mem_kind: MemKind = MemKind.DRAM
    ) -> None:
        """Register ``(addr, nbytes, device)`` regions of one memory kind (device = GPU
        index for VRAM); the caller keeps them alive. A kind the backend cannot move
        raises ConfigError."""
        ...

    def metadata(self) -> bytes:
        """This agent's blob for a peer's :meth:`add_remote`."""
        ...

    def add_remote(self, blob: bytes) -> str:
        """Load a peer's blob (replacing a known name); returns the peer's name."""
        ...

    def remove_remote(self, name: str) -> None:
        """Forget a peer and release what was made for it. Idempotent."""
        ...

    def prepare(
        self,
        rows: np.ndarray,
        remote_agent: str | None = None,
        *,
        strided: bool = True,
        mem_kind: MemKind = MemKind.DRAM,
    ) -> P:
        """Prepare ``(N, 5)`` or ``(N, 3)`` uint64 rows over memory of ``mem_kind`` (local
        if ``remote_agent`` is None)."""
        ...

    def make_xfer(
        self,
        op: XferOp,
        local: P,
        local_ids: np.ndarray,
        remote: P,
        remote_ids: np.ndarray,
        notif: bytes = b"",
    ) -> X:
        """Pair ``(N,)`` indices of a local and a remote list; ``notif`` goes to the peer."""
        ...

    def post(self, xfer: X) -> XferState:
        """Start a transfer; DONE or IN_PROGRESS."""
        ...

    def poll(self, xfer: X) -> XferState:
        """Check a posted transfer; DONE or IN_PROGRESS."""
        ...

    def release(self, xfer: X) -> None:
        """Free a transfer (cancelling it if in progress). Idempotent."""
        ...

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        """Send a message not tied to a transfer."""
        ...

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Take the messages that arrived since the last call, by sender."""
        ...

    def close(self) -> None:
        """Release everything and deregister memory. Idempotent."""
        ...


BackendFactory = Callable[[str], TransferBackend[Any, Any]]
"""Builds a backend for one TP rank from its agent name (e.g. ``MemoryBackend``)."""
