"""``scripts/gpu-check.sh``: NIXL moves GPU memory between two processes, byte-exact.

Cases (source -> destination, the destination process READs): VRAM->VRAM, DRAM->VRAM
and VRAM->DRAM (and DRAM->DRAM, the host baseline). A spawned target process fills its
buffer with a byte pattern and registers it; this process registers its own buffer,
READs the target's in ``chunk``-sized descriptors ``repeat`` times, verifies every byte
and prints the median GB/s. GPU memory comes from the CUDA driver API through ctypes
(``libcuda.so.1``, part of the NVIDIA driver): no torch, no CUDA toolkit. Where there is
no driver or no GPU, a case that needs VRAM is reported as not run (exit 0).

Engine cases (``engine:vram->vram``, ``engine:dram->dram``): the same through kvxfer's
engines: a :class:`~kvxfer.engine.Producer` in the spawned process over a ``tiny-gqa``
cache of the source kind (VRAM as :class:`~kvxfer.layout.model.DeviceBuffer`), a
:class:`~kvxfer.engine.Consumer` here over the destination kind, one pull request of
``ENGINE_BLOCKS`` blocks per repeat, every byte checked against the pattern oracle.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvxfer.layout.model import MemKind

__all__ = ["CASES", "Cuda", "cuda_problem", "main"]

CASES = {
    "vram->vram": (MemKind.VRAM, MemKind.VRAM),
    "dram->vram": (MemKind.DRAM, MemKind.VRAM),
    "vram->dram": (MemKind.VRAM, MemKind.DRAM),
    "dram->dram": (MemKind.DRAM, MemKind.DRAM),
    "engine:vram->vram": (MemKind.VRAM, MemKind.VRAM),
    "engine:dram->dram": (MemKind.DRAM, MemKind.DRAM),
}
ENGINE_BLOCKS = 256  # blocks per request in the engine cases (of 2 * ENGINE_BLOCKS)


class Cuda:
    """The few CUDA driver calls needed: primary context, alloc, copies, free."""

    def __init__(self, device: int) -> None:
        self._lib = ctypes.CDLL("libcuda.so.1")
        self._check(self._lib.cuInit(0), "cuInit")
        count = ctypes.c_int()
        self._check(self._lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        if not 0 <= device < count.value:
            raise RuntimeError(f"GPU {device} requested, {count.value} present")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx retain")
        self._check(self._lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.device = device

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed with CUDA error {code}")

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._check(self._lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "alloc")
        return ptr.value

    def free(self, ptr: int) -> None:
        self._lib.cuMemFree_v2(ctypes.c_uint64(ptr))

    def to_device(self, ptr: int, host: np.ndarray) -> None:
        src, n = ctypes.c_void_p(host.ctypes.data), ctypes.c_size_t(host.nbytes)
        self._check(self._lib.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), src, n), "HtoD")

    def to_host(self, host: np.ndarray, ptr: int) -> None:
        dst, n = ctypes.c_void_p(host.ctypes.data), ctypes.c_size_t(host.nbytes)
        self._check(self._lib.cuMemcpyDtoH_v2(dst, ctypes.c_uint64(ptr), n), "DtoH")


def cuda_problem() -> str | None:
    """Why VRAM cases cannot run here, or None if a CUDA driver and a GPU are present."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver (libcuda.so.1 not found)"
    if lib.cuInit(0) != 0:
        return "the CUDA driver did not initialize (no GPU visible?)"
    count = ctypes.c_int()
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return "no GPU visible to the CUDA driver"
    return None


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """``(nbytes,) uint8``: byte ``i`` is ``(i * 131 + i // 251 + seed) % 256``."""
    i = np.arange(nbytes, dtype=np.uint64)
    return ((i * 131 + i // 251 + seed) % 256).astype(np.uint8)


@dataclass
class _Buffer:
    """A buffer of one kind: host array (DRAM) or device pointer (VRAM) + host mirror."""

    kind: MemKind
    nbytes: int
    device: int
    cuda: Cuda | None = None
    host: np.ndarray | None = None
    ptr: int = 0

    def __post_init__(self) -> None:
        self.host = np.zeros(self.nbytes, dtype=np.uint8)
        if self.kind is MemKind.VRAM:
            self.cuda = Cuda(self.device)
            self.ptr = self.cuda.alloc(self.nbytes)
            self.cuda.to_device(self.ptr, self.host)
        else:
            self.ptr = self.host.ctypes.data

    def write(self, data: np.ndarray) -> None:
        assert self.host is not None
        self.host[:] = data
        if self.cuda is not None:
            self.cuda.to_device(self.ptr, self.host)

    def read(self) -> np.ndarray:
        assert self.host is not None
        if self.cuda is not None:
            self.cuda.to_host(self.host, self.ptr)
        return self.host

    @property
    def dev(self) -> int:
        return self.device if self.kind is MemKind.VRAM else 0

    def close(self) -> None:
        if self.cuda is not None:
            self.cuda.free(self.ptr)


def _target(conn: Connection, kind: str, nbytes: int, device: int, seed: int) -> None:
    """The source process: fill, register, publish, wait until told to stop."""
    from kvxfer.transport.nixl import NixlBackend

    buf = _Buffer(MemKind(kind), nbytes, device)
    buf.write(pattern(nbytes, seed))
    with NixlBackend(f"gpu-check-src-{seed}", progress_delay_us=100) as backend:
        backend.register([(buf.ptr, nbytes, buf.dev)], buf.kind)
        conn.send((backend.metadata(), buf.ptr, buf.dev))
        conn.recv()  # "done"
    buf.close()


def run_case(name: str, nbytes: int, chunk: int, repeat: int, devices: tuple[int, int]) -> dict[str, Any]:  # fmt: skip
    """Move ``nbytes`` for one case; returns GB/s and the mismatching byte count."""
    from kvxfer.transport.backend import XferOp, XferState
    from kvxfer.transport.nixl import NixlBackend

    src_kind, dst_kind = CASES[name]
    seed = sum(name.encode()) % 200 + 1  # deterministic, differs per case
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, src_kind.value, nbytes, devices[0], seed))
    proc.start()
    dst = _Buffer(dst_kind, nbytes, devices[1])
    try:
        if not parent.poll(60):
            raise RuntimeError("the source process did not start")
        blob, src_ptr, src_dev = parent.recv()
        n = nbytes // chunk
        with NixlBackend(f"gpu-check-dst-{seed}", progress_thread=False) as backend:
            backend.register([(dst.ptr, nbytes, dst.dev)], dst_kind)
            peer = backend.add_remote(blob)
            mine = np.array([[dst.ptr, chunk, dst.dev, chunk, n]], dtype=np.uint64)
            theirs = np.array([[src_ptr, chunk, src_dev, chunk, n]], dtype=np.uint64)
            local = backend.prepare(mine, mem_kind=dst_kind)
            remote = backend.prepare(theirs, peer, mem_kind=src_kind)
            ids = np.arange(n, dtype=np.int32)
            xfer = backend.make_xfer(XferOp.READ, local, ids, remote, ids)
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                state = backend.post(xfer)
                while state is XferState.IN_PROGRESS:
                    state = backend.poll(xfer)
                times.append(time.perf_counter() - t0)
            backend.release(xfer)
        bad = int(np.count_nonzero(dst.read() != pattern(nbytes, seed)))
    finally:
        parent.send("done")
        proc.join(30)
        dst.close()
    return {"case": name, "bytes": nbytes, "descriptors": n, "gb_s": nbytes / statistics.median(times) / 1e9, "mismatches": bad}  # fmt: skip


def _engine_buffers(bufs: list[_Buffer]) -> list[Any]:
    """What the engines take: the host array for DRAM, a DeviceBuffer for VRAM."""
    from kvxfer.layout.model import DeviceBuffer

    return [
        b.host if b.kind is MemKind.DRAM else DeviceBuffer(b.ptr, b.nbytes, b.dev, b.kind)
        for b in bufs
    ]


def _engine_spec() -> Any:
    from kvxfer.layout.presets import spec_for

    return spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=2 * ENGINE_BLOCKS)


def _engine_ids(attempt: int) -> tuple[np.ndarray, np.ndarray]:
    """Local and remote block ids of request ``attempt``: remote reversed, local shifted."""
    rids = np.arange(ENGINE_BLOCKS)[::-1] + attempt % 2
    return np.arange(ENGINE_BLOCKS) + (attempt + 1) % 2 * ENGINE_BLOCKS // 2, rids


def _engine_target(conn: Connection, kind: str, device: int, repeat: int) -> None:
    """The producer process: pattern-filled cache of ``kind``, held for each request."""
    from kvxfer.engine import EngineConfig, Producer, allocate_cache
    from kvxfer.testing.pattern import fill

    spec = _engine_spec()
    host = allocate_cache(spec)
    fill(spec, host)
    bufs = [_Buffer(MemKind(kind), h.nbytes, device) for h in host]
    for b, h in zip(bufs, host, strict=True):
        b.write(h)
    config = EngineConfig("gpu-check-p", model_name="tiny-gqa")
    with Producer(config, [(spec, _engine_buffers(bufs))]) as prod:
        for i in range(repeat):
            prod.hold(f"r{i}", block_ids=_engine_ids(i)[1].tolist())
        conn.send(prod.address)
        conn.recv()  # "done"
    for b in bufs:
        b.close()


def run_engine_case(name: str, repeat: int, devices: tuple[int, int]) -> dict[str, Any]:
    """One engine case: ``repeat`` pull requests, each verified; GB/s of the median."""
    from kvxfer.engine import Consumer, EngineConfig, RequestState, allocate_cache
    from kvxfer.testing.pattern import mismatches

    src_kind, dst_kind = CASES[name]
    spec = _engine_spec()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_target, args=(child, src_kind.value, devices[0], repeat))
    proc.start()
    dst = [_Buffer(dst_kind, h.nbytes, devices[1]) for h in allocate_cache(spec)]
    times, bad, nbytes, descs = [], 0, 0, 0
    try:
        if not parent.poll(120):
            raise RuntimeError("the producer process did not start")
        address = parent.recv()
        with Consumer(EngineConfig("gpu-check-d", model_name="tiny-gqa"),
                      [(spec, _engine_buffers(dst))]) as cons:  # fmt: skip
            for i in range(repeat):
                lids, rids = _engine_ids(i)
                t = cons.read(f"r{i}", address, local_block_ids=lids, remote_block_ids=rids)
                if t.wait(60) is not RequestState.DONE:
                    raise RuntimeError(f"request {i} ended {t.state.name}: {t.error}")
                times.append(t.finished_at - t.posted_at)
                nbytes, descs = t.num_bytes, t.num_descriptors
                bad += mismatches(spec, [b.read() for b in dst], spec, lids, rids)
    finally:
        parent.send("done")
        proc.join(30)
        for b in dst:
            b.close()
    gb_s = nbytes / statistics.median(times) / 1e9
    return {"case": name, "bytes": nbytes, "descriptors": descs, "gb_s": gb_s, "mismatches": bad}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["vram->vram", "dram->vram", "vram->dram", "engine:vram->vram"])  # fmt: skip
    p.add_argument("--mib", type=int, default=256, help="bytes per transfer, MiB (default 256)")
    p.add_argument("--chunk-kib", type=int, default=1024, help="descriptor size (default 1024)")
    p.add_argument("--repeat", type=int, default=5, help="median of R transfers (default 5)")
    p.add_argument("--devices", type=int, nargs=2, default=[0, 0], metavar=("SRC", "DST"))
    args = p.parse_args(argv)
    nbytes, chunk = args.mib << 20, args.chunk_kib << 10
    if chunk <= 0 or nbytes <= 0 or nbytes % chunk:
        p.error("--mib must be a positive multiple of --chunk-kib")
    needs_gpu = any(MemKind.VRAM in CASES[c] for c in args.cases)
    problem = cuda_problem() if needs_gpu else None
    if problem is not None:
        print(f"gpu-check: not run: {problem}; VRAM cases need CUDA and a GPU.")
        return 0
    failed = 0
    print(f"{'case':<18} {'MiB':>6} {'descriptors':>12} {'GB/s':>8}  bytes verified")
    for name in args.cases:
        devices = (args.devices[0], args.devices[1])
        if name.startswith("engine:"):
            r = run_engine_case(name, args.repeat, devices)
        else:
            r = run_case(name, nbytes, chunk, args.repeat, devices)
        ok = "all" if r["mismatches"] == 0 else f"{r['mismatches']} WRONG"
        failed += r["mismatches"] != 0
        mib = f"{r['bytes'] / (1 << 20):.3g}"
        print(f"{name:<18} {mib:>6} {r['descriptors']:>12} {r['gb_s']:>8.2f}  {ok}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
