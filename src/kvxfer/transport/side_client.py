"""The handshake side channel over ZMQ, client side: :func:`fetch_records` asks a
producer's :class:`~kvxfer.transport.side_channel.SideChannelServer` for its ranks'
records, and :func:`fetch_push_failures` asks it which pushes it failed unannounced
(frames and authentication as described there)."""

from __future__ import annotations

import os
import threading
import time
from typing import NoReturn

import zmq

from kvxfer.errors import (
    AuthError,
    ClosedError,
    ConfigError,
    IncompatibleError,
    PeerLostError,
    ProtocolError,
)
from kvxfer.wire import (
    MAX_RANKS,
    MAX_SIDE_REPLY_BYTES,
    ErrorReply,
    GetPushStatus,
    GetRecords,
    LayoutRecord,
    ModelFacts,
    PushFailure,
    PushStatus,
    Records,
    SideMsg,
    decode_record,
    decode_side,
    encode_side,
    explain_mismatch,
)
from kvxfer.wire.auth import (
    ENV_KEY,
    SEAL_OVERHEAD,
    SIDE_REPLY,
    SIDE_REQUEST,
    Sealer,
    decrypt_reply,
    is_sealed,
    open_frame,
)

__all__ = ["CANCEL_POLL_S", "fetch_push_failures", "fetch_records"]

CANCEL_POLL_S = 0.05  # how often a cancellable fetch looks at its cancel event


_CLIENT_SEALERS: dict[bytes, Sealer] = {}
_CLIENT_LOCK = threading.Lock()


def _client_sealer(key: bytes) -> Sealer:
    """One request sealer per key and process (one replay stream per client process)."""
    with _CLIENT_LOCK:
        sealer = _CLIENT_SEALERS.get(key)
        if sealer is None:
            if len(_CLIENT_SEALERS) >= 16:
                _CLIENT_SEALERS.clear()
            sealer = _CLIENT_SEALERS[key] = Sealer(key, SIDE_REQUEST, f"fetch-{os.getpid()}")
        return sealer


def _open_reply(address: str, frame: bytes, key: bytes | None, request: bytes) -> bytes:
    """The plain reply bytes of ``frame``; AuthError when the two sides' keys disagree."""
    if key is None:
        if is_sealed(frame):
            raise AuthError(f"side channel {address}: sealed reply to a plain request")
        return frame
    if not is_sealed(frame):
        reply = decode_side(frame, MAX_SIDE_REPLY_BYTES)
        what = (
            f"{reply.code}: {reply.message}"
            if isinstance(reply, ErrorReply)
            else type(reply).__name__
        )
        raise AuthError(
            f"side channel {address}: the server did not authenticate its reply ({what}); "
            "both sides need the same deployment key"
        )
    try:
        opened = open_frame(
            key,
            frame,
            SIDE_REPLY,
            context=request[-32:],  # the request's tag: this reply answers this request
            max_bytes=MAX_SIDE_REPLY_BYTES + SEAL_OVERHEAD,
        )
        return decrypt_reply(key, opened.payload)
    except AuthError as e:
        raise AuthError(f"side channel {address}: reply failed authentication: {e}") from None


def _wait_reply(sock: zmq.Socket[bytes], timeout_s: float, cancel: threading.Event | None) -> bool:
    """Whether a reply arrived within ``timeout_s`` (False at once once ``cancel`` is set)."""
    if cancel is None:
        return bool(sock.poll(max(1, int(timeout_s * 1000)), zmq.POLLIN))
    end = time.monotonic() + timeout_s
    while not cancel.is_set():
        left = end - time.monotonic()
        if left <= 0:
            return False
        if sock.poll(max(1, int(min(left, CANCEL_POLL_S) * 1000)), zmq.POLLIN):
            return True
    return False


def fetch_records(
    address: str,
    ranks: list[int] | None,
    expected_hash: str,
    timeout_s: float,
    *,
    auth_key: bytes | None = None,
    facts: ModelFacts | None = None,
    cancel: threading.Event | None = None,
) -> list[LayoutRecord]:
    """Fetch and decode the handshake records of ``ranks`` (None: all) from ``address``.

    ``facts``: the caller's model facts (what ``expected_hash`` covers); a server that
    refuses the hash names its own, and the IncompatibleError then names those that
    differ.

    Uses a fresh DEALER socket per call, so it is thread-safe. The peer gets
    ``timeout_s`` to answer, counted from the request being queued: a caller held up
    before it could wait (a starved thread on a loaded machine) still waits that long,
    so a late caller is not mistaken for a silent peer. With ``auth_key`` the request is
    sealed and only a reply sealed for it is accepted. ``cancel``: set by the caller's
    ``close()``; the wait then ends within ``CANCEL_POLL_S``.

    Returns:
        The decoded records, in the order of ``ranks`` (by rank when None).

    Raises:
        PeerLostError: no reply within ``timeout_s`` (the message names both).
        ClosedError: ``cancel`` was set before the reply came.
        IncompatibleError: the server or a record has another compat hash.
        ProtocolError: the reply or a record is malformed, or the server refused.
        AuthError: the server requires a key and none was given, or its reply is not
            authenticated with ours (a ProtocolError).
        LayoutError: ``address`` is not a valid ZMQ endpoint.
    """
    if ranks is not None and (len(ranks) > MAX_RANKS or any(not 0 <= r < 1 << 32 for r in ranks)):
        raise ConfigError(f"ranks must be at most {MAX_RANKS} ints in [0, 2**32), got {ranks}")
    get = GetRecords(None if ranks is None else tuple(ranks), expected_hash)
    reply = _exchange(address, get, timeout_s, auth_key, cancel)
    if isinstance(reply, ErrorReply):
        _refused(address, reply, auth_key, facts)
    if not isinstance(reply, Records):
        raise ProtocolError(f"side channel {address}: unexpected reply {type(reply).__name__}")
    if ranks is not None and len(reply.records) != len(ranks):
        raise ProtocolError(
            f"side channel {address}: asked for {len(ranks)} records, got {len(reply.records)}"
        )
    out = [decode_record(buf, expected_hash) for buf in reply.records]
    for i, rec in enumerate(out):
        if ranks is not None and rec.tp_rank != ranks[i]:
            raise ProtocolError(
                f"side channel {address}: record {i} is for tp_rank {rec.tp_rank}, "
                f"asked for {ranks[i]}"
            )
    return out


def fetch_push_failures(
    address: str,
    attempts: tuple[int, ...],
    timeout_s: float,
    *,
    auth_key: bytes | None = None,
    cancel: threading.Event | None = None,
) -> tuple[PushFailure, ...] | None:
    """Ask the producer process at ``address`` which of these push ``attempts`` it failed
    without being able to tell this consumer over NIXL (:class:`~kvxfer.wire.PushStatus`).

    Returns the failures among ``attempts`` (others the reply names are dropped), or
    None from a kvxfer that predates the question (it refuses it as malformed). Raises
    as :func:`fetch_records` does.
    """
    reply = _exchange(address, GetPushStatus(attempts), timeout_s, auth_key, cancel)
    if isinstance(reply, ErrorReply):
        if reply.code == "malformed":
            return None  # an older server: it answers GetRecords only
        _refused(address, reply, auth_key, None)
    if not isinstance(reply, PushStatus):
        raise ProtocolError(f"side channel {address}: unexpected reply {type(reply).__name__}")
    asked = set(attempts)
    return tuple(f for f in reply.failed if f.attempt in asked)


def _exchange(
    address: str,
    msg: GetRecords | GetPushStatus,
    timeout_s: float,
    auth_key: bytes | None,
    cancel: threading.Event | None,
) -> SideMsg:
    """Send ``msg`` to the server at ``address`` (sealed with ``auth_key``) and return its
    decoded, authenticated reply."""
    request = encode_side(msg)
    if auth_key is not None:
        request = _client_sealer(auth_key).seal(request)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_SIDE_REPLY_BYTES + SEAL_OVERHEAD)
        try:
            sock.connect(address)
        except zmq.ZMQError as e:
            raise ConfigError(f"side channel: bad address {address!r}: {e}") from None
        lost = PeerLostError(f"side channel {address}: no reply within timeout {timeout_s} s")
        try:
            sock.send(request, zmq.NOBLOCK)  # DEALER queues on the pipe connect() created
        except zmq.Again:
            raise lost from None
        # ZMQ's own thread connects, sends and receives without us: the wait is the peer's
        if not _wait_reply(sock, timeout_s, cancel):
            if cancel is not None and cancel.is_set():
                raise ClosedError(f"side channel {address}: cancelled (closing)")
            raise lost
        frames = sock.recv_multipart(zmq.NOBLOCK)
    finally:
        sock.close(linger=0)
    if len(frames) != 1:
        raise ProtocolError(f"side channel {address}: expected one reply frame, got {len(frames)}")
    return decode_side(_open_reply(address, frames[0], auth_key, request), MAX_SIDE_REPLY_BYTES)


def _refused(
    address: str, reply: ErrorReply, auth_key: bytes | None, facts: ModelFacts | None
) -> NoReturn:
    """Raise the typed error for the server's refusal ``reply``."""
    if reply.code == "unauthorized" and auth_key is None:
        raise AuthError(
            f"side channel {address}: the server requires authentication: configure "
            f"the deployment key (EngineConfig.auth_key or {ENV_KEY})"
        )
    cls = IncompatibleError if reply.code == "incompatible" else ProtocolError
    cls = AuthError if reply.code == "unauthorized" else cls
    message = reply.message
    if cls is IncompatibleError and facts is not None:
        message = explain_mismatch(message, facts)
    raise cls(f"side channel {address}: {reply.code}: {message}")
