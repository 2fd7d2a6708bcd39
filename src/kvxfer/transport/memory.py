"""An in-process :class:`~kvxfer.transport.backend.TransferBackend`: memmove between
registered buffers, notifications delivered to the peer's inbox. For tests (yours too):
no NIXL, no UCX, no second process.

Agents find each other by name in a process-wide registry, so a producer and a consumer
in one process can talk; across processes use :class:`~kvxfer.transport.nixl.NixlBackend`.
The error contract is NixlBackend's: malformed rows or ids raise LayoutError, descriptors
outside registered memory or mismatched lengths raise TransferError, a released handle
raises ConfigError, a removed, closed or restarted peer raises PeerLostError.
Transfers complete inside :meth:`MemoryBackend.post` (always DONE). DRAM only by
default (VRAM raises ConfigError); ``mem_kinds={DRAM, VRAM}`` lets a test present host
memory as device memory, with every list checked against its registration's kind and
device. Thread-safe.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvxfer.errors import ConfigError, LayoutError, PeerLostError, ProtocolError, TransferError
from kvxfer.planning.descriptors import dense_rows
from kvxfer.transport.backend import (
    MemKind,
    TransferBackend,
    XferOp,
    XferState,
    check_ids,
    check_mem_kind,
    check_rows,
)

__all__ = ["MemoryBackend", "MemoryList", "MemoryXfer"]

_MAGIC = b"kvxfer-memory|"
_LOCK = threading.RLock()  # guards the registry, every agent's state and every copy
_AGENTS: dict[str, MemoryBackend] = {}
_incarnations = itertools.count(1)

Regions = list[tuple[int, int, int, str]]  # (addr, nbytes, device, mem kind value)


class _MemHandle:
    """A handle owned by one MemoryBackend; released handles raise on use."""

    _what = "handle"

    def __init__(self, remote_agent: str | None, num_descriptors: int) -> None:
        self.remote_agent = remote_agent
        self.num_descriptors = num_descriptors
        self._released = False
        self._lost = False  # released because its peer was removed

    @property
    def is_released(self) -> bool:
        return self._released

    @property
    def is_lost(self) -> bool:
        """True once released by ``remove_remote`` (its peer was removed or replaced)."""
        return self._lost

    def _check_live(self) -> None:
        if self._lost:
            raise PeerLostError(f"{self._what} for {self.remote_agent!r} is stale (peer removed)")
        if self._released:
            raise ConfigError(f"{self._what} was released")


class MemoryList(_MemHandle):
    """A prepared list: ``(num_descriptors, 3) uint64`` dense rows (addr, len, dev)."""

    _what = "prepared list"

    def __init__(self, rows: np.ndarray, remote_agent: str | None, strided: bool) -> None:
        super().__init__(remote_agent, int(rows.shape[0]))
        self.rows = rows
        self.is_strided = strided

    def release(self) -> None:
        """Idempotent."""
        self._released = True


class MemoryXfer(_MemHandle):
    """A transfer: pairs of local and remote descriptor indices."""

    _what = "transfer"
    remote_agent: str

    def __init__(
        self, op: XferOp, local: MemoryList, lids: np.ndarray, remote: MemoryList,
        rids: np.ndarray, notif: bytes, peer_incarnation: int,
    ) -> None:  # fmt: skip
        super().__init__(remote.remote_agent, int(lids.size))
        self.op = op
        self._pairs = (local, lids, remote, rids)
        self._notif = notif
        self._peer_incarnation = peer_incarnation
        self._posted = False

    def release(self) -> None:
        """Idempotent."""
        self._released = True


def _inside(rows: np.ndarray, regions: Regions, mem_kind: MemKind) -> np.ndarray:
    """``(N,) bool``: descriptor ``i`` lies wholly inside one region registered as
    ``mem_kind`` on the descriptor's device."""
    ok = np.zeros(rows.shape[0], dtype=bool)
    start, end, dev = rows[:, 0], rows[:, 0] + rows[:, 1], rows[:, 2]
    for addr, nbytes, device, kind in regions:
        if kind == mem_kind.value:
            ok |= (start >= addr) & (end <= addr + nbytes) & (dev == device)
    return ok


class MemoryBackend:
    """One in-process agent. Drop-in for :class:`~kvxfer.transport.nixl.NixlBackend`.

    Args:
        name: agent name, unique among the live agents of this process.
        mem_kinds: the memory kinds it accepts (default DRAM only, like a NIXL without
            CUDA). ``{DRAM, VRAM}`` lets tests present host memory as device memory: it
            keeps each registration's kind and device, and refuses rows prepared under
            another kind or device, so a caller's kinds are checked, not just its bytes.
    """

    def __init__(
        self,
        name: str,
        *,
        mem_kinds: frozenset[MemKind] = frozenset({MemKind.DRAM}),
        **_nixl_options: Any,
    ) -> None:
        kinds = frozenset(check_mem_kind(k, frozenset(MemKind), "MemoryBackend") for k in mem_kinds)
        if not kinds:
            raise ConfigError("MemoryBackend needs at least one memory kind")
        with _LOCK:
            if name in _AGENTS:
                raise ConfigError(f"agent name {name!r} is already in use in this process")
            _AGENTS[name] = self
        self.name = name
        self._incarnation = next(_incarnations)
        self._regions: Regions = []
        self._remotes: dict[str, tuple[int, Regions]] = {}  # name -> (incarnation, regions)
        self._inbox: dict[str, list[bytes]] = {}
        self._handles: weakref.WeakSet[_MemHandle] = weakref.WeakSet()  # live ones only
        self._closed = False
        self.mem_kinds = kinds

    def __enter__(self) -> MemoryBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _live(self) -> None:
        if self._closed:
            raise TransferError(f"backend {self.name!r} is closed")

    def register(
        self, regions: Sequence[tuple[int, int, int]], mem_kind: MemKind = MemKind.DRAM
    ) -> None:
        """Register ``(addr, nbytes, device)`` regions of ``mem_kind``; the caller keeps
        them alive."""
        self._live()
        kind = check_mem_kind(mem_kind, self.mem_kinds, "MemoryBackend")
        if not regions:
            raise LayoutError("no regions to register")
        for i, (addr, nbytes, dev) in enumerate(regions):
            if addr <= 0 or nbytes <= 0 or dev < 0:
                raise LayoutError(f"region {i}: addr {addr}, nbytes {nbytes}, device {dev}")
        with _LOCK:
            self._regions.extend((int(a), int(n), int(d), kind.value) for a, n, d in regions)

    def registered_kinds(self) -> set[MemKind]:
        """The memory kinds of this agent's registrations (what a test checks)."""
        with _LOCK:
            return {MemKind(r[3]) for r in self._regions}

    def metadata(self) -> bytes:
        """Name, incarnation and registered regions, for a peer's :meth:`add_remote`."""
        self._live()
        body = {"name": self.name, "incarnation": self._incarnation, "regions": self._regions}
        return _MAGIC + json.dumps(body).encode()

    def add_remote(self, blob: bytes) -> str:
        """Load a peer's blob (a known name is replaced); returns the peer's name."""
        self._live()
        if not isinstance(blob, bytes) or not blob.startswith(_MAGIC):
            raise ProtocolError("not a MemoryBackend metadata blob")
        try:
            body = json.loads(blob[len(_MAGIC) :])
            name, inc = str(body["name"]), int(body["incarnation"])
            regions = [(int(a), int(n), int(d), str(k)) for a, n, d, k in body["regions"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"bad MemoryBackend metadata: {exc}") from None
        if name in self._remotes:
            self.remove_remote(name)
        with _LOCK:
            self._remotes[name] = (inc, regions)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a peer; its lists and transfers become stale (PeerLostError). Idempotent."""
        self._live()
        with _LOCK:
            for h in list(self._handles):
                if h.remote_agent == name and not h._released:
                    h._released = h._lost = True
            self._remotes.pop(name, None)

    def _peer(self, name: str) -> tuple[int, Regions]:
        if name == self.name:
            return self._incarnation, self._regions
        if name not in self._remotes:
            raise TransferError(f"unknown remote agent {name!r}: add_remote it first")
        return self._remotes[name]

    def prepare(
        self,
        rows: np.ndarray,
        remote_agent: str | None = None,
        *,
        strided: bool = True,
        mem_kind: MemKind = MemKind.DRAM,
    ) -> MemoryList:
        """Check rows lie inside the target's registered memory; keep them dense."""
        self._live()
        kind = check_mem_kind(mem_kind, self.mem_kinds, "MemoryBackend")
        rows, _num = check_rows(rows)
        dense = dense_rows(rows) if rows.shape[1] == 5 else rows  # (num, 3) uint64
        with _LOCK:
            _inc, regions = self._peer(remote_agent or self.name)
            bad = np.flatnonzero(~_inside(dense, regions, kind))
            if bad.size:
                addr, length = int(dense[bad[0], 0]), int(dense[bad[0], 1])
                raise TransferError(
                    f"prepare (agent {remote_agent or self.name!r}) failed: descriptor "
                    f"{int(bad[0])} [{addr:#x}, +{length}) device {int(dense[bad[0], 2])} "
                    f"is outside registered memory of kind {kind.value}"
                )
            plist = MemoryList(dense, remote_agent, strided and rows.shape[1] == 5)
            self._handles.add(plist)
        return plist

    def make_xfer(
        self,
        op: XferOp,
        local: MemoryList,
        local_ids: np.ndarray,
        remote: MemoryList,
        remote_ids: np.ndarray,
        notif: bytes = b"",
    ) -> MemoryXfer:
        """Pair indices of a local and a remote list (READ: remote -> local)."""
        self._live()
        op = XferOp(op)
        if local.remote_agent is not None or remote.remote_agent is None:
            raise LayoutError("make_xfer needs a local list first, then a remote list")
        local._check_live()
        remote._check_live()
        lids = check_ids(local_ids, local.num_descriptors, "local_ids")
        rids = check_ids(remote_ids, remote.num_descriptors, "remote_ids")
        if lids.size != rids.size:
            raise LayoutError(f"local_ids has {lids.size} ids, remote_ids {rids.size}")
        llen, rlen = local.rows[lids, 1], remote.rows[rids, 1]
        bad = np.flatnonzero(llen != rlen)
        if bad.size:
            i = int(bad[0])
            raise TransferError(
                f"make {op.value}: pair {i} has lengths {int(llen[i])} (local) and "
                f"{int(rlen[i])} (remote)"
            )
        with _LOCK:
            inc, _regions = self._peer(remote.remote_agent)
            xfer = MemoryXfer(op, local, lids, remote, rids, bytes(notif), inc)
            self._handles.add(xfer)
        return xfer

    def post(self, xfer: MemoryXfer) -> XferState:
        """Copy every pair now and deliver the notification; always DONE."""
        self._live()
        with _LOCK:
            xfer._check_live()
            peer = _AGENTS.get(xfer.remote_agent)
            if peer is None or peer._incarnation != xfer._peer_incarnation:
                raise PeerLostError(f"post {xfer.op.value} (agent {xfer.remote_agent!r}): gone")
            local, lids, remote, rids = xfer._pairs
            src, dst = (remote, local) if xfer.op is XferOp.READ else (local, remote)
            sids, dids = (rids, lids) if xfer.op is XferOp.READ else (lids, rids)
            for s_addr, d_addr, n in zip(
                src.rows[sids, 0].tolist(), dst.rows[dids, 0].tolist(),
                src.rows[sids, 1].tolist(), strict=True,
            ):  # fmt: skip
                ctypes.memmove(d_addr, s_addr, n)
            if xfer._notif:
                peer._inbox.setdefault(self.name, []).append(xfer._notif)
            xfer._posted = True
        return XferState.DONE

    def poll(self, xfer: MemoryXfer) -> XferState:
        """DONE once posted."""
        self._live()
        xfer._check_live()
        if not xfer._posted:
            raise ConfigError(f"poll of a transfer to {xfer.remote_agent!r} never posted")
        return XferState.DONE

    def release(self, xfer: MemoryXfer) -> None:
        """Idempotent."""
        xfer.release()

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        """Append ``msg`` to the peer's inbox."""
        self._live()
        with _LOCK:
            inc, _regions = self._peer(remote_agent)
            peer = _AGENTS.get(remote_agent)
            if peer is None or peer._incarnation != inc:
                raise PeerLostError(f"send_notif (agent {remote_agent!r}): gone")
            peer._inbox.setdefault(self.name, []).append(bytes(msg))

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Take the messages that arrived since the last call, by sender."""
        self._live()
        with _LOCK:
            out, self._inbox = self._inbox, {}
        return out

    def close(self) -> None:
        """Release everything and leave the registry. Idempotent."""
        with _LOCK:
            if self._closed:
                return
            for h in list(self._handles):
                h._released = True
            self._handles.clear()
            self._remotes.clear()
            self._closed = True
            if _AGENTS.get(self.name) is self:
                del _AGENTS[self.name]


def _conforms(backend: MemoryBackend) -> TransferBackend[MemoryList, MemoryXfer]:
    return backend  # mypy checks that MemoryBackend satisfies the TransferBackend Protocol
