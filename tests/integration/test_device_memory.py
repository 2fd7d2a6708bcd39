"""Engines over memory they do not hold as NumPy arrays: a :class:`DeviceBuffer` names
``(addr, nbytes, device_id, mem_kind)``, e.g. a GPU's KV cache by device pointer.

No GPU on this machine: the in-memory backend built with ``mem_kinds={DRAM, VRAM}``
stands in for a transport that moves both (it keeps each registration's kind and
refuses rows prepared under another kind, so every register/prepare the engines make
is checked); real NIXL is used for what it does here: refusing VRAM it cannot register.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer import DeviceBuffer, MemKind
from kvxfer.engine import Consumer, EngineConfig, Producer, RequestState, allocate_cache
from kvxfer.errors import ConfigError, InputError, LayoutError, TransferError
from kvxfer.layout.presets import spec_for
from kvxfer.testing import MemoryBackend, fill, mismatches

pytestmark = pytest.mark.timeout(60)
BOTH = frozenset({MemKind.DRAM, MemKind.VRAM})


def _both(name: str) -> MemoryBackend:
    return MemoryBackend(name, mem_kinds=BOTH)


def _device(bufs: list[np.ndarray], device_id: int = 0) -> list[DeviceBuffer]:
    """Host arrays presented as VRAM of GPU ``device_id`` (the arrays stay alive)."""
    return [DeviceBuffer(b.ctypes.data, b.nbytes, device_id, MemKind.VRAM) for b in bufs]


@pytest.mark.parametrize("consumer_kind", ["VRAM", "DRAM"])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_engines_register_and_prepare_device_memory_as_vram(consumer_kind: str, mode: str) -> None:
    p_spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    p_host = allocate_cache(p_spec)
    fill(p_spec, p_host)
    d_spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    d_host = allocate_cache(d_spec)
    d_bufs = _device(d_host, 1) if consumer_kind == "VRAM" else d_host
    with (
        Producer(EngineConfig("vp", model_name="tiny-gqa"), [(p_spec, _device(p_host, 3))],
                 backend_factory=_both) as prod,
        Consumer(EngineConfig("vd", model_name="tiny-gqa"), [(d_spec, d_bufs)],
                 backend_factory=_both) as cons,
    ):  # fmt: skip
        p_layout = prod.ranks[0].layout
        assert {(r.mem_kind, r.device_id) for r in p_layout.regions} == {(MemKind.VRAM, 3)}
        # the cache as VRAM; beside it, DRAM words: the hold table / the check landing slots
        assert prod.ranks[0].backend.registered_kinds() == {MemKind.VRAM, MemKind.DRAM}
        want = MemKind(consumer_kind)
        assert cons.ranks[0].backend.registered_kinds() == {want, MemKind.DRAM}
        lids, rids = np.array([1, 3, 4]), np.array([9, 2, 5])
        lease = prod.hold("r", block_ids=rids)
        if mode == "pull":  # the hold check reads DRAM words after the (VRAM) data READ
            t = cons.read("r", prod.address, local_block_ids=lids, remote_block_ids=rids,
                          hold_ticket=lease.ticket)  # fmt: skip
        else:
            t = cons.push("r", prod.address, local_block_ids=lids, remote_block_ids=rids)
        # DONE means every list was prepared under its memory's kind: the backend
        # refuses rows prepared as DRAM over VRAM registrations (and the reverse)
        assert t.wait(10) is RequestState.DONE, t.error
        assert mismatches(d_spec, d_host, p_spec, lids, rids) == 0


def test_device_memory_on_a_backend_without_vram_is_refused_and_leaves_nothing() -> None:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    host = allocate_cache(spec)
    for _ in range(2):  # the agent name is free again after the refusal
        with pytest.raises(ConfigError, match="VRAM"):
            Producer(EngineConfig("vx", model_name="tiny-gqa"), [(spec, _device(host))],
                     backend_factory=MemoryBackend)  # fmt: skip


def test_one_rank_over_two_memory_kinds_is_refused() -> None:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    host = allocate_cache(spec)
    mixed = [*_device(host[:1]), *host[1:]]
    with pytest.raises(ConfigError, match="one memory kind"):
        Consumer(EngineConfig("vm", model_name="tiny-gqa"), [(spec, mixed)], backend_factory=_both)


def test_a_device_buffer_of_the_wrong_size_is_refused() -> None:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    host = allocate_cache(spec)
    bad = _device(host)
    bad[0] = DeviceBuffer(bad[0].addr, bad[0].nbytes - 1, 0, MemKind.VRAM)
    with pytest.raises(LayoutError, match="do not match"):
        Producer(EngineConfig("vs", model_name="tiny-gqa"), [(spec, bad)], backend_factory=_both)


def test_device_buffer_values_are_checked() -> None:
    with pytest.raises(InputError, match="addr"):
        DeviceBuffer(0, 64, 0, MemKind.VRAM)
    with pytest.raises(InputError, match="nbytes"):
        DeviceBuffer(4096, 0, 0, MemKind.VRAM)
    with pytest.raises(InputError, match="device_id"):
        DeviceBuffer(4096, 64, -1, MemKind.VRAM)
    with pytest.raises(ConfigError, match="mem_kind"):
        DeviceBuffer(4096, 64, 0, "HBM")  # type: ignore[arg-type]


@pytest.mark.e2e
def test_nixl_without_a_gpu_refuses_vram_with_a_clear_error() -> None:
    """This machine's NIXL UCX lists VRAM but UCX has no CUDA here: registering host
    memory as VRAM fails. The producer says which memory and why, and frees its name."""
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=8)
    host = allocate_cache(spec)
    with pytest.raises(TransferError, match=r"registering .*VRAM .*device 2"):
        Producer(EngineConfig("vn", model_name="tiny-gqa"), [(spec, _device(host, 2))])


def test_relayout_into_device_memory_is_refused_at_first_contact() -> None:
    """Received blocks of another block size are re-laid-out on the host with NumPy;
    that cannot run over device memory: first contact fails with a typed error."""
    p_spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16, block_size=8)
    p_host = allocate_cache(p_spec)
    d_spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16, block_size=16)
    d_host = allocate_cache(d_spec)
    with (
        Producer(EngineConfig("rp", model_name="tiny-gqa"), [(p_spec, p_host)],
                 backend_factory=_both) as prod,
        Consumer(EngineConfig("rd", model_name="tiny-gqa"), [(d_spec, _device(d_host))],
                 backend_factory=_both) as cons,
    ):  # fmt: skip
        prod.hold("r", block_ids=[2, 3])
        t = cons.read("r", prod.address, local_block_ids=[1], remote_block_ids=[2, 3])
        assert t.wait(10) is RequestState.FAILED
        assert isinstance(t.error, ConfigError)
        assert "device memory" in str(t.error)


def test_host_memory_given_by_address_is_relaid_out_in_place() -> None:
    """A DRAM DeviceBuffer is host memory: the relayout that VRAM refuses runs on it."""
    p_spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16, block_size=8)
    p_host = allocate_cache(p_spec)
    fill(p_spec, p_host)
    d_spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16, block_size=16)
    d_host = allocate_cache(d_spec)
    by_addr = [DeviceBuffer(b.ctypes.data, b.nbytes, 0, MemKind.DRAM) for b in d_host]
    with (
        Producer(EngineConfig("hp", model_name="tiny-gqa"), [(p_spec, p_host)],
                 backend_factory=MemoryBackend) as prod,
        Consumer(EngineConfig("hd", model_name="tiny-gqa"), [(d_spec, by_addr)],
                 backend_factory=MemoryBackend) as cons,
    ):  # fmt: skip
        prod.hold("r", block_ids=[2, 3, 6, 7])
        t = cons.read("r", prod.address, local_block_ids=[1, 4], remote_block_ids=[2, 3, 6, 7])
        assert t.wait(10) is RequestState.DONE, t.error
        assert mismatches(d_spec, d_host, p_spec, [1, 4], [2, 3, 6, 7]) == 0
