"""NIXL's Python bindings, imported once and guarded, and the translation of what they
raise and return into kvxfer's terms: the only module in kvxfer that imports
``nixl_cu12``. :class:`~kvxfer.transport.nixl.NixlBackend` is built on it.

Without NIXL, planning and the CLI still work; :func:`require` raises
BackendUnavailableError with the exact install line.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator, Mapping
from typing import Any

from kvxfer.errors import BackendUnavailableError, KvxferError, PeerLostError, TransferError
from kvxfer.transport.backend import MemKind, XferState

__all__ = [
    "NIXL_ERRORS",
    "NIXL_INSTALL_LINE",
    "bindings",
    "is_available",
    "new_agent",
    "peek_agent_name",
    "require",
    "segment",
    "translate",
    "xfer_state",
]

# Imported once, guarded: without NIXL, planning and the CLI still work and building a
# backend raises BackendUnavailableError with the install line.
_import_error: ImportError | None = None
try:
    import nixl_cu12._bindings as bindings
except ImportError as _exc:
    bindings, _import_error = None, _exc

NIXL_INSTALL_LINE = "pip install --no-deps nixl-cu12"
_WHY_NO_DEPS = (
    "--no-deps because the nixl-cu12 wheel declares torch, which it never imports, and a "
    "bare torch requirement pulls a multi-GB CUDA build"
)

_MD_HEADER = b"nixlSerDes|Agent"  # metadata blob: header, u64 LE name length, name
NIXL_ERRORS: tuple[type[Exception], ...] = (
    *(
        cls
        for name, cls in (vars(bindings).items() if bindings is not None else ())
        if name.startswith("nixl") and isinstance(cls, type) and issubclass(cls, Exception)
    ),
    RuntimeError,  # pybind11's translation of an unmapped C++ exception
)
_DEFAULT_MAP: dict[str, type[KvxferError]] = {"nixlRemoteDisconnectError": PeerLostError}


def is_available() -> bool:
    """True if ``nixl_cu12`` imported, i.e. :class:`NixlBackend` can be built."""
    return bindings is not None


def require() -> None:
    """Raise BackendUnavailableError, with the exact install line, if NIXL did not import."""
    if bindings is None:
        raise BackendUnavailableError(
            f"NIXL is not installed (import nixl_cu12 failed: {_import_error}). Producers, "
            f"consumers and NixlBackend need it: {NIXL_INSTALL_LINE}  ({_WHY_NO_DEPS}). "
            "Planning and `kvxfer plan` work without it; kvxfer.testing.MemoryBackend runs "
            "transfers in one process without it."
        ) from _import_error


@contextlib.contextmanager
def translate(action: str, peer: str | None = None, **special: type[KvxferError]) -> Iterator[None]:
    """Re-raise NIXL failures in the block as kvxfer errors, the original in ``__cause__``.

    ``special`` maps a NIXL exception class name to the kvxfer class to raise; otherwise
    a remote disconnect is PeerLostError and anything else TransferError. ``peer`` (an
    agent name) goes into the message.
    """
    try:
        yield
    except NIXL_ERRORS as exc:
        kind = type(exc).__name__
        cls = special.get(kind) or _DEFAULT_MAP.get(kind, TransferError)
        where = f" (agent {peer!r})" if peer else ""
        raise cls(f"{action}{where} failed: {kind}: {exc}") from exc


def xfer_state(status: Any, action: str, peer: str | None) -> XferState:
    """Map a ``nixl_status_t`` from post/poll to a state; any error status raises."""
    if status == bindings.NIXL_SUCCESS:
        return XferState.DONE
    if status == bindings.NIXL_IN_PROG:
        return XferState.IN_PROGRESS
    name = getattr(status, "name", str(status))
    cls = PeerLostError if "DISCONNECT" in name else TransferError
    raise cls(f"{action} (agent {peer!r}) returned {name}")


def segment(kind: MemKind) -> Any:
    """NIXL's segment type for a memory kind."""
    return bindings.VRAM_SEG if kind is MemKind.VRAM else bindings.DRAM_SEG


def peek_agent_name(blob: bytes) -> str | None:
    """The agent name in a NIXL metadata blob's header, or None if it does not parse."""
    if not blob.startswith(_MD_HEADER) or len(blob) < len(_MD_HEADER) + 8:
        return None
    (size,) = struct.unpack_from("<Q", blob, len(_MD_HEADER))
    start = len(_MD_HEADER) + 8
    if size > 4096 or start + size > len(blob):
        return None
    try:
        return blob[start : start + size].decode()
    except UnicodeDecodeError:
        return None


def new_agent(
    name: str,
    progress_thread: bool,
    progress_delay_us: int,
    num_threads: int,
    backend_params: Mapping[str, str] | None,
    thread_safe: bool,
) -> tuple[Any, frozenset[MemKind]]:
    """A NIXL agent with its UCX backend (no listener thread, no telemetry), and the memory
    kinds that backend moves. Arguments as :class:`~kvxfer.transport.nixl.NixlBackend`'s."""
    sync = bindings.NIXL_THREAD_SYNC_STRICT if thread_safe else bindings.NIXL_THREAD_SYNC_NONE
    cfg = bindings.nixlAgentConfig()
    cfg.useProgThread = progress_thread
    cfg.useListenThread = False
    cfg.pthrDelay = progress_delay_us
    cfg.syncMode = sync
    cfg.captureTelemetry = False
    init = {"num_threads": str(num_threads)} if num_threads else {}
    init.update(backend_params or {})
    with translate(f"creating agent {name!r}"):
        agent = bindings.nixlAgent(name, cfg)
        if "UCX" not in agent.getAvailPlugins():
            raise TransferError("the NIXL UCX plugin is not available")
        backend = agent.createBackend("UCX", init)
        _params, mems = agent.getBackendParams(backend)
    return agent, frozenset(k for k in MemKind if f"{k.value}_SEG" in set(mems))
