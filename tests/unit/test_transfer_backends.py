"""The TransferBackend contract, run through both backends: the same READ/WRITE with a
notification moves the same bytes over real NIXL (loopback UCX) and in memory; the
in-memory backend raises the same error classes as NixlBackend."""

from __future__ import annotations

import importlib.util
import itertools
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvxfer.errors import ConfigError, LayoutError, PeerLostError, ProtocolError, TransferError
from kvxfer.testing import MemoryBackend
from kvxfer.transport.backend import MemKind, TransferBackend, XferOp, XferState

HAS_NIXL = importlib.util.find_spec("nixl_cu12") is not None
BLOCK, NUM_BLOCKS = 256, 16
_names = itertools.count()
Factory = Callable[..., TransferBackend]  # type: ignore[type-arg]


def _factory(kind: str) -> Factory:
    if kind == "memory":
        return MemoryBackend
    from kvxfer.transport.nixl import NixlBackend

    return NixlBackend


def _row(buf: np.ndarray, length: int, stride: int, count: int, offset: int = 0) -> np.ndarray:
    """One strided row over ``buf``: ``(1, 5) uint64``."""
    return np.array([[buf.ctypes.data + offset, length, 0, stride, count]], dtype=np.uint64)


def _finish(b: TransferBackend, x: object) -> None:  # type: ignore[type-arg]
    state = b.post(x)
    deadline = time.monotonic() + 5
    while state is XferState.IN_PROGRESS:
        assert time.monotonic() < deadline
        state = b.poll(x)


def _notifs(b: TransferBackend, peer: str, n: int) -> list[bytes]:  # type: ignore[type-arg]
    got: list[bytes] = []
    deadline = time.monotonic() + 5
    while len(got) < n and time.monotonic() < deadline:
        got += b.get_notifs().get(peer, [])
        time.sleep(0.001)
    return got


def _scenario(kind: str) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    """READ half-blocks remote -> local in a permuted order, then WRITE some back."""
    make = _factory(kind)
    rng = np.random.default_rng(3)
    local = np.zeros(BLOCK * NUM_BLOCKS, dtype=np.uint8)
    remote = rng.integers(0, 256, BLOCK * NUM_BLOCKS, dtype=np.uint8)
    extra = {} if kind == "memory" else {"progress_thread": False}
    with (
        make(f"{kind}-init-{next(_names)}", **extra) as init,
        make(f"{kind}-tgt-{next(_names)}") as tgt,
    ):
        assert isinstance(init, TransferBackend)
        init.register([(local.ctypes.data, local.nbytes, 0)])
        tgt.register([(remote.ctypes.data, remote.nbytes, 0)])
        assert init.add_remote(tgt.metadata()) == tgt.name
        assert tgt.add_remote(init.metadata()) == init.name
        half = BLOCK // 2
        # two views (first and second half of each block): flat index = view * 16 + block
        two = np.concatenate(
            [_row(local, half, BLOCK, NUM_BLOCKS), _row(local, half, BLOCK, NUM_BLOCKS, half)]
        )
        lp = init.prepare(two)
        rp = init.prepare(
            np.concatenate(
                [_row(remote, half, BLOCK, NUM_BLOCKS), _row(remote, half, BLOCK, NUM_BLOCKS, half)]
            ),
            tgt.name,
        )
        lids = np.array([0, 1, 2, 20, 31], dtype=np.int64)
        rids = np.array([31, 5, 16, 3, 0], dtype=np.int64)
        x = init.make_xfer(XferOp.READ, lp, lids, rp, rids, b"read-1")
        _finish(init, x)
        init.release(x)
        init.release(x)  # idempotent
        with pytest.raises(ConfigError, match="released"):
            init.poll(x)
        local[BLOCK * 10 : BLOCK * 11] = 7
        w = init.make_xfer(XferOp.WRITE, lp, np.array([10, 26]), rp, np.array([12, 28]), b"wrote")
        _finish(init, w)
        init.send_notif(tgt.name, b"bye")
        got = _notifs(tgt, init.name, 3)
        return local.copy(), remote.copy(), got


def _expected() -> tuple[np.ndarray, np.ndarray]:
    """The same scenario by a reference loop over plain slices."""
    rng = np.random.default_rng(3)
    local = np.zeros(BLOCK * NUM_BLOCKS, dtype=np.uint8)
    remote = rng.integers(0, 256, BLOCK * NUM_BLOCKS, dtype=np.uint8)
    half = BLOCK // 2

    def span(i: int) -> slice:
        view, block = divmod(i, NUM_BLOCKS)
        return slice(block * BLOCK + view * half, block * BLOCK + view * half + half)

    for lid, rid in zip([0, 1, 2, 20, 31], [31, 5, 16, 3, 0], strict=True):
        local[span(lid)] = remote[span(rid)]
    local[BLOCK * 10 : BLOCK * 11] = 7
    for lid, rid in zip([10, 26], [12, 28], strict=True):
        remote[span(rid)] = local[span(lid)]
    return local, remote


@pytest.mark.parametrize(
    "kind",
    ["memory", pytest.param("nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason="no NIXL"))],
)
def test_same_transfer_same_bytes(kind: str) -> None:
    local, remote, notifs = _scenario(kind)
    want_local, want_remote = _expected()
    np.testing.assert_array_equal(local, want_local)
    np.testing.assert_array_equal(remote, want_remote)
    assert notifs == [b"read-1", b"wrote", b"bye"]


@pytest.mark.skipif(not HAS_NIXL, reason="no NIXL")
def test_backends_agree_byte_for_byte() -> None:
    mem, nixl = _scenario("memory"), _scenario("nixl")
    np.testing.assert_array_equal(mem[0], nixl[0])
    np.testing.assert_array_equal(mem[1], nixl[1])
    assert mem[2] == nixl[2]


@pytest.fixture
def mem_pair() -> Iterator[tuple[MemoryBackend, MemoryBackend, np.ndarray, np.ndarray]]:
    a_buf, b_buf = np.zeros(4096, np.uint8), np.arange(4096, dtype=np.uint64).astype(np.uint8)
    with MemoryBackend(f"a-{next(_names)}") as a, MemoryBackend(f"b-{next(_names)}") as b:
        a.register([(a_buf.ctypes.data, a_buf.nbytes, 0)])
        b.register([(b_buf.ctypes.data, b_buf.nbytes, 0)])
        a.add_remote(b.metadata())
        yield a, b, a_buf, b_buf


def test_memory_error_contract(
    mem_pair: tuple[MemoryBackend, MemoryBackend, np.ndarray, np.ndarray],
) -> None:
    a, b, a_buf, b_buf = mem_pair
    with pytest.raises(TransferError, match="outside registered memory"):
        a.prepare(_row(b_buf, 1024, 1024, 5), b.name)  # 5 x 1 KiB > 4 KiB
    with pytest.raises(LayoutError, match="shape"):
        a.prepare(np.zeros((2, 4), np.uint64))
    with pytest.raises(TransferError, match="unknown remote agent"):
        a.prepare(_row(b_buf, 1024, 1024, 4), "nobody")
    with pytest.raises(ProtocolError):
        a.add_remote(b"garbage")
    with pytest.raises(ConfigError, match="already in use"):
        MemoryBackend(a.name)
    lp, rp = a.prepare(_row(a_buf, 1024, 1024, 4)), a.prepare(_row(b_buf, 1024, 1024, 4), b.name)
    with pytest.raises(LayoutError, match="outside the prepared list"):
        a.make_xfer(XferOp.READ, lp, np.array([4]), rp, np.array([0]))
    with pytest.raises(TransferError, match="lengths"):
        short = a.prepare(_row(b_buf, 512, 1024, 4), b.name)
        a.make_xfer(XferOp.READ, lp, np.array([0]), short, np.array([0]))
    x = a.make_xfer(XferOp.READ, lp, np.array([3]), rp, np.array([1]))
    a.remove_remote(b.name)
    with pytest.raises(PeerLostError, match="stale"):
        a.post(x)
    a.add_remote(b.metadata())
    rp = a.prepare(_row(b_buf, 1024, 1024, 4), b.name)
    x = a.make_xfer(XferOp.READ, lp, np.array([3]), rp, np.array([1]))
    b.close()
    with pytest.raises(PeerLostError, match="gone"):
        a.post(x)
    np.testing.assert_array_equal(a_buf, 0)  # nothing moved by the failed posts


def test_memory_kinds_the_memory_backend_refuses() -> None:
    buf = np.zeros(64, np.uint8)
    with MemoryBackend(f"kinds-{next(_names)}") as b:
        assert b.mem_kinds == {MemKind.DRAM}
        with pytest.raises(ConfigError, match="MemoryBackend cannot move VRAM memory"):
            b.register([(buf.ctypes.data, 64, 0)], MemKind.VRAM)
        with pytest.raises(ConfigError, match="mem_kind must be one of DRAM, VRAM, got 'HBM'"):
            b.register([(buf.ctypes.data, 64, 0)], "HBM")  # type: ignore[arg-type]
        b.register([(buf.ctypes.data, 64, 0)], "DRAM")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="VRAM"):
            b.prepare(_row(buf, 16, 16, 4), mem_kind=MemKind.VRAM)
        assert b.prepare(_row(buf, 16, 16, 4)).num_descriptors == 4


@pytest.mark.skipif(not HAS_NIXL, reason="no NIXL")
def test_memory_kinds_nixl_reports_and_refuses() -> None:
    from kvxfer.transport.nixl import NixlBackend

    buf = np.zeros(64, np.uint8)
    with NixlBackend(f"kinds-{next(_names)}", progress_thread=False) as b:
        assert MemKind.DRAM in b.mem_kinds  # VRAM too where UCX was built with CUDA
        with pytest.raises(ConfigError, match="got 'HBM'"):
            b.register([(buf.ctypes.data, 64, 0)], "HBM")  # type: ignore[arg-type]
        b.mem_kinds = frozenset({MemKind.DRAM})  # as a NIXL whose UCX has no CUDA reports
        with pytest.raises(ConfigError, match=r"cannot move VRAM memory \(it moves DRAM\)"):
            b.register([(buf.ctypes.data, 64, 0)], MemKind.VRAM)
        b.register([(buf.ctypes.data, 64, 0)], MemKind.DRAM)
        assert b.prepare(_row(buf, 16, 16, 4), mem_kind=MemKind.DRAM).num_descriptors == 4


def test_regions_default_to_dram() -> None:
    import kvxfer

    assert kvxfer.MemKind is MemKind
    spec = kvxfer.spec_for("tiny-gqa", num_blocks=2)
    layout = spec.build([(i + 1) << 20 for i in range(len(spec.region_bytes()))])
    assert {r.mem_kind for r in layout.regions} == {MemKind.DRAM}
    assert kvxfer.Region(4096, 10, 1, "k", MemKind.VRAM).mem_kind is MemKind.VRAM
