"""NIXL behind one small interface.

:class:`NixlBackend` owns one NIXL agent (UCX backend, DRAM and VRAM where NIXL's UCX
plugin was built with CUDA): register memory, exchange
metadata, prepare descriptor lists, make / post / poll transfers, notify. Every NIXL
exception and error status becomes a kvxfer error
(:mod:`kvxfer.transport.nixl_binding`, the only module that imports ``nixl_cu12``).

Ownership: prepared lists and transfer handles belong to the backend that made them;
``release()`` is idempotent; ``remove_remote`` releases everything made for that peer
(later use raises PeerLostError); ``close`` releases everything. The agent is built on
the bindings, not ``nixl_agent``: that wrapper hard-codes a progress-thread delay of 0,
which spins a full core per agent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvxfer.errors import (
    ConfigError,
    KvxferError,
    LayoutError,
    ProtocolError,
    TransferError,
)
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
from kvxfer.transport.handles import PreparedList, XferHandle
from kvxfer.transport.nixl_binding import (
    NIXL_ERRORS,
    NIXL_INSTALL_LINE,
    is_available,
    new_agent,
    peek_agent_name,
    require,
    segment,
    translate,
    xfer_state,
)
from kvxfer.transport.nixl_binding import bindings as _nixl
from kvxfer.wire.auth import ReplayGuard, open_notification, seal_notification

__all__ = [
    "NIXL_INSTALL_LINE",
    "NixlBackend",
    "PreparedList",
    "XferHandle",
    "XferOp",
    "XferState",
    "is_available",
]


class NixlBackend:
    """One NIXL agent (UCX backend) behind kvxfer's small transfer interface.

    ``mem_kinds`` holds the memory kinds its UCX backend moves (DRAM, and VRAM when the
    plugin has CUDA support); any pair of them can be moved (DRAM<->VRAM included).

    Not thread-safe unless built with ``thread_safe=True``: like NIXL's wrapper it uses
    ``NIXL_THREAD_SYNC_NONE`` by default, and posting releases the GIL.

    Args:
        name: agent name, unique among the agents that talk to each other.
        progress_thread: run NIXL's progress thread. The target of a READ (or WRITE)
            must make progress; an initiator that polls may turn it off.
        progress_delay_us: sleep between progress-thread passes; 0 spins a full core.
        num_threads: UCX worker threads (0: UCX default).
        backend_params: extra UCX backend init parameters (NIXL's, e.g. device lists);
            UCX itself also reads ``UCX_*`` environment variables (``UCX_TLS``,
            ``UCX_NET_DEVICES``) when the agent is created.
        thread_safe: lock the agent for calls from several threads (NIXL_THREAD_SYNC_STRICT).
    """

    def __init__(
        self,
        name: str,
        *,
        progress_thread: bool = True,
        progress_delay_us: int = 1000,
        num_threads: int = 0,
        backend_params: Mapping[str, str] | None = None,
        thread_safe: bool = False,
        auth_key: bytes | None = None,
    ) -> None:
        require()
        self._auth_key = auth_key
        # this agent's own: a sender's counter runs across its receivers, so one guard
        # shared by a process's agents took a notice drained late as "too old"
        self._guard = ReplayGuard()
        self.num_unauthenticated = 0  # notifications dropped: not sealed with our key
        if progress_delay_us < 0 or num_threads < 0:
            raise ConfigError(
                f"progress_delay_us and num_threads must be >= 0, got {progress_delay_us}, "
                f"{num_threads}"
            )
        agent, self.mem_kinds = new_agent(
            name, progress_thread, progress_delay_us, num_threads, backend_params, thread_safe
        )
        self.name = name
        self._agent: Any = agent
        self._registered: list[Any] = []  # nixlRegDList per register() call
        self._remotes: set[str] = set()
        self._prepared: dict[int, PreparedList] = {}
        self._xfers: dict[int, XferHandle] = {}
        self._strided_ok = True  # cleared if this NIXL rejects (N, 5) rows

    def __enter__(self) -> NixlBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release transfers and lists, drop peers, deregister memory, stop the agent.

        Idempotent. Cleanup errors from NIXL are ignored: the agent goes away anyway.
        """
        if self._agent is None:
            return
        for xfer in list(self._xfers.values()):
            with contextlib.suppress(KvxferError):
                self.release(xfer)
        for plist in list(self._prepared.values()):
            with contextlib.suppress(KvxferError):
                plist.release()
        for name in list(self._remotes):
            with contextlib.suppress(KvxferError):
                self.remove_remote(name)
        for dlist in self._registered:
            with contextlib.suppress(*NIXL_ERRORS):
                self._agent.deregisterMem(dlist, [])
        self._registered.clear()
        self._agent = None  # the binding's destructor joins the progress thread

    def _live(self) -> Any:
        if self._agent is None:
            raise TransferError(f"backend {self.name!r} is closed")
        return self._agent

    def register(
        self, regions: Sequence[tuple[int, int, int]], mem_kind: MemKind = MemKind.DRAM
    ) -> None:
        """Register regions of one memory kind with UCX; call before :meth:`metadata`.

        Args:
            regions: ``(addr, nbytes, device)`` per contiguous buffer (device: the GPU
                index for VRAM). The caller keeps the memory alive until :meth:`close`,
                which deregisters it.
            mem_kind: DRAM (host) or VRAM (device pointers); ConfigError if this NIXL's
                UCX backend cannot move that kind.
        """
        self._live()  # TransferError once closed
        seg = segment(check_mem_kind(mem_kind, self.mem_kinds, f"NIXL UCX ({self.name!r})"))
        if not regions:
            raise LayoutError("no regions to register")
        for i, (addr, nbytes, dev) in enumerate(regions):
            if addr <= 0 or nbytes <= 0 or dev < 0:
                raise LayoutError(f"region {i}: addr {addr}, nbytes {nbytes}, device {dev}")
        dlist = _nixl.nixlRegDList(seg, [(a, n, d, "") for a, n, d in regions])
        with translate("register_memory"):
            self._live().registerMem(dlist, [])
        self._registered.append(dlist)

    def metadata(self) -> bytes:
        """This agent's metadata blob (connection info and registered memory).

        Returns:
            Opaque bytes for the peer's :meth:`add_remote`.
        """
        with translate("get_local_metadata"):
            return bytes(self._live().getLocalMD())

    @property
    def auth_key(self) -> bytes | None:
        """The key notifications are sealed and opened with (None: unkeyed)."""
        return self._auth_key

    def add_remote(self, blob: bytes) -> str:
        """Load a peer's metadata blob; a known name is removed first (restarted peer).

        Args:
            blob: the peer's :meth:`metadata` bytes, from the side channel.

        Returns:
            The remote agent's name.
        """
        self._live()  # TransferError once closed
        if not isinstance(blob, bytes) or not blob:
            raise ProtocolError("agent metadata must be non-empty bytes")
        known = peek_agent_name(blob)
        if known is not None and known in self._remotes:
            self.remove_remote(known)
        with translate("add_remote_agent", known, nixlMismatchError=ProtocolError):
            raw = self._live().loadRemoteMD(blob)
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a peer: cancel its transfers, release its lists, disconnect. Idempotent.

        Args:
            name: remote agent name returned by :meth:`add_remote`.
        """
        self._live()  # TransferError once closed
        for xfer in [x for x in self._xfers.values() if x.remote_agent == name]:
            with contextlib.suppress(KvxferError):
                self.release(xfer)
            xfer._lost = True
        for plist in [p for p in self._prepared.values() if p.remote_agent == name]:
            with contextlib.suppress(KvxferError):
                plist.release()
            plist._lost = True
        if name in self._remotes:
            self._remotes.discard(name)
            with translate("remove_remote_agent", name):
                self._live().invalidateRemoteMD(name)

    def prepare(
        self,
        rows: np.ndarray,
        remote_agent: str | None = None,
        *,
        strided: bool = True,
        mem_kind: MemKind = MemKind.DRAM,
    ) -> PreparedList:
        """Prepare a descriptor list for :meth:`make_xfer`.

        Args:
            rows: ``(N, 5) uint64`` ``addr, len, dev, stride, count`` strided rows, or
                ``(N, 3) uint64`` ``addr, len, dev`` dense rows; C-contiguous, N > 0.
            remote_agent: peer whose memory the rows describe; None for local memory;
                this agent's own name for a loopback target.
            strided: hand ``(N, 5)`` rows to NIXL as they are; False expands them to dense
                rows first (done anyway if this NIXL does not accept strided rows).
            mem_kind: the kind of memory the rows describe (as registered there).

        Returns:
            The prepared list; indices into it are flat, view-major and block-minor.
        """
        self._live()  # TransferError once closed
        seg = segment(check_mem_kind(mem_kind, self.mem_kinds, f"NIXL UCX ({self.name!r})"))
        rows, num = check_rows(rows)
        width = rows.shape[1]
        if remote_agent is not None and remote_agent not in self._remotes | {self.name}:
            raise TransferError(f"unknown remote agent {remote_agent!r}: add_remote it first")
        target = _nixl.NIXL_INIT_AGENT if remote_agent is None else remote_agent
        action, peer = "prepare (descriptors inside registered memory?)", remote_agent or self.name
        handle: int | None = None
        if width == 5 and strided and self._strided_ok:
            try:
                with translate(action, peer):
                    handle = self._live().prepXferDlist(target, seg, rows, [])
            except TypeError:  # this NIXL has no (N, 5) overload: expand below
                self._strided_ok = False
        is_strided = handle is not None
        if handle is None:
            dense = dense_rows(rows) if width == 5 else rows  # (num, 3) uint64
            dlist = _nixl.nixlXferDList(seg, dense)
            with translate(action, peer):
                handle = self._live().prepXferDlist(target, dlist, [])
        plist = PreparedList(self, int(handle), num, is_strided, remote_agent)
        self._prepared[int(handle)] = plist
        return plist

    def _release_prepared(self, plist: PreparedList) -> None:
        handle = plist._take()
        if handle is None:
            return
        self._prepared.pop(handle, None)
        with translate("release_dlist_handle", plist.remote_agent):
            self._live().releasedDlistH(handle)

    def make_xfer(
        self,
        op: XferOp,
        local: PreparedList,
        local_ids: np.ndarray,
        remote: PreparedList,
        remote_ids: np.ndarray,
        notif: bytes = b"",
    ) -> XferHandle:
        """Build a transfer between descriptors of two prepared lists.

        Args:
            op: READ copies remote -> local, WRITE local -> remote.
            local: list prepared with ``remote_agent=None``.
            local_ids: ``(N,)`` integer indices into ``local``.
            remote: list prepared for the peer (or this agent, for loopback).
            remote_ids: ``(N,)`` integer indices into ``remote``, paired with ``local_ids``.
            notif: message delivered to the peer once the transfer completes; b"" for none.

        Returns:
            A handle to :meth:`post`, :meth:`poll` and :meth:`release`.
        """
        self._live()  # TransferError once closed
        op = XferOp(op)
        if local.remote_agent is not None or remote.remote_agent is None:
            raise LayoutError("make_xfer needs a local list first, then a remote list")
        lhandle, rhandle = local._live(), remote._live()
        lids = check_ids(local_ids, local.num_descriptors, "local_ids")
        rids = check_ids(remote_ids, remote.num_descriptors, "remote_ids")
        if lids.size != rids.size:
            raise LayoutError(f"local_ids has {lids.size} ids, remote_ids {rids.size}")
        code = _nixl.NIXL_READ if op is XferOp.READ else _nixl.NIXL_WRITE
        with translate(f"make {op.value}", remote.remote_agent):
            if notif and self._auth_key is not None:
                notif = seal_notification(self._auth_key, self.name, notif,
                                          receiver_agent=remote.remote_agent)  # fmt: skip
            raw = self._live().makeXferReq(code, lhandle, lids, rhandle, rids, notif, [], False)
        xfer = XferHandle(self, int(raw), op, remote.remote_agent, int(lids.size))
        self._xfers[xfer._live()] = xfer
        return xfer

    def post(self, xfer: XferHandle) -> XferState:
        """Start a transfer (small ones may finish inside the call).

        Args:
            xfer: a handle from :meth:`make_xfer`, not in progress.

        Returns:
            DONE or IN_PROGRESS; a failure raises TransferError / PeerLostError.
        """
        with translate(f"post {xfer.op.value}", xfer.remote_agent):
            status = self._live().postXferReq(xfer._live(), "")
        return xfer_state(status, f"post {xfer.op.value}", xfer.remote_agent)

    def poll(self, xfer: XferHandle) -> XferState:
        """Check a posted transfer. NIXL has no deadline: the caller keeps one.

        Args:
            xfer: a posted handle.

        Returns:
            DONE or IN_PROGRESS; a failure raises TransferError / PeerLostError.
        """
        with translate(f"poll {xfer.op.value}", xfer.remote_agent):
            status = self._live().getXferStatus(xfer._live())
        return xfer_state(status, f"poll {xfer.op.value}", xfer.remote_agent)

    def release(self, xfer: XferHandle) -> None:
        """Free a transfer request; NIXL cancels one still in progress. Idempotent.

        A transfer NIXL cannot cancel raises (a TransferError) and stays usable: poll it
        and release it again once it ended. Even a successful release does not always
        stop a READ in flight (UCX over TCP serves it when the peer runs again), so the
        engine releases a transfer only once it has ended, not to stop it.

        Args:
            xfer: a handle from :meth:`make_xfer`; unusable afterwards.
        """
        handle = xfer._take()
        if handle is None:
            return
        self._xfers.pop(handle, None)
        self._live()  # closed: the agent took its transfers with it
        try:
            with translate("release_xfer_handle", xfer.remote_agent):
                self._live().releaseXferReq(handle)
        except KvxferError:
            # NIXL could not cancel it and kept the handle (it may still land): so do we,
            # so the caller can poll it and release it again once it ended
            xfer._handle = handle
            self._xfers[handle] = xfer
            raise

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        """Send a notification not tied to a transfer.

        Args:
            remote_agent: a peer added with :meth:`add_remote`.
            msg: payload, delivered as bytes, in order per peer.
        """
        if self._auth_key is not None:
            msg = seal_notification(self._auth_key, self.name, msg, receiver_agent=remote_agent)
        with translate("send_notif", remote_agent):
            status = self._live().genNotif(remote_agent, msg)
        if status != _nixl.NIXL_SUCCESS:
            raise TransferError(f"send_notif to {remote_agent!r} returned {status}")

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Take the notifications that arrived since the last call.

        Returns:
            Remote agent name -> messages in arrival order (peers without any are absent).
        """
        with translate("get_notifs"):
            notifs = self._live().getNotifs({}, [])
        out = {str(name): list(msgs) for name, msgs in notifs.items()}
        if self._auth_key is None:
            return out
        # keyed: only notifications sealed with our key by the agent NIXL names as the
        # sender, fresh and never seen before, are handed on (the rest are counted)
        opened: dict[str, list[bytes]] = {}
        for name, msgs in out.items():
            for m in msgs:
                try:
                    opened.setdefault(name, []).append(open_notification(
                        self._auth_key, name, m, self._guard, receiver_agent=self.name))  # fmt: skip
                except Exception:  # AuthError, or anything a frame breaks: one frame only
                    self.num_unauthenticated += 1
        return opened


def _conforms(backend: NixlBackend) -> TransferBackend[PreparedList, XferHandle]:
    return backend  # mypy checks that NixlBackend satisfies the TransferBackend Protocol
