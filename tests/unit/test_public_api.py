"""The curated public API: every name in ``kvxfer.__all__`` resolves, and planning alone
does not import NIXL or ZMQ."""

from __future__ import annotations

import subprocess
import sys

import kvxfer


def test_all_names_resolve() -> None:
    for name in kvxfer.__all__:
        assert getattr(kvxfer, name) is not None, name
    assert sorted(kvxfer.__all__) == sorted(set(kvxfer.__all__))


def test_error_tree() -> None:
    assert issubclass(kvxfer.LayoutError, ValueError)
    assert issubclass(kvxfer.IncompatibleError, kvxfer.LayoutError)
    assert issubclass(kvxfer.ProtocolError, ValueError)
    assert issubclass(kvxfer.PeerLostError, kvxfer.TransferError)
    assert issubclass(kvxfer.DeadlineError, TimeoutError)
    for e in (kvxfer.LayoutError, kvxfer.ProtocolError, kvxfer.TransferError, kvxfer.DeadlineError):
        assert issubclass(e, kvxfer.KvxferError)


def test_planning_imports_no_io() -> None:
    code = (
        "import sys, kvxfer\n"
        "kvxfer.pair_layouts, kvxfer.plan_request, kvxfer.spec_for\n"
        "print(sorted(m for m in ('zmq', 'nixl_cu12', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_one_root_for_bad_input() -> None:
    assert issubclass(kvxfer.InputError, ValueError)
    assert issubclass(kvxfer.InputError, kvxfer.KvxferError)
    for e in (kvxfer.LayoutError, kvxfer.IncompatibleError, kvxfer.ConfigError):
        assert issubclass(e, kvxfer.InputError), e
    assert not issubclass(kvxfer.ConfigError, kvxfer.LayoutError)
    assert issubclass(kvxfer.BackendUnavailableError, ImportError)
    assert not issubclass(kvxfer.BackendUnavailableError, kvxfer.InputError)


def test_testing_exports_the_memory_backend() -> None:
    import kvxfer.testing
    from kvxfer.transport.backend import TransferBackend

    assert sorted(kvxfer.testing.__all__) == ["MemoryBackend", "fill", "mismatches"]
    with kvxfer.testing.MemoryBackend("api-check") as backend:
        assert isinstance(backend, TransferBackend)
