"""Layouts from vLLM's KV tensors: worked examples stating byte offsets, checked against
the tensors' own element addresses (torch: the tests' optional extra)."""

from __future__ import annotations

import pytest

from kvxfer.errors import LayoutError
from kvxfer.integrations.vllm.layouts import backend_kind, distinct_layers, spec_from_vllm_tensors
from kvxfer.layout.model import TokenLayout
from kvxfer.layout.spec import AttnKind

torch = pytest.importorskip("torch")

NB, T, H, D = 5, 4, 2, 8  # blocks, tokens per block, heads on this rank, head size
E = 4  # float32


def _view_addr(spec, bufs, view_index: int, block: int) -> int:
    layout = spec.build([b.ctypes.data for b in bufs])
    v = layout.views[view_index]
    region = layout.regions[v.region]
    return region.base_addr + v.offset + block * v.stride


def test_cpu_attn_packed_worked_example() -> None:
    # CPU_ATTN: (NB, H, T, 2D) per layer; a (block, head) slab is T*2D elements
    layers = [torch.zeros(NB, H, T, 2 * D) for _ in range(3)]
    spec, bufs = spec_from_vllm_tensors(layers, backend="CPU_ATTN", block_size=T, num_kv_heads=H)
    assert (spec.kind, spec.token_layout) == (AttnKind.PACKED, TokenLayout.HND)
    assert (spec.num_layers, spec.num_blocks, spec.head_dim, spec.dtype_bytes) == (3, NB, D, E)
    # layer 2, block 3 starts 3 * (H*T*2D*4) = 3 * 512 = 1536 bytes into layer 2's tensor
    assert H * T * 2 * D * E == 512
    assert _view_addr(spec, bufs, 2, 3) == layers[2].data_ptr() + 1536
    assert _view_addr(spec, bufs, 2, 3) == layers[2][3].data_ptr()
    assert [b.nbytes for b in bufs] == [NB * 512] * 3


@pytest.mark.parametrize("hnd", [False, True])
def test_flash_attn_split_kv_worked_example(hnd: bool) -> None:
    # FLASH_ATTN: logical (2, NB, T, H, D); HND stores (2, NB, H, T, D) and permutes
    def make() -> torch.Tensor:
        if hnd:
            return torch.zeros(2, NB, H, T, D).permute(0, 1, 3, 2, 4)
        return torch.zeros(2, NB, T, H, D)

    layers = [make() for _ in range(2)]
    spec, bufs = spec_from_vllm_tensors(layers, backend="FLASH_ATTN", block_size=T, num_kv_heads=4,
                                        tp_rank=1, tp_size=2)  # fmt: skip
    assert spec.kind is AttnKind.SPLIT_KV
    assert spec.token_layout is (TokenLayout.HND if hnd else TokenLayout.NHD)
    assert spec.heads_per_rank == H
    # views: layer0.K, layer0.V, layer1.K, layer1.V; a block is T*H*D*4 = 256 bytes
    block = T * H * D * E
    assert block == 256
    assert _view_addr(spec, bufs, 3, 2) == layers[1].data_ptr() + NB * block + 2 * block
    assert _view_addr(spec, bufs, 3, 2) == layers[1][1, 2].data_ptr()
    # head 1, token 3 of that V block: NHD (t*H + h)*D, HND (h*T + t)*D elements in
    elem = (1 * T + 3) * D if hnd else (3 * H + 1) * D
    assert layers[1][1, 2, 3, 1].data_ptr() == _view_addr(spec, bufs, 3, 2) + elem * E


def test_flashinfer_blocks_first_worked_example() -> None:
    # FLASHINFER: (NB, 2, T, H, D); K at offset 0 of a block, V at half a block
    layers = [torch.zeros(NB, 2, H, T, D).permute(0, 1, 3, 2, 4) for _ in range(2)]
    spec, bufs = spec_from_vllm_tensors(layers, backend="FLASHINFER", block_size=T, num_kv_heads=H)
    assert (spec.kind, spec.token_layout) == (AttnKind.BLOCKS_FIRST, TokenLayout.HND)
    half = T * H * D * E
    assert _view_addr(spec, bufs, 1, 4) == layers[0].data_ptr() + 4 * 2 * half + half
    assert _view_addr(spec, bufs, 1, 4) == layers[0][4, 1].data_ptr()


def test_mla_worked_example() -> None:
    layers = [torch.zeros(NB, T, 24) for _ in range(2)]
    spec, bufs = spec_from_vllm_tensors(layers, backend="FLASHMLA", block_size=T, num_kv_heads=8,
                                        tp_rank=0, tp_size=4)  # fmt: skip
    assert spec.kind is AttnKind.MLA and spec.head_dim == 24
    assert (
        _view_addr(spec, bufs, 1, 3)
        == layers[1][3].data_ptr()
        == layers[1].data_ptr() + 3 * T * 24 * E
    )


@pytest.mark.parametrize(
    ("tensors", "kw", "match"),
    [
        ([torch.zeros(NB, H, T, 2 * D)], {"backend": "TRITON_ATTN"}, "not supported"),
        ([torch.zeros(NB, H, T, 2 * D), torch.zeros(NB + 1, H, T, 2 * D)], {}, "layer 1"),
        ([torch.zeros(NB, H, T, 2 * D)], {"num_kv_heads": 4}, "heads per rank"),
        ([torch.zeros(NB, H, 2 * T, 2 * D)], {}, "tokens per block"),
        ([torch.zeros(NB, H, T, 2 * D).transpose(1, 2)], {}, "stored as"),
        ([torch.zeros(NB, H, T, 4 * D)[..., : 2 * D]], {}, "not dense"),
        ([], {}, "no KV tensors"),
    ],
)
def test_refused_tensors_name_the_problem(tensors: list, kw: dict, match: str) -> None:
    args = {"backend": "CPU_ATTN", "block_size": T, "num_kv_heads": H, **kw}
    with pytest.raises(LayoutError, match=match):
        spec_from_vllm_tensors(tensors, **args)


def test_backend_names() -> None:
    assert backend_kind("FLASH_ATTN") == "FLASH_ATTN"
    assert backend_kind("FLASHINFER") == "FLASHINFER"
    assert backend_kind("CPU_ATTN") == "CPU_ATTN"
    assert backend_kind("FLASHMLA") == "MLA"
    with pytest.raises(LayoutError, match="XFORMERS"):
        backend_kind("XFORMERS")


class _OnGpu:
    """A CPU tensor that reports ``cuda:<index>`` as its device. No CUDA on this
    machine: this checks only what the constructor reads (device, pointers, shapes,
    strides); moving the memory is ``scripts/gpu-check.sh``'s job on a GPU."""

    def __init__(self, t: torch.Tensor, index: int) -> None:
        self._t, self.device = t, torch.device("cuda", index)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._t, name)


def test_cuda_tensors_become_vram_device_buffers_with_the_same_addresses() -> None:
    from kvxfer.layout.model import DeviceBuffer, MemKind

    host = [torch.zeros(2, NB, T, H, D) for _ in range(2)]
    spec, bufs = spec_from_vllm_tensors([_OnGpu(t, 3) for t in host], backend="FLASH_ATTN",
                                        block_size=T, num_kv_heads=H)  # fmt: skip
    half = NB * T * H * D * E
    assert bufs == [
        DeviceBuffer(host[0].data_ptr(), half, 3, MemKind.VRAM),
        DeviceBuffer(host[0].data_ptr() + half, half, 3, MemKind.VRAM),
        DeviceBuffer(host[1].data_ptr(), half, 3, MemKind.VRAM),
        DeviceBuffer(host[1].data_ptr() + half, half, 3, MemKind.VRAM),
    ]
    layout = spec.build([b.addr for b in bufs], device_id=3, mem_kind=MemKind.VRAM)
    assert {(r.mem_kind, r.device_id) for r in layout.regions} == {(MemKind.VRAM, 3)}


def test_tensors_on_other_devices_or_mixed_devices_are_refused() -> None:
    with pytest.raises(LayoutError, match="meta"):
        spec_from_vllm_tensors([torch.zeros(NB, H, T, 2 * D, device="meta")],
                               backend="CPU_ATTN", block_size=T, num_kv_heads=H)  # fmt: skip
    mixed = [torch.zeros(NB, H, T, 2 * D), _OnGpu(torch.zeros(NB, H, T, 2 * D), 0)]
    with pytest.raises(LayoutError, match=r"layer 1.*cuda:0"):
        spec_from_vllm_tensors(mixed, backend="CPU_ATTN", block_size=T, num_kv_heads=H)


def test_layers_that_share_one_kv_tensor_are_registered_once() -> None:
    # cross-layer KV sharing (vLLM's kv_sharing_target_layer_name: Gemma-3n): several
    # layer names map to one tensor; registering each would make overlapping regions
    a, b = torch.zeros(4, 2, 16, 16), torch.zeros(4, 2, 16, 16)
    caches = {"l0": a, "l1": b, "l2": a, "l3": b[:]}  # l3: another view of b's bytes
    assert distinct_layers(caches) == ["l0", "l1"]
    assert distinct_layers({"x": a}) == ["x"]
