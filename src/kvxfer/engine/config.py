"""What producer and consumer engines share: configuration, request states, cache allocation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import numpy.typing as npt

from kvxfer.errors import ConfigError
from kvxfer.layout.model import DeviceBuffer
from kvxfer.layout.spec import LayoutSpec
from kvxfer.wire import ModelFacts, compat_hash, model_facts
from kvxfer.wire.limits import MAX_BUDGET_MS, MAX_HOLD_SLOTS, MAX_REQUEST_ID_LEN

__all__ = [
    "U8",
    "Buffer",
    "EngineConfig",
    "RequestState",
    "allocate_cache",
    "check_deadline",
    "check_hold_slots",
    "check_seconds",
]

U8 = npt.NDArray[np.uint8]
# one region's memory: a host uint8 array, or memory by address (e.g. GPU, DeviceBuffer)
Buffer = U8 | DeviceBuffer


MAX_DEADLINE_S = MAX_BUDGET_MS / 1000  # a request's deadline: the wire carries an hour
CLOSE_JOIN_S = 5.0  # close() waits at most this long for an engine's threads to stop


def check_seconds(
    name: str, value: object, *, allow_zero: bool = False, max_s: float | None = None
) -> float:
    """Return ``value`` as float seconds; ConfigError (a ValueError) naming ``name`` unless
    it is a finite number > 0 (>= 0 with ``allow_zero``), and at most ``max_s`` when
    given. NaN/inf never pass: a NaN deadline never expires and a NaN lease never ends."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be finite and {bound} seconds, got {value!r}")
    if max_s is not None and v > max_s:
        raise ConfigError(f"{name} must be at most {max_s:g} seconds, got {value!r}")
    return v


def check_deadline(name: str, value: object) -> float:
    """A request deadline in seconds: > 0 and at most :data:`MAX_DEADLINE_S` (an hour:
    what a push request's budget and a lease renewal carry)."""
    return check_seconds(name, value, max_s=MAX_DEADLINE_S)


def check_lease(name: str, value: object) -> float:
    """A lease in seconds: > 0 and at most :data:`MAX_DEADLINE_S` (an hour, what a lease
    renewal carries; a longer one never ends in practice, and past about 9e9 s its
    nanoseconds overflow)."""
    return check_seconds(name, value, max_s=MAX_DEADLINE_S)


def check_request_id(request_id: object) -> str:
    """A request id the wire can carry: a str of at most ``MAX_REQUEST_ID_LEN`` chars."""
    if not isinstance(request_id, str) or len(request_id) > MAX_REQUEST_ID_LEN:
        shown = request_id if not isinstance(request_id, str) else f"{request_id[:40]!r}..."
        raise ConfigError(
            f"request_id must be a str of at most {MAX_REQUEST_ID_LEN} characters (what "
            f"the wire carries), got {type(request_id).__name__} {shown}"
            + (f" of {len(request_id)}" if isinstance(request_id, str) else "")
        )
    return request_id


def check_hold_slots(name: str, value: object) -> int:
    """Return ``value`` as a hold-table size; ConfigError naming ``name`` unless it is an
    integer in ``[1, MAX_HOLD_SLOTS]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_HOLD_SLOTS:
        raise ConfigError(f"{name} must be an integer in [1, {MAX_HOLD_SLOTS}], got {value!r}")
    return value


class RequestState(str, Enum):
    """Lifecycle of one request attempt on a consumer. Everything but PENDING is terminal.

    What can still land in the local blocks after a terminal state:

    - DONE: nothing more; every byte landed.
    - Pull (READ), any other terminal state: the blocks may hold partial bytes, and a
      READ NIXL still ran when the request ended may land more: releasing it does not
      stop it (measured: over UCX's TCP transport a READ from a stopped producer is
      served when the producer runs again, 8 MB landing seconds after TIMEOUT). Such
      a READ is kept, not released, and the blocks are QUARANTINED
      (``Transfer.quarantined``) until NIXL reports it ended (done or failed; polled
      by the consumer's inbox thread and by each ``quarantined`` call), or, for a READ
      released with its dropped peer (which cannot be polled), until its producer's
      process is proven gone; at most until ``deadline + lease_s``. A READ that had
      ended when the request failed leaves no quarantine; one NIXL reports failed
      counts as ended (assumed: NIXL reports an error once no part of it runs).
    - Push (WRITE), any other terminal state: the producer may still be writing, so
      the local blocks are QUARANTINED (``Transfer.quarantined`` is True): not
      reusable until every producer rank the request went to confirmed (``Cancelled``
      or ``WriteDone`` for this attempt), or its process is proven gone (its side
      channel refuses connections, or another incarnation answers there: see
      :mod:`kvxfer.engine.liveness`), or ``deadline + lease_s`` passed. The
      producer never starts a write past the request's deadline (the PushRequest
      carries its remaining budget), and confirms a cancel (an Abort, or the deadline)
      only once NIXL reports the WRITE ended: it does not release a WRITE in flight
      to stop it (that does not stop it, as for pull). One still running 60 s past
      the deadline (``pusher.CANCEL_LINGER_S``) is released and never confirmed: the
      consumer's own bound ends that quarantine. The cancel of a queued push is remembered
      exactly until it is dequeued. A push's hold-check READs are quarantined as in
      pull.
    - Residual risk, both modes: the time bound assumes the producer process gets
      scheduled; a producer stopped (SIGSTOP) past ``deadline + lease_s`` with a READ
      in flight from it, or a WRITE already posted, could land bytes when continued.
    """

    PENDING = "pending"  # waiting for first contact or for the transfer to finish
    DONE = "done"  # every byte landed (and was re-laid-out)
    FAILED = "failed"  # bad input or a transfer error; nothing usable landed
    TIMEOUT = "timeout"  # deadline passed; local block bytes undefined, never written after
    PEER_LOST = "peer_lost"  # the producer died or restarted mid-request
    ABORTED = "aborted"  # cancelled by the caller or the other side

    @property
    def is_terminal(self) -> bool:
        return self is not RequestState.PENDING


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of one engine (all its TP ranks).

    Attributes:
        engine_id: a name unique among engines; agent names derive from it.
        side_channel_addr: ZMQ endpoint to bind (producer) — any host; port 0 picks one.
        model_name, dtype, kv_dtype: model facts in the compatibility hash.
        progress_delay_us: NIXL progress-thread sleep (0 spins a core).
        deadline_s: default per-request deadline (consumer).
        lease_s: default lease on held blocks (producer).
        handshake_timeout_s: side-channel fetch timeout.
        strided: prepare strided (N, 5) lists; False forces the dense (N, 3) fallback.
        heartbeat_s: interval of consumer lease renewals / liveness checks.
        silence_s: how long a producer may leave heartbeats unanswered before the
            consumer drops it and its loads end PEER_LOST (and at least 3 probes in a
            row); a live producer on a busy host can be silent for seconds. A dead one
            is dropped at its first probe (refused connection, new generation). 0: the
            3 unanswered probes alone (see :mod:`kvxfer.engine.liveness`).
        advertise_addr: the side-channel endpoint peers should dial (default: the bound
            one); set it when binding a wildcard such as ``tcp://0.0.0.0:5601``.
        backend_params: extra NIXL UCX backend parameters (UCX also reads ``UCX_*``
            environment variables).
        lease_margin_s: safety margin around a lease's end: a consumer does not post a
            READ within it before the end, a producer frees only this long after it.
        max_run_blocks: longest run of blocks (contiguous on both sides) moved by one
            descriptor (run rows, strided lists only; 1 disables coalescing).
        auth_key: deployment key (>= 16 bytes) authenticating the side channel and
            notifications (HMAC-SHA256, :mod:`kvxfer.wire.auth`); None: unauthenticated
            (loopback only). ``kvxfer.wire.auth.load_auth_key()`` reads ``KVXFER_AUTH_KEY``.
        hold_slots: size of a producer rank's hold table (32 bytes a slot, registered
            DRAM that readers check after their READ, see :mod:`kvxfer.engine.holds`):
            at most this many requests held at once.
        push_contact: a consumer that will push: at first contact it asks each producer
            to contact it back at once, so the first push does not pay the producer's
            contact (fetching this engine's records) on its path.
        max_contacts: first contacts a consumer runs at once (one thread each); more new
            producers wait in a bounded queue (:mod:`kvxfer.engine.contact`), so a flood
            of requests naming unknown addresses costs bounded threads and sockets.
    """

    engine_id: str
    side_channel_addr: str = "tcp://127.0.0.1:0"
    model_name: str = "model"
    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    progress_delay_us: int = 1000
    deadline_s: float = 30.0
    lease_s: float = 60.0
    handshake_timeout_s: float = 5.0
    strided: bool = True
    heartbeat_s: float = 1.0
    silence_s: float = 10.0
    advertise_addr: str | None = None
    backend_params: tuple[tuple[str, str], ...] = ()
    lease_margin_s: float = 0.5
    max_run_blocks: int = 1  # measured: NIXL 1.5 merges dense consecutive indices itself
    auth_key: bytes | None = field(default=None, repr=False)  # a secret: never in repr or logs
    hold_slots: int = 1 << 16
    push_contact: bool = False
    max_contacts: int = 16

    def check(self) -> None:
        """Raise ConfigError naming the first setting that is not a valid number."""
        check_deadline("deadline_s", self.deadline_s)
        check_lease("lease_s", self.lease_s)
        for name in ("handshake_timeout_s", "heartbeat_s"):
            check_seconds(name, getattr(self, name))
        check_seconds("lease_margin_s", self.lease_margin_s, allow_zero=True)
        check_seconds("silence_s", self.silence_s, allow_zero=True)
        check_hold_slots("hold_slots", self.hold_slots)
        m = self.max_contacts
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"max_contacts must be an int >= 1, got {m!r}")

    @property
    def run_blocks(self) -> int:
        """Run rows in use: only with strided lists (dense lists would grow per level)."""
        return self.max_run_blocks if self.strided else 1

    def facts(self, spec: LayoutSpec) -> ModelFacts:
        """The model facts of this engine over ``spec``: what its compat hash covers."""
        return model_facts(spec, model_name=self.model_name, dtype=self.dtype,
                           kv_dtype=self.kv_dtype)  # fmt: skip

    def compat_hash(self, spec: LayoutSpec) -> str:
        return compat_hash(self.facts(spec))


def allocate_cache(spec: LayoutSpec) -> list[U8]:
    """Allocate zeroed, page-aligned DRAM regions for ``spec`` (one uint8 array per region)."""
    out = []
    for n in spec.region_bytes():
        raw = np.zeros(n + 4096, dtype=np.uint8)
        start = (-raw.ctypes.data) % 4096
        out.append(raw[start : start + n])
    return out
