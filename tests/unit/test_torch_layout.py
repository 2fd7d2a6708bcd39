"""layout_from_kv_tensors: engine-shaped CPU tensors -> the same layout LayoutSpec builds."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout, TokenLayout
from kvxfer.layout.spec import AttnKind, LayoutSpec
from kvxfer.layout.tensors import layout_from_kv_tensors

L, NB, BS, K, D = 3, 6, 16, 4, 8  # layers, logical blocks, block size, KV heads, head dim


def _no_torch(code: str) -> subprocess.CompletedProcess[str]:
    # sys.modules["torch"] = None makes `import torch` raise ImportError
    prog = "import sys; sys.modules['torch'] = None\n" + code
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, check=False)


def test_module_imports_without_torch() -> None:
    proc = _no_torch("import kvxfer.layout.tensors, kvxfer.layout.presets")
    assert proc.returncode == 0, proc.stderr


def test_calling_without_torch_says_how_to_install() -> None:
    code = (
        "from kvxfer.layout.tensors import layout_from_kv_tensors as f\n"
        "from kvxfer.layout.spec import AttnKind\n"
        "f([], kind=AttnKind.MLA, block_size=16, num_kv_heads=1)\n"
    )
    proc = _no_torch(code)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "kvxfer[torch]" in proc.stderr


# ---- torch-dependent tests below -------------------------------------------------------


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


def spec_layout(tensors: list[Any], regions: list[Any], **kw: Any) -> CacheLayout:
    """The reference: LayoutSpec over the tensors' base addresses."""
    bases = [int(t.data_ptr()) for t in regions]
    return LayoutSpec(**kw).build(bases)


def heads(tp_size: int) -> int:
    return max(1, K // tp_size)


@pytest.mark.parametrize(("tp_size", "ppl"), [(1, 1), (2, 2), (8, 1)])
def test_split_kv_flash_attention_shape(torch: Any, tp_size: int, ppl: int) -> None:
    h, t = heads(tp_size), BS // ppl
    tensors = [torch.zeros(2, NB * ppl, t, h, D, dtype=torch.bfloat16) for _ in range(L)]
    got = layout_from_kv_tensors(
        tensors, kind=AttnKind.SPLIT_KV, block_size=BS, num_kv_heads=K, tp_size=tp_size, ppl=ppl
    )
    assert got.token_layout is TokenLayout.NHD
    halves = [half for x in tensors for half in (x[0], x[1])]
    want = spec_layout(
        tensors,
        halves,
        kind=AttnKind.SPLIT_KV,
        num_layers=L,
        num_blocks=NB,
        block_size=BS,
        num_kv_heads=K,
        head_dim=D,
        tp_size=tp_size,
        ppl=ppl,
        token_layout=TokenLayout.NHD,
    )
    assert got.views == want.views
    assert got == want
    # V region starts right after K inside the same tensor
    assert got.regions[1].base_addr == got.regions[0].base_addr + got.regions[0].num_bytes


def test_split_kv_separate_tensors(torch: Any) -> None:
    tensors = [torch.zeros(NB, K, BS, D, dtype=torch.float16) for _ in range(2 * L)]
    got = layout_from_kv_tensors(tensors, kind=AttnKind.SPLIT_KV, block_size=BS, num_kv_heads=K)
    assert got.token_layout is TokenLayout.HND
    common = dict(num_layers=L, num_blocks=NB, block_size=BS, num_kv_heads=K, head_dim=D)
    want = spec_layout(tensors, tensors, kind=AttnKind.SPLIT_KV, **common)
    assert got.views == want.views and got == want
    assert [v.name for v in got.views[:3]] == ["L0.K", "L0.V", "L1.K"]
    with pytest.raises(LayoutError, match="pairs"):
        layout_from_kv_tensors(tensors[:3], kind=AttnKind.SPLIT_KV, block_size=BS, num_kv_heads=K)


@pytest.mark.parametrize("token_layout", [TokenLayout.HND, TokenLayout.NHD])
def test_blocks_first(torch: Any, token_layout: TokenLayout) -> None:
    h = heads(2)
    inner = (h, BS) if token_layout is TokenLayout.HND else (BS, h)
    tensors = [torch.zeros(NB, 2, *inner, D, dtype=torch.bfloat16) for _ in range(L)]
    got = layout_from_kv_tensors(
        tensors,
        kind=AttnKind.BLOCKS_FIRST,
        block_size=BS,
        num_kv_heads=K,
        tp_rank=1,
        tp_size=2,
        token_layout=token_layout,
    )
    want = spec_layout(
        tensors,
        tensors,
        kind=AttnKind.BLOCKS_FIRST,
        num_layers=L,
        num_blocks=NB,
        block_size=BS,
        num_kv_heads=K,
        head_dim=D,
        tp_rank=1,
        tp_size=2,
        token_layout=token_layout,
    )
    assert got.views == want.views and got == want
    assert got.views[1].offset == h * BS * D * 2


def test_packed(torch: Any) -> None:
    tensors = [torch.zeros(NB, K, BS, 2 * D, dtype=torch.float32) for _ in range(L)]
    got = layout_from_kv_tensors(tensors, kind=AttnKind.PACKED, block_size=BS, num_kv_heads=K)
    want = spec_layout(
        tensors,
        tensors,
        kind=AttnKind.PACKED,
        num_layers=L,
        num_blocks=NB,
        block_size=BS,
        num_kv_heads=K,
        head_dim=D,
        dtype_bytes=4,
    )
    assert got.head_dim == D and got.dtype_bytes == 4
    assert got.views == want.views and got == want


def test_mla(torch: Any) -> None:
    tensors = [torch.zeros(NB, BS, 576, dtype=torch.bfloat16) for _ in range(L)]
    got = layout_from_kv_tensors(
        tensors, kind=AttnKind.MLA, block_size=BS, num_kv_heads=128, tp_rank=3, tp_size=4
    )
    want = spec_layout(
        tensors,
        tensors,
        kind=AttnKind.MLA,
        num_layers=L,
        num_blocks=NB,
        block_size=BS,
        num_kv_heads=1,
        head_dim=576,
        tp_rank=3,
        tp_size=4,
    )
    assert got.is_mla and got.num_kv_heads == 1
    assert got.views == want.views and got == want


def test_regions_match_tensor_memory(torch: Any) -> None:
    tensors = [torch.zeros(NB, K, BS, D, dtype=torch.bfloat16) for _ in range(2)]
    got = layout_from_kv_tensors(tensors, kind=AttnKind.SPLIT_KV, block_size=BS, num_kv_heads=K)
    for region, x in zip(got.regions, tensors, strict=True):
        assert region.base_addr == x.data_ptr()
        assert region.num_bytes == x.numel() * x.element_size()
        assert region.device_id == 0
    # descriptor b of view 0 addresses block b of the tensor
    v = got.views[0]
    assert got.view_addr(0) + 3 * v.stride == tensors[0][3].data_ptr()


def test_non_contiguous_is_refused_by_index(torch: Any) -> None:
    good = torch.zeros(NB, K, BS, D)
    permuted = torch.zeros(NB, BS, K, D).permute(0, 2, 1, 3)  # HND view of NHD memory
    assert permuted.shape == good.shape
    with pytest.raises(LayoutError, match="tensor 3: not contiguous"):
        layout_from_kv_tensors(
            [good, good, good, permuted], kind=AttnKind.SPLIT_KV, block_size=BS, num_kv_heads=K
        )


@pytest.mark.parametrize(
    ("make", "kw", "match"),
    [
        (lambda t: [t.zeros(NB, K, BS, D), t.zeros(NB, K, BS, D + 1)], {}, "tensor 1: "),
        (lambda t: [t.zeros(NB, K, BS, D), t.zeros(NB, K, BS, D).half()], {}, "tensor 1: "),
        (lambda t: [t.zeros(NB, 2, BS, D)] * 2, {}, r"does not match split_kv HND"),
        (lambda t: [t.zeros(NB, K, BS, D)] * 2, {"tp_size": 2}, "H=2 heads"),
        (lambda t: [t.zeros(NB, K, BS, D)] * 2, {"ppl": 2}, "T=8 tokens"),
        (lambda t: [t.zeros(NB, D)] * 2, {}, "fewer than 3 dims"),
        (lambda t: [1, 2], {}, "tensor 0: expected a torch.Tensor"),
        (lambda t: [], {}, "no tensors"),
    ],
)
def test_bad_inputs(torch: Any, make: Any, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        layout_from_kv_tensors(
            make(torch), kind=AttnKind.SPLIT_KV, block_size=BS, num_kv_heads=K, **kw
        )


def test_unsupported_and_odd_packed(torch: Any) -> None:
    with pytest.raises(LayoutError, match="cross_layer"):
        layout_from_kv_tensors(
            [torch.zeros(NB, L, 2, K, BS, D)],
            kind=AttnKind.CROSS_LAYER,
            block_size=BS,
            num_kv_heads=K,
        )
    with pytest.raises(LayoutError, match="2 \\* head_dim"):
        layout_from_kv_tensors(
            [torch.zeros(NB, K, BS, 7)], kind=AttnKind.PACKED, block_size=BS, num_kv_heads=K
        )
