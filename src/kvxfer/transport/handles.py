"""NixlBackend's handles: a prepared descriptor list and a transfer.

A handle belongs to the backend that made it and holds NIXL's integer id until it is
released (explicitly, by ``remove_remote`` for its peer, or by ``close``); using a
released handle raises ConfigError, one released because its peer went away raises
PeerLostError. No NIXL import here: the backend frees the ids.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from kvxfer.errors import ConfigError, KvxferError, PeerLostError
from kvxfer.transport.backend import XferOp

__all__ = ["PreparedList", "XferHandle", "release_each"]

log = logging.getLogger(__name__)


class _Releasable(Protocol):
    def release(self) -> None: ...


def release_each(handles: Iterable[_Releasable], what: str, level: int = logging.DEBUG) -> None:
    """Release every handle (lists or transfers, of either backend); one that fails is
    logged at ``level`` (``what`` names them) and the others are still released."""
    for h in handles:
        try:
            h.release()
        except KvxferError as e:
            log.log(level, "release of %s: %s", what, e)


class _Owner(Protocol):
    """What a handle needs from the backend that made it."""

    def _release_prepared(self, plist: PreparedList) -> None: ...

    def release(self, xfer: XferHandle) -> None: ...


class _Handle:
    """A NIXL handle owned by one backend; ``_handle`` becomes None once released."""

    __slots__ = ("_handle", "_lost", "_owner", "num_descriptors", "remote_agent")
    _what = "handle"

    def __init__(self, owner: _Owner, handle: int, num: int, remote: str | None) -> None:
        self._owner = owner
        self._handle: int | None = handle
        self._lost = False  # released because its peer was removed or replaced
        self.num_descriptors = num
        self.remote_agent = remote

    @property
    def is_released(self) -> bool:
        """True once released (explicitly, by ``remove_remote`` or by ``close``)."""
        return self._handle is None

    @property
    def is_lost(self) -> bool:
        """True once released by ``remove_remote`` (its peer was removed or replaced)."""
        return self._lost

    def _live(self) -> int:
        if self._handle is None:
            if self._lost:
                raise PeerLostError(
                    f"{self._what} for {self.remote_agent!r} is stale (peer removed)"
                )
            raise ConfigError(f"{self._what} was released")
        return self._handle

    def _take(self) -> int | None:
        handle, self._handle = self._handle, None  # never hand a freed id to NIXL again
        return handle


class PreparedList(_Handle):
    """A descriptor list prepared on one backend; indices into it are flat (view-major).

    Attributes:
        num_descriptors: descriptors in the list (sum of counts for strided rows).
        is_strided: True if NIXL ingested ``(N, 5)`` rows, False for dense rows.
        remote_agent: the agent whose memory it describes; None for local memory.
    """

    __slots__ = ("is_strided",)
    _what = "prepared list"

    def __init__(
        self, owner: _Owner, handle: int, num: int, strided: bool, remote: str | None
    ) -> None:
        super().__init__(owner, handle, num, remote)
        self.is_strided = strided

    def release(self) -> None:
        """Free NIXL's copy of the list. Idempotent; release transfers using it first."""
        self._owner._release_prepared(self)


class XferHandle(_Handle):
    """A transfer made by :meth:`~kvxfer.transport.nixl.NixlBackend.make_xfer`; post, poll, then release it.

    Attributes:
        op: READ or WRITE.
        remote_agent: the peer on the other side.
        num_descriptors: descriptors per side.
    """

    __slots__ = ("op",)
    _what = "transfer"
    remote_agent: str

    def __init__(self, owner: _Owner, handle: int, op: XferOp, remote: str, num: int) -> None:
        super().__init__(owner, handle, num, remote)
        self.op = op

    def release(self) -> None:
        """Free the request; NIXL cancels it if still in progress. Idempotent."""
        self._owner.release(self)
