"""The handshake side channel over ZMQ, server side (the client is
:mod:`kvxfer.transport.side_client`; the two are the only modules that import zmq).

A producer runs one :class:`SideChannelServer` (a ROUTER socket in a daemon
thread) that answers :class:`~kvxfer.wire.GetRecords` with its ranks' encoded
handshake records. A consumer calls
:func:`~kvxfer.transport.side_client.fetch_records` on first contact with an engine. Addresses are configuration (``tcp://host:port``); nothing assumes
one host.

Frames: a client sends one frame, ``encode_side(GetRecords(...))`` (a REQ client's
empty delimiter frame is accepted too); the server replies with one frame,
``encode_side(Records(...))`` or ``encode_side(ErrorReply(...))``. A producer also
answers :class:`~kvxfer.wire.GetPushStatus` (which of these push attempts did it fail
without being able to tell the consumer over NIXL) with a
:class:`~kvxfer.wire.PushStatus`, from :meth:`SideChannelServer.set_push_status`'s source.

Authentication (:mod:`kvxfer.wire.auth`): with a deployment key, the request is that
frame sealed for ``SIDE_REQUEST`` and the reply is sealed for ``SIDE_REPLY`` with the
request's tag as context (it opens only for that request). A keyed server answers
anything else with one fixed refusal, ``ErrorReply("unauthorized", "authentication
required")``: no compat hash, no record, no decoding detail. Without a key on either
side the plain frames above are used (loopback deployments); a server bound to a
non-loopback address without a key logs a loud warning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import zmq

from kvxfer.errors import (
    AuthError,
    ConfigError,
    LayoutError,
    ProtocolError,
)
from kvxfer.transport.side_limits import RCVHWM, SNDBUF, SNDHWM, Pending, is_loopback
from kvxfer.wire import (
    MAX_REASON_LEN,
    MAX_SIDE_REPLY_BYTES,
    MAX_SIDE_REQUEST_BYTES,
    ErrorReply,
    GetPushStatus,
    GetRecords,
    PushFailure,
    PushStatus,
    Records,
    decode_side,
    encode_side,
    peek_hash,
)
from kvxfer.wire.auth import (
    ENV_KEY,
    SEAL_OVERHEAD,
    SIDE_REPLY,
    SIDE_REQUEST,
    ReplayGuard,
    Sealer,
    encrypt_reply,
    is_sealed,
    open_frame,
)
from kvxfer.wire.records import MODEL_MARK

__all__ = ["PushStatusSource", "RecordSource", "SideChannelServer", "is_loopback"]

log = logging.getLogger(__name__)

RecordSource = Mapping[int, bytes] | Callable[[], Mapping[int, bytes]]
"""Encoded record envelopes by TP rank, or a callable returning them per request."""
PushStatusSource = Callable[[tuple[int, ...]], tuple[PushFailure, ...]]
"""The push attempts asked about -> the unannounced failures among them."""

_POLL_MS = 50  # how often the server thread checks for stop()
_BATCH = 256  # requests handled per poll
_CACHE_BYTES = MAX_SIDE_REPLY_BYTES // 2  # cached encoded replies, all together
_REFUSAL = encode_side(ErrorReply("unauthorized", "authentication required"))


class SideChannelServer:
    """Serve encoded handshake records by TP rank on a ZMQ ROUTER socket.

    Args:
        bind_addr: ZMQ endpoint to bind, e.g. ``tcp://0.0.0.0:5600``; port 0 (or
            ``*``) picks a free port, reported by :attr:`address`.
        records_by_rank: encoded envelopes (from :func:`~kvxfer.wire.encode_record`)
            by rank, or a callable returning them, called on every request. A mapping
            is taken as fixed (its replies are cached): change it with
            :meth:`set_records`.
        max_request_bytes: requests larger than this are dropped by ZMQ itself.
        auth_key: the deployment key; with it only sealed, fresh requests get an answer
            (see the module docstring). None: plain frames (loopback deployments).
        identity: the sender name this server seals its replies with.

    The server never dies from input: a malformed request gets an ErrorReply with
    code ``malformed`` (with a key: the fixed refusal), a log line and
    ``num_rejected += 1``.

    Memory stays bounded under clients that never read: ZMQ queues few requests per
    peer, a peer with about one large reply still inside ZMQ gets no new one (its
    request is dropped before any work),
    and replies in flight are bounded (:class:`~kvxfer.transport.side_limits.Pending`;
    ``num_dropped`` counts the drops).
    """

    def __init__(
        self,
        bind_addr: str,
        records_by_rank: RecordSource,
        *,
        max_request_bytes: int = MAX_SIDE_REQUEST_BYTES,
        auth_key: bytes | None = None,
        identity: str = "kvxfer-side-channel",
        facts: str = "",
    ) -> None:
        self._bind_addr = bind_addr
        self._facts = facts  # the engine's model facts (JSON), named in "incompatible" replies
        self._sealer = None if auth_key is None else Sealer(auth_key, SIDE_REPLY, identity)
        self._key = auth_key
        self._guard = ReplayGuard()
        self._records: RecordSource = records_by_rank
        self._push_status: PushStatusSource | None = None  # a producer's failed pushes
        self._max_request_bytes = max_request_bytes
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._address = ""
        self.num_served = 0
        self.num_rejected = 0
        self.num_dropped = 0
        self._pending = Pending()
        self._cache: dict[bytes, bytes] = {}  # request body -> encoded reply (static records)
        self._cache_hit = False

    @property
    def address(self) -> str:
        """The endpoint actually bound (a free port resolved); empty before :meth:`start`."""
        return self._address

    def set_records(self, records_by_rank: RecordSource) -> None:
        """Replace the served records (e.g. after a restart with a new generation)."""
        with self._lock:
            self._records = records_by_rank
            self._cache = {}

    def set_push_status(self, source: PushStatusSource | None) -> None:
        """Answer GetPushStatus from ``source`` (attempts asked -> the failures among
        them; called in the server thread, so it must be thread-safe and quick)."""
        with self._lock:
            self._push_status = source

    def start(self) -> SideChannelServer:
        """Bind the socket (errors raise here, in the caller) and start the serving thread."""
        if self._stop.is_set():
            raise LayoutError("side channel: a stopped server cannot restart; create a new one")
        if self._thread is not None:
            return self
        addr = self._bind_addr
        if addr.startswith("tcp://") and addr.endswith(":0"):
            addr = addr[:-1] + "*"
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        overhead = 0 if self._key is None else SEAL_OVERHEAD
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_request_bytes + overhead)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone peer raises: we count it
        # a fixed kernel send buffer: a peer that never reads absorbs at most this much
        # (autotuning would let it take ~4 MiB of replies, each costing us a copy)
        sock.setsockopt(zmq.SNDBUF, SNDBUF)
        try:
            sock.bind(addr)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise ConfigError(f"side channel: cannot bind {self._bind_addr!r}: {e}") from None
        self._sock = sock
        self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self._key is None and not is_loopback(self._bind_addr):
            log.warning(
                "side channel %s: bound on a non-loopback address WITHOUT an authentication "
                "key: anyone who reaches it gets agent metadata and memory addresses (see "
                "docs/security.md); set EngineConfig.auth_key or %s",
                self._address,
                ENV_KEY,
            )
        # the socket moves to the thread; the thread start is the memory barrier ZMQ needs
        self._thread = threading.Thread(target=self._serve, name="kvxfer-side-channel", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, join the thread and close the socket. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> SideChannelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set():
            try:
                if not sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
                for _ in range(_BATCH):  # drain without a poll per message
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                    try:
                        self._handle(sock, frames)
                    except Exception:  # one bad request never stops the server
                        self._drop("internal error")
                        log.exception("side channel %s: request failed", self._address)
            except zmq.Again:
                continue
            except zmq.ZMQError as e:  # the socket is unusable: nothing more to serve
                log.error("side channel %s: receive failed: %s", self._address, e)
                return

    def _handle(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        self._cache_hit = False
        if self._pending.busy(identity):  # it has not taken its last reply: no work for it
            self._drop("previous reply not read")
            return
        prefix: list[bytes] = []
        if len(body) == 2 and body[0] == b"":  # REQ clients send an empty delimiter
            prefix, body = [b""], body[1:]
        if len(body) != 1:
            reject = self._reject(f"expected one frame, got {len(body)}")
            buf = _REFUSAL if self._key is not None else encode_side(reject)
        else:
            buf = self._respond(body[0])
        if not self._pending.admit(identity, buf):
            self._drop(f"{self._pending.num_bytes} reply bytes in flight")
            return
        try:  # zero-copy; the tracker says when ZMQ has handed the reply to the kernel
            tracker = sock.send_multipart(
                [identity, *prefix, buf], zmq.NOBLOCK, copy=False, track=True
            )
        except zmq.ZMQError as e:  # peer gone or its queue full: drop the reply
            self._drop(str(e))
            return
        if tracker is not None:
            self._pending.add(identity, tracker, buf)
        self.num_served += self._cache_hit

    def _drop(self, why: str) -> None:
        self.num_dropped += 1
        n = self.num_dropped
        if n <= 10 or n % 10000 == 0:  # bounded logging under a flood
            log.warning("side channel %s: reply #%d dropped: %s", self._address, n, why)

    def _respond(self, frame: bytes) -> bytes:
        """The reply frame to one request frame (sealed, plain, or the fixed refusal)."""
        if self._key is None or self._sealer is None:
            if is_sealed(frame):
                why = "an authenticated request, but this server has no key"
                return encode_side(ErrorReply("unauthorized", self._reject(why).message))
            return self._plain_reply(frame)
        try:
            opened = open_frame(
                self._key,
                frame,
                SIDE_REQUEST,
                guard=self._guard,
                max_bytes=self._max_request_bytes + SEAL_OVERHEAD,
            )
        except AuthError as e:
            self._reject(f"unauthenticated: {e}")  # the detail stays in our log
            return _REFUSAL
        reply = self._encode(self._answer_safe(opened.payload))
        return self._sealer.seal(encrypt_reply(self._key, reply), context=opened.tag)

    def _plain_reply(self, body: bytes) -> bytes:
        """The encoded reply to a plain request; cached while the records are a mapping.

        Identical requests then get the very same buffer, which zero-copy sends share
        (a flood of identical requests costs one reply's memory).
        """
        with self._lock:
            cache, static = self._cache, not callable(self._records)
        buf = cache.get(body)
        if buf is None:
            reply = self._answer_safe(body)
            buf = self._encode(reply)
            if static and isinstance(reply, Records) and len(buf) <= _CACHE_BYTES:
                if len(cache) >= 64 or sum(map(len, cache.values())) + len(buf) > _CACHE_BYTES:
                    cache.clear()  # bounded: a few distinct requests are all a deployment makes
                cache[body] = buf
        else:
            self._cache_hit = True  # counted as served once it is sent
        return buf

    def _answer_safe(self, body: bytes) -> ErrorReply | Records | PushStatus:
        try:
            return self._answer(body)
        except Exception as e:  # the server must outlive any input or record source
            log.exception("side channel %s: internal error", self._address)
            return ErrorReply("internal", f"{type(e).__name__}: {e}"[:MAX_REASON_LEN])

    @staticmethod
    def _encode(reply: ErrorReply | Records | PushStatus) -> bytes:
        buf = encode_side(reply)
        if len(buf) > MAX_SIDE_REPLY_BYTES:
            buf = encode_side(ErrorReply("too_large", f"reply of {len(buf)} bytes"))
        return buf

    def _answer(self, body: bytes) -> ErrorReply | Records | PushStatus:
        try:
            req = decode_side(body, self._max_request_bytes)
        except ProtocolError as e:
            return self._reject(str(e))
        if isinstance(req, GetPushStatus):
            with self._lock:
                status = self._push_status
            return PushStatus(status(req.attempts) if status is not None else ())
        if not isinstance(req, GetRecords):
            return self._reject(f"expected GetRecords, got {type(req).__name__}")
        with self._lock:
            source = self._records
        by_rank = source() if callable(source) else source
        ranks = sorted(by_rank) if req.ranks is None else req.ranks
        if len(set(ranks)) != len(ranks):  # one rank many times: a reply of many records
            return self._reject(f"ranks repeat: {len(ranks)} given, {len(set(ranks))} distinct")
        missing = [r for r in ranks if r not in by_rank]
        if missing:
            msg = f"no record for ranks {missing}; have {sorted(by_rank)}"
            return ErrorReply("unknown_rank", msg[:MAX_REASON_LEN])
        records = tuple(by_rank[r] for r in ranks)
        size = sum(len(b) for b in records)
        if size > MAX_SIDE_REPLY_BYTES:  # known before encoding (and allocating) it
            return ErrorReply("too_large", f"reply of at least {size} bytes")
        for r, buf in zip(ranks, records, strict=True):
            have = peek_hash(buf)
            if have != req.expected_hash:
                msg = f"compat hash mismatch: rank {r} has {have!r}, expected {req.expected_hash!r}"
                if self._facts:  # the peer can then say which fact differs
                    msg += f"{MODEL_MARK}{self._facts}"
                return ErrorReply("incompatible", msg[:MAX_REASON_LEN])
        self.num_served += 1
        return Records(records)

    def _reject(self, why: str) -> ErrorReply:
        self.num_rejected += 1
        n = self.num_rejected
        if n <= 10 or n % 1000 == 0:  # bounded logging under a flood of junk
            log.warning("side channel %s: rejected request #%d: %s", self._address, n, why[:200])
        return ErrorReply("malformed", why[:MAX_REASON_LEN])
