"""NixlBackend with two real NIXL agents in one process (UCX over loopback, DRAM)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("nixl_cu12")

from kvxfer.errors import ConfigError, LayoutError, PeerLostError, ProtocolError, TransferError
from kvxfer.transport.nixl import (
    NixlBackend,
    PreparedList,
    XferHandle,
    XferOp,
    XferState,
)
from kvxfer.transport.nixl_binding import peek_agent_name as _peek_agent_name

BLOCK = 4096
NUM_BLOCKS = 64
_names = itertools.count()


def _name(role: str) -> str:
    return f"{role}-{next(_names)}"


def _rows(buf: np.ndarray, length: int, stride: int, count: int, offset: int = 0) -> np.ndarray:
    """One strided row over ``buf``: ``(1, 5) uint64``."""
    return np.array([[buf.ctypes.data + offset, length, 0, stride, count]], dtype=np.uint64)


def _wait(backend: NixlBackend, xfer: XferHandle, timeout_s: float = 5.0) -> None:
    state = backend.post(xfer)
    deadline = time.monotonic() + timeout_s
    while state is XferState.IN_PROGRESS:
        assert time.monotonic() < deadline, "transfer did not complete"
        state = backend.poll(xfer)


def _notifs(backend: NixlBackend, peer: str, n: int, timeout_s: float = 5.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += backend.get_notifs().get(peer, [])
        time.sleep(0.001)
    return got


@dataclass
class Pair:
    """An initiator (no progress thread, polls) and a target (progress thread on)."""

    init: NixlBackend
    tgt: NixlBackend
    local: np.ndarray  # initiator's buffer
    remote: np.ndarray  # target's buffer

    def prepare_both(self) -> tuple[PreparedList, PreparedList]:
        local = self.init.prepare(_rows(self.local, BLOCK, BLOCK, NUM_BLOCKS))
        remote = self.init.prepare(_rows(self.remote, BLOCK, BLOCK, NUM_BLOCKS), self.tgt.name)
        return local, remote


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    rng = np.random.default_rng(7)
    local = np.zeros(BLOCK * NUM_BLOCKS, dtype=np.uint8)
    remote = rng.integers(0, 256, BLOCK * NUM_BLOCKS, dtype=np.uint8)
    with (
        NixlBackend(_name("init"), progress_thread=False) as init,
        NixlBackend(_name("tgt")) as tgt,
    ):
        init.register([(local.ctypes.data, local.nbytes, 0)])
        tgt.register([(remote.ctypes.data, remote.nbytes, 0)])
        assert init.add_remote(tgt.metadata()) == tgt.name
        assert tgt.add_remote(init.metadata()) == init.name
        yield Pair(init, tgt, local, remote)


def _bad_rows(buf: np.ndarray) -> dict[str, object]:
    good = np.repeat(_rows(buf, BLOCK, BLOCK, 2), 2, axis=0)  # (2, 5)
    zero_count = good.copy()
    zero_count[1, 4] = 0
    return {
        "Nx2": good[:, :2].copy(),
        "Nx4": good[:, :4].copy(),
        "1-D": good[0].copy(),
        "float64": good.astype(np.float64),
        "int64": good.astype(np.int64),
        "empty": np.empty((0, 5), dtype=np.uint64),
        "fortran": np.asfortranarray(good),
        "zero count": zero_count,
        "list": good.tolist(),
    }


@pytest.mark.parametrize(
    "case", ["Nx2", "Nx4", "1-D", "float64", "int64", "empty", "fortran", "zero count", "list"]
)
def test_prepare_rejects_malformed_rows(pair: Pair, case: str) -> None:
    with pytest.raises(LayoutError):
        pair.init.prepare(_bad_rows(pair.local)[case])  # type: ignore[arg-type]


def test_prepare_unknown_agent(pair: Pair) -> None:
    with pytest.raises(TransferError, match="nobody"):
        pair.init.prepare(_rows(pair.remote, BLOCK, BLOCK, 1), "nobody")


def test_prepare_outside_registered_memory_names_agent(pair: Pair) -> None:
    rows = _rows(pair.remote, BLOCK, BLOCK, 2, offset=pair.remote.nbytes)  # just past the end
    with pytest.raises(TransferError, match=pair.tgt.name) as info:
        pair.init.prepare(rows, pair.tgt.name)
    assert not isinstance(info.value, PeerLostError)
    assert type(info.value.__cause__).__name__ == "nixlNotFoundError"


@pytest.mark.parametrize("blob", [b"", b"garbage" * 20, b"nixlSerDes|Agent\xff\xff"])
def test_garbage_metadata_is_protocol_error(pair: Pair, blob: bytes) -> None:
    with pytest.raises(ProtocolError):
        pair.init.add_remote(blob)


def test_peek_agent_name(pair: Pair) -> None:
    assert _peek_agent_name(pair.tgt.metadata()) == pair.tgt.name
    assert _peek_agent_name(b"junk") is None


@pytest.mark.parametrize(
    ("local_ids", "remote_ids", "match"),
    [
        (np.array([0, NUM_BLOCKS]), np.array([0, 1]), "local_ids spans"),
        (np.array([0, 1]), np.array([-1, 1]), "remote_ids spans"),
        (np.array([0, 1]), np.array([0]), "ids"),
        (np.array([], dtype=np.int64), np.array([], dtype=np.int64), "empty"),
        (np.array([0.0, 1.0]), np.array([0, 1]), "integer dtype"),
        (np.array([[0, 1]]), np.array([0, 1]), "1-D"),
        ([0, 1], np.array([0, 1]), "1-D"),
    ],
)
def test_make_xfer_rejects_bad_ids(
    pair: Pair, local_ids: np.ndarray, remote_ids: np.ndarray, match: str
) -> None:
    local, remote = pair.prepare_both()
    with pytest.raises(LayoutError, match=match):
        pair.init.make_xfer(XferOp.READ, local, local_ids, remote, remote_ids)
    with pytest.raises(LayoutError, match="local list first"):
        pair.init.make_xfer(XferOp.READ, remote, np.arange(2), local, np.arange(2))
    local.release()
    remote.release()


@pytest.mark.parametrize("strided", [True, False])
def test_read_strided_remote_into_dense_local(pair: Pair, strided: bool) -> None:
    """Remote: two Nx5 views (first / second half of each block); local: dense Nx3 halves."""
    half = BLOCK // 2
    base = pair.remote.ctypes.data
    remote_rows = np.array(
        [[base, half, 0, BLOCK, NUM_BLOCKS], [base + half, half, 0, BLOCK, NUM_BLOCKS]],
        dtype=np.uint64,
    )  # (2, 5): view-major, flat index = view * NUM_BLOCKS + block
    local_addrs = pair.local.ctypes.data + np.arange(2 * NUM_BLOCKS, dtype=np.uint64) * half
    local_rows = np.stack(
        [local_addrs, np.full_like(local_addrs, half), np.zeros_like(local_addrs)], axis=1
    )  # (2 * NUM_BLOCKS, 3): consecutive halves
    remote = pair.init.prepare(remote_rows, pair.tgt.name, strided=strided)
    local = pair.init.prepare(local_rows)
    assert (remote.num_descriptors, remote.is_strided) == (2 * NUM_BLOCKS, strided)
    assert (local.num_descriptors, local.is_strided) == (2 * NUM_BLOCKS, False)

    rng = np.random.default_rng(1)
    remote_ids = rng.choice(2 * NUM_BLOCKS, size=40, replace=False)
    local_ids = rng.choice(2 * NUM_BLOCKS, size=40, replace=False).astype(np.uint32)
    pair.local[:] = 0
    xfer = pair.init.make_xfer(XferOp.READ, local, local_ids, remote, remote_ids)
    _wait(pair.init, xfer)

    expected = np.zeros_like(pair.local)
    for lid, rid in zip(local_ids.tolist(), remote_ids.tolist(), strict=True):  # reference loop
        view, block = divmod(rid, NUM_BLOCKS)
        src = block * BLOCK + view * half
        expected[lid * half : (lid + 1) * half] = pair.remote[src : src + half]
    np.testing.assert_array_equal(pair.local, expected)
    xfer.release()
    xfer.release()  # idempotent
    with pytest.raises(ConfigError, match="released"):
        pair.init.poll(xfer)
    local.release()
    remote.release()
    with pytest.raises(ConfigError, match="released"):
        pair.init.make_xfer(XferOp.READ, local, np.arange(1), remote, np.arange(1))


class _NoStridedAgent:
    """Proxy for a NIXL agent without the (N, 5) prepXferDlist overload (NIXL < 1.5)."""

    def __init__(self, agent: object) -> None:
        self._agent = agent

    def prepXferDlist(self, *args: object) -> object:
        if len(args) == 4:
            raise TypeError("prepXferDlist(): incompatible function arguments")
        return self._agent.prepXferDlist(*args)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._agent, name)


def test_falls_back_to_dense_without_strided_support(pair: Pair) -> None:
    real = pair.init._agent
    pair.init._agent = _NoStridedAgent(real)
    try:
        remote = pair.init.prepare(_rows(pair.remote, BLOCK, BLOCK, NUM_BLOCKS), pair.tgt.name)
        local = pair.init.prepare(_rows(pair.local, BLOCK, BLOCK, NUM_BLOCKS))
    finally:
        pair.init._agent = real
        pair.init._strided_ok = True
    assert (remote.is_strided, remote.num_descriptors) == (False, NUM_BLOCKS)
    ids = np.arange(NUM_BLOCKS)
    pair.local[:] = 0
    _wait(pair.init, pair.init.make_xfer(XferOp.READ, local, ids, remote, ids[::-1].copy()))
    expected = pair.remote.reshape(NUM_BLOCKS, BLOCK)[::-1].ravel()
    np.testing.assert_array_equal(pair.local, expected)
    local.release()
    remote.release()


def test_write_with_notification(pair: Pair) -> None:
    local, remote = pair.prepare_both()
    pair.local[:] = np.arange(pair.local.size, dtype=np.uint64).astype(np.uint8)
    ids = np.arange(NUM_BLOCKS // 2, NUM_BLOCKS)
    xfer = pair.init.make_xfer(XferOp.WRITE, local, ids, remote, ids[::-1].copy(), b"req-42")
    _wait(pair.init, xfer)
    assert _notifs(pair.tgt, pair.init.name, 1) == [b"req-42"]
    for lid, rid in zip(ids.tolist(), ids[::-1].tolist(), strict=True):
        np.testing.assert_array_equal(
            pair.remote[rid * BLOCK : (rid + 1) * BLOCK],
            pair.local[lid * BLOCK : (lid + 1) * BLOCK],
        )
    pair.init.release(xfer)
    local.release()
    remote.release()


def test_loopback_read(pair: Pair) -> None:
    """A list prepared for this agent's own name is a loopback target."""
    half = pair.local.size // 2
    pair.local[:half] = 9
    pair.local[half:] = 0
    src = pair.init.prepare(_rows(pair.local, BLOCK, BLOCK, half // BLOCK), pair.init.name)
    dst = pair.init.prepare(_rows(pair.local, BLOCK, BLOCK, half // BLOCK, offset=half))
    ids = np.arange(half // BLOCK)
    _wait(pair.init, pair.init.make_xfer(XferOp.READ, dst, ids, src, ids))
    assert (pair.local[half:] == 9).all()
    src.release()
    dst.release()


def test_standalone_notifications_keep_order(pair: Pair) -> None:
    msgs = [b"a", b"\x00\xff binary", b"c" * 1000]
    for msg in msgs:
        pair.init.send_notif(pair.tgt.name, msg)
    assert _notifs(pair.tgt, pair.init.name, len(msgs)) == msgs
    with pytest.raises(TransferError):
        pair.init.send_notif("nobody", b"x")


def test_release_in_progress_and_restarted_peer() -> None:
    """A target without progress leaves a READ in progress; releasing it cancels it.

    Then the target 'restarts' under the same name: add_remote replaces it, the old
    prepared list is stale (PeerLostError) and a new READ sees the new incarnation.
    """
    local = np.zeros(BLOCK * NUM_BLOCKS, dtype=np.uint8)
    old = np.full(BLOCK * NUM_BLOCKS, 1, dtype=np.uint8)
    new = np.full(BLOCK * NUM_BLOCKS, 2, dtype=np.uint8)
    tgt_name = _name("restart")
    with NixlBackend(_name("init"), progress_thread=False) as init:
        init.register([(local.ctypes.data, local.nbytes, 0)])
        lrows = _rows(local, BLOCK, BLOCK, NUM_BLOCKS)
        lp = init.prepare(lrows)
        ids = np.arange(NUM_BLOCKS)
        with NixlBackend(tgt_name, progress_thread=False) as tgt:
            tgt.register([(old.ctypes.data, old.nbytes, 0)])
            init.add_remote(tgt.metadata())
            rp = init.prepare(_rows(old, BLOCK, BLOCK, NUM_BLOCKS), tgt_name)
            xfer = init.make_xfer(XferOp.READ, lp, ids, rp, ids, b"n")
            assert init.post(xfer) is XferState.IN_PROGRESS
            assert init.poll(xfer) is XferState.IN_PROGRESS
            xfer.release()  # NIXL cancels the request: no crash, no error
            with pytest.raises(ConfigError):
                init.poll(xfer)
        with NixlBackend(tgt_name) as tgt2:
            tgt2.register([(new.ctypes.data, new.nbytes, 0)])
            assert init.add_remote(tgt2.metadata()) == tgt_name
            with pytest.raises(PeerLostError):
                init.make_xfer(XferOp.READ, lp, ids, rp, ids)
            rp2 = init.prepare(_rows(new, BLOCK, BLOCK, NUM_BLOCKS), tgt_name)
            _wait(init, init.make_xfer(XferOp.READ, lp, ids, rp2, ids))
            np.testing.assert_array_equal(local, new)


def test_close_is_idempotent_and_final() -> None:
    buf = np.zeros(BLOCK, dtype=np.uint8)
    backend = NixlBackend(_name("closing"), progress_thread=False)
    backend.register([(buf.ctypes.data, buf.nbytes, 0)])
    plist = backend.prepare(_rows(buf, BLOCK, BLOCK, 1))
    backend.close()
    backend.close()
    assert plist.is_released
    with pytest.raises(TransferError, match="closed"):
        backend.metadata()


def test_register_rejects_bad_regions() -> None:
    with NixlBackend(_name("reg"), progress_thread=False) as backend:
        for regions in ([], [(0, 10, 0)], [(4096, 0, 0)], [(4096, 10, -1)]):
            with pytest.raises(LayoutError):
                backend.register(regions)


def test_idle_progress_thread_is_cheap() -> None:
    """With the default 1 ms delay an idle agent's progress thread stays far below a core."""
    with NixlBackend(_name("idle")):
        time.sleep(0.1)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        time.sleep(0.5)
        share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    assert share < 0.3, f"idle agent used {share:.0%} of a core"


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="progress_delay_us"):
        NixlBackend(_name("bad"), progress_delay_us=-1)
    assert not issubclass(ConfigError, LayoutError)
