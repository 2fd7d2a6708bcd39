"""Authenticated frames for the control plane: HMAC-SHA256 with a deployment key (pure).

Every side-channel request and reply and every NIXL notification can be *sealed*::

    frame = MAGIC | body | tag
    body  = msgpack([purpose, sender, generation, counter, time_ms, payload])
    tag   = HMAC-SHA256(key, MAGIC | len(context) | context | body)     (32 bytes)

- ``MAGIC`` starts with byte ``0xc1``, which never begins a msgpack object, so a sealed
  frame is never mistaken for a plain one (and :func:`is_sealed` tells them apart).
- ``purpose`` separates domains (a sealed notification is no valid side-channel
  request); ``sender`` and ``generation`` name who sealed it (agent or engine name, and
  a random 64-bit id per process incarnation); ``counter`` increases per sealer.
- ``context`` is authenticated but not sent: a reply is sealed with the request's tag
  as context, so it only opens for the request it answers.
- :class:`ReplayGuard` accepts each ``(purpose, sender, generation, counter)`` once: a
  sliding window of the last :data:`REPLAY_WINDOW` counters per stream, and frames whose
  ``time_ms`` is more than ``window_s`` away from the receiver's clock are stale. Its
  memory is bounded (streams idle past twice the window are forgotten, at most
  ``max_streams``; only frames whose MAC verified ever enter it).

The key is shared by the whole deployment (symmetric): any holder can seal as any
sender. See ``docs/security.md`` for the trust model.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
import numpy as np
from msgspec import Struct

from kvxfer.errors import AuthError, LayoutError
from kvxfer.wire.limits import _ENCODER, MAX_MSG_BYTES, U64, Name

__all__ = [
    "ENV_KEY",
    "MAGIC",
    "MIN_KEY_BYTES",
    "NOTIFICATION",
    "SEAL_OVERHEAD",
    "SIDE_REPLY",
    "SIDE_REQUEST",
    "Opened",
    "ReplayGuard",
    "Sealer",
    "decrypt_reply",
    "encrypt_reply",
    "is_sealed",
    "load_auth_key",
    "open_frame",
    "open_notification",
    "seal_notification",
]

ENV_KEY = "KVXFER_AUTH_KEY"  # the deployment key, when not given in the configuration
MIN_KEY_BYTES = 16
MAGIC = b"\xc1KA1"
TAG_BYTES = 32
SEAL_OVERHEAD = 1024  # bytes a seal adds around a payload, at most (names <= 256 bytes)
REPLAY_WINDOW = 1024  # counters per stream remembered below the highest one seen
DEFAULT_WINDOW_S = 30.0  # accepted clock difference between sealer and opener

SIDE_REQUEST = "kvxfer/side-request"
SIDE_REPLY = "kvxfer/side-reply"
NOTIFICATION = "kvxfer/notification"


class _Body(Struct, array_like=True, frozen=True):
    purpose: Name
    sender: Name
    generation: U64
    counter: U64
    time_ms: U64
    payload: bytes


_BODY = msgspec.msgpack.Decoder(_Body)


@dataclass(frozen=True, slots=True)
class Opened:
    """A verified frame: who sealed it, when, and its payload. ``tag`` binds a reply to it."""

    purpose: str
    sender: str
    generation: int
    counter: int
    time_ms: int
    payload: bytes
    tag: bytes


def load_auth_key(
    value: bytes | str | None = None, env: Mapping[str, str] | None = None
) -> bytes | None:
    """Return the deployment key: ``value`` if given, else ``$KVXFER_AUTH_KEY``, else None.

    A str is taken as its UTF-8 bytes. None (no key) keeps the control plane
    unauthenticated: fine on loopback, refused by keyed peers.

    Raises:
        LayoutError: a key shorter than :data:`MIN_KEY_BYTES` bytes.
    """
    if value is None:
        value = (os.environ if env is None else env).get(ENV_KEY) or None
    if value is None:
        return None
    key = value.encode() if isinstance(value, str) else bytes(value)
    _check_key(key)
    return key


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) < MIN_KEY_BYTES:
        n = len(key) if isinstance(key, bytes | bytearray) else type(key).__name__
        raise LayoutError(f"auth key: at least {MIN_KEY_BYTES} bytes required, got {n}")


def is_sealed(frame: bytes) -> bool:
    """True if ``frame`` is a sealed frame (it may still fail to open)."""
    return bytes(frame[: len(MAGIC)]) == MAGIC


def _mac(key: bytes, context: bytes, signed: bytes) -> bytes:
    h = hmac.new(key, MAGIC, hashlib.sha256)
    h.update(len(context).to_bytes(4, "big"))
    h.update(context)
    h.update(signed)
    return h.digest()


_ENC_KEY_TAG = b"kvxfer.side-reply-encryption/1"
NONCE_BYTES = 16


def _keystream(key: bytes, nonce: bytes, n: int) -> bytes:
    """``n`` bytes of SHAKE-256 over an encryption key derived from ``key`` (HMAC, so it
    is not the MAC key) and a fresh ``nonce``: a stream cipher from the standard library."""
    enc_key = hmac.new(key, _ENC_KEY_TAG, hashlib.sha256).digest()
    return hashlib.shake_256(enc_key + nonce).digest(n)


def _xor(data: bytes, stream: bytes) -> bytes:
    return (np.frombuffer(data, np.uint8) ^ np.frombuffer(stream, np.uint8)).tobytes()


def encrypt_reply(key: bytes, plain: bytes) -> bytes:
    """A side-channel reply payload only key holders can read: a random nonce, then
    ``plain`` XORed with the keystream (sealed afterwards: encrypt, then MAC). Records
    carry agent metadata, which gives UCX access to an agent's memory: a request
    replayed to another server (it never saw it, so its replay window lets it through)
    must not get them in clear."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + _xor(plain, _keystream(key, nonce, len(plain)))


def decrypt_reply(key: bytes, data: bytes) -> bytes:
    """The plain payload of :func:`encrypt_reply` (its frame's MAC already verified)."""
    if len(data) < NONCE_BYTES:
        raise AuthError(f"encrypted reply of {len(data)} bytes: shorter than its nonce")
    nonce, body = data[:NONCE_BYTES], data[NONCE_BYTES:]
    return _xor(body, _keystream(key, nonce, len(body)))


class Sealer:
    """Seals frames of one purpose for one sender; thread-safe (the counter is atomic).

    Args:
        key: the deployment key (>= 16 bytes).
        purpose: the domain tag, e.g. :data:`SIDE_REQUEST`.
        sender: who seals (an agent or engine name, <= 256 characters).
        generation: this sender's incarnation (default: random per Sealer).
    """

    def __init__(self, key: bytes, purpose: str, sender: str, generation: int | None = None):
        _check_key(key)
        self._key = bytes(key)
        self.purpose = purpose
        self.sender = sender
        self.generation = secrets.randbits(64) if generation is None else generation
        self._counter = itertools.count()

    def seal(self, payload: bytes, *, context: bytes = b"", now: float | None = None) -> bytes:
        """Return the sealed frame of ``payload``; ``context`` is authenticated, not sent."""
        t = time.time() if now is None else now
        body = _ENCODER.encode(
            _Body(
                self.purpose,
                self.sender,
                self.generation,
                next(self._counter),
                int(t * 1000),
                bytes(payload),
            )
        )
        return MAGIC + body + _mac(self._key, context, body)


_WINDOW_MASK = (1 << REPLAY_WINDOW) - 1


class ReplayGuard:
    """Accepts each sealed frame once within its freshness window; thread-safe, bounded.

    Args:
        window_s: a frame whose time differs from this clock by more is stale.
        max_streams: senders (sender, generation, purpose) tracked at once; when full of
            fresh streams, new ones are refused (only authenticated senders create them).
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_streams: int = 4096) -> None:
        self.window_s = window_s
        self.max_streams = max_streams
        self._lock = threading.Lock()
        self._streams: dict[tuple[str, str, int], list[float | int]] = {}  # [seen, high, mask]

    def check(self, opened: Opened, now: float | None = None) -> None:
        """Raise AuthError if ``opened`` is stale or its counter was already accepted."""
        t = time.time() if now is None else now
        if abs(t * 1000 - opened.time_ms) > self.window_s * 1000:
            raise AuthError(f"stale frame: sealed {opened.time_ms / 1000 - t:+.1f} s from now")
        key = (opened.purpose, opened.sender, opened.generation)
        c = opened.counter
        with self._lock:
            st = self._streams.get(key)
            if st is None:
                if len(self._streams) >= self.max_streams:
                    self._purge(t)
                if len(self._streams) >= self.max_streams:
                    raise AuthError("replay guard full: too many senders in the window")
                self._streams[key] = [t, c, 1]
                return
            seen, high, mask = st[0], int(st[1]), int(st[2])
            if c > high:  # shift the window up to c (a jump past it starts it afresh:
                # a shift by the gap would build a number of that many bits)
                shift = c - high
                mask = 1 if shift >= REPLAY_WINDOW else ((mask << shift) | 1) & _WINDOW_MASK
                high = c
            elif high - c >= REPLAY_WINDOW:
                raise AuthError(f"replayed or too old frame: counter {c}, newest {high}")
            elif mask >> (high - c) & 1:
                raise AuthError(f"replayed frame: counter {c} already accepted")
            else:
                mask |= 1 << (high - c)
            st[:] = [max(float(seen), t), high, mask]

    def _purge(self, now: float) -> None:
        idle = 2 * self.window_s  # a frame of an idle stream is stale by then
        for k in [k for k, st in self._streams.items() if now - float(st[0]) > idle]:
            del self._streams[k]

    def __len__(self) -> int:
        return len(self._streams)


def open_frame(
    key: bytes,
    frame: bytes,
    purpose: str,
    *,
    context: bytes = b"",
    sender: str | None = None,
    guard: ReplayGuard | None = None,
    max_bytes: int = MAX_MSG_BYTES + SEAL_OVERHEAD,
    now: float | None = None,
) -> Opened:
    """Verify and decode a sealed frame.

    Args:
        key: the deployment key.
        frame: the bytes received.
        purpose: the domain expected (a frame sealed for another purpose is refused).
        context: what the sealer authenticated without sending (a request's tag).
        sender: if given, the frame must be sealed by this sender.
        guard: replay protection; None checks only the MAC, purpose and sender.
        max_bytes: larger frames are refused before any work.

    Raises:
        AuthError: not sealed, oversized, MAC mismatch, wrong purpose or sender, stale
            or replayed. Messages name no secret.
    """
    _check_key(key)
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise AuthError(f"expected bytes, got {type(frame).__name__}")
    frame = bytes(frame)
    if len(frame) > max_bytes:
        raise AuthError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    if not is_sealed(frame) or len(frame) < len(MAGIC) + TAG_BYTES + 1:
        raise AuthError("frame is not sealed")
    body, tag = frame[len(MAGIC) : -TAG_BYTES], frame[-TAG_BYTES:]
    if not hmac.compare_digest(_mac(bytes(key), context, body), tag):
        raise AuthError("bad MAC (wrong key or altered frame)")
    try:  # authenticated: the body was sealed by a key holder
        b = _BODY.decode(body)
    except (msgspec.MsgspecError, ValueError, RecursionError) as e:
        raise AuthError(f"sealed body: {e}") from None
    if b.purpose != purpose:
        raise AuthError(f"frame sealed for {b.purpose!r}, expected {purpose!r}")
    if sender is not None and b.sender != sender:
        raise AuthError(f"frame sealed by {b.sender!r}, received from {sender!r}")
    opened = Opened(b.purpose, b.sender, b.generation, b.counter, b.time_ms, b.payload, tag)
    if guard is not None:
        guard.check(opened, now)
    return opened


# ---------------------------------------------------------------- notifications

_NOTIF_SEALERS: dict[tuple[bytes, str, str], Sealer] = {}
_NOTIF_LOCK = threading.Lock()
_NOTIF_GUARD = ReplayGuard()


def _to(receiver_agent: str) -> bytes:
    return b"to:" + receiver_agent.encode()


def seal_notification(
    key: bytes, sender_agent: str, payload: bytes, *, receiver_agent: str = ""
) -> bytes:
    """Seal a NIXL notification sent by agent ``sender_agent`` to ``receiver_agent``: the
    frame opens only there (the receiver's name is authenticated, not sent), and each
    (sender, receiver) pair has its own counter, so a receiver's own replay guard
    judges it alone: notices sealed meanwhile to other receivers do not move its
    window past one delivered late (a WriteDone is sealed when its WRITE is made).

    The generation is random per process and pair, so a restarted sender never reuses
    (generation, counter) pairs.
    """
    pair = (bytes(key), sender_agent, receiver_agent)
    with _NOTIF_LOCK:
        sealer = _NOTIF_SEALERS.get(pair)
        if sealer is None:
            if len(_NOTIF_SEALERS) >= 4096:  # bounded: agents come and go
                _NOTIF_SEALERS.clear()
            sealer = Sealer(key, NOTIFICATION, sender_agent)
            _NOTIF_SEALERS[pair] = sealer
    return sealer.seal(payload, context=_to(receiver_agent))


def open_notification(
    key: bytes,
    sender_agent: str,
    frame: bytes,
    guard: ReplayGuard | None = None,
    *,
    receiver_agent: str = "",
) -> bytes:
    """Return the payload of a notification that NIXL reports from ``sender_agent`` to
    ``receiver_agent``.

    The frame must be sealed with ``key`` by that same agent for that receiver, fresh
    and never seen before (``guard``: the receiver's own; default one process-wide).

    Raises:
        AuthError: unsealed, forged, sealed by another agent, stale or replayed.
    """
    opened = open_frame(
        key,
        frame,
        NOTIFICATION,
        sender=sender_agent,
        guard=_NOTIF_GUARD if guard is None else guard,
        context=_to(receiver_agent),
    )
    return opened.payload
