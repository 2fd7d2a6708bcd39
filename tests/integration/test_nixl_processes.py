"""Real NIXL between two processes: scattered strided READs, then a SIGKILLed peer.

The child is a 'spawn' process; metadata goes over a multiprocessing Pipe (stand-in for
the side channel). UCX moves the bytes (CMA on one host).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl_cu12")

from kvxfer.errors import PeerLostError
from kvxfer.transport.nixl import NixlBackend, PreparedList, XferOp, XferState

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

BLOCK = 16 << 10  # bytes per K (or V) block
NUM_BLOCKS = 128
NUM_LAYERS = 2
REGION_BYTES = NUM_BLOCKS * 2 * BLOCK  # blocks-first [NB, 2, BLOCK] per layer
CHILD = "kvxfer-child"


def _pattern(layer: int) -> np.ndarray:
    """Deterministic bytes of one child region; both processes compute it."""
    return np.random.default_rng(1000 + layer).integers(0, 256, REGION_BYTES, dtype=np.uint8)


def _child(conn: Connection) -> None:
    """Register patterned regions, send metadata + addresses, then serve until told to exit."""
    regions = [_pattern(layer) for layer in range(NUM_LAYERS)]
    with NixlBackend(CHILD, progress_delay_us=1000) as backend:
        backend.register([(r.ctypes.data, r.nbytes, 0) for r in regions])
        conn.send_bytes(backend.metadata())
        conn.send([r.ctypes.data for r in regions])
        backend.add_remote(conn.recv_bytes())
        while not conn.poll(0.02):  # the progress thread serves READs meanwhile
            for msgs in backend.get_notifs().values():
                for msg in msgs:
                    conn.send_bytes(msg)  # echo notifications to the parent
        conn.recv()


@dataclass
class Peer:
    proc: Any  # mp.context.SpawnProcess
    conn: Connection
    backend: NixlBackend
    local: np.ndarray  # (NUM_LAYERS, NUM_BLOCKS, BLOCK) uint8
    local_list: PreparedList
    remote_list: PreparedList


def _remote_rows(addrs: list[int]) -> np.ndarray:
    """(2 * NUM_LAYERS, 5) uint64: per layer a K view and a V view, stride 2 * BLOCK."""
    base = np.asarray(addrs, dtype=np.uint64)[:, None] + np.array([0, BLOCK], np.uint64)  # (L, 2)
    rows = np.zeros((NUM_LAYERS * 2, 5), dtype=np.uint64)
    rows[:, 0] = base.ravel()  # order: layer0.K, layer0.V, layer1.K, ...
    rows[:, 1:] = (BLOCK, 0, 2 * BLOCK, NUM_BLOCKS)
    return rows


@pytest.fixture
def peer() -> Iterator[Peer]:
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child_conn,), daemon=True)
    proc.start()
    # local: (L, NB, BLOCK) holds only K halves; two local views per layer (K, V) over it
    local = np.zeros((NUM_LAYERS, NUM_BLOCKS, BLOCK), dtype=np.uint8)
    backend = NixlBackend("kvxfer-parent", progress_thread=False)
    try:
        backend.register([(local.ctypes.data, local.nbytes, 0)])
        assert parent_conn.poll(30), "child did not start"
        assert backend.add_remote(parent_conn.recv_bytes()) == CHILD
        addrs = parent_conn.recv()
        parent_conn.send_bytes(backend.metadata())
        # local flat index = (layer * 2 + kv) * NUM_BLOCKS/2 + slot, over NB/2 slots per view
        half = NUM_BLOCKS // 2
        lbase = local.ctypes.data + np.arange(NUM_LAYERS * 2, dtype=np.uint64) * half * BLOCK
        lrows = np.stack(
            [lbase, *(np.full_like(lbase, v) for v in (BLOCK, 0, BLOCK, half))], axis=1
        )  # (2L, 5) dense views
        yield Peer(
            proc,
            parent_conn,
            backend,
            local,
            backend.prepare(lrows),
            backend.prepare(_remote_rows(addrs), CHILD),
        )
    finally:
        backend.close()
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def _run(
    peer: Peer,
    local_ids: np.ndarray,
    remote_ids: np.ndarray,
    notif: bytes = b"",
    timeout_s: float = 5,
) -> None:
    """One READ: make, post, poll until done (bounded), release."""
    xfer = peer.backend.make_xfer(
        XferOp.READ, peer.local_list, local_ids, peer.remote_list, remote_ids, notif
    )
    state = peer.backend.post(xfer)
    deadline = time.monotonic() + timeout_s
    while state is XferState.IN_PROGRESS:
        assert time.monotonic() < deadline, "READ did not complete"
        state = peer.backend.poll(xfer)
    xfer.release()


def test_scattered_strided_read_verifies_every_byte(peer: Peer) -> None:
    rng = np.random.default_rng(3)
    half = NUM_BLOCKS // 2
    blocks = rng.choice(NUM_BLOCKS, size=half, replace=False)  # scattered remote blocks
    slots = rng.permutation(half)  # where each lands locally
    views = np.arange(NUM_LAYERS * 2)  # K, V per layer; same view order on both sides
    # (2L, half) ids, view-major: flat = view * count + block
    remote_ids = (views[:, None] * NUM_BLOCKS + blocks[None, :]).ravel()
    local_ids = (views[:, None] * half + slots[None, :]).ravel()
    _run(peer, local_ids, remote_ids, b"scatter-done")

    local = peer.local.reshape(NUM_LAYERS * 2, half, BLOCK)  # (view, slot, bytes)
    for layer in range(NUM_LAYERS):
        src = _pattern(layer).reshape(NUM_BLOCKS, 2, BLOCK)  # (block, kv, bytes)
        for kv in range(2):
            np.testing.assert_array_equal(local[layer * 2 + kv, slots], src[blocks, kv])
    assert peer.conn.poll(5), "notification did not reach the child"
    assert peer.conn.recv_bytes() == b"scatter-done"


def test_killed_peer_raises_peer_lost_quickly(peer: Peer) -> None:
    ids = np.arange(8)
    _run(peer, ids, ids)  # the connection is up and works
    peer.proc.kill()
    peer.proc.join(5)
    killed = time.monotonic()
    with pytest.raises(PeerLostError):
        while (left := 5 - (time.monotonic() - killed)) > 0:  # each try: a fresh READ
            _run(peer, ids, ids, timeout_s=left)
    assert time.monotonic() - killed < 5
