"""Presets -> LayoutSpec: every preset builds at common TP sizes; exact byte counts."""

from __future__ import annotations

import pytest

from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout, Shard, TokenLayout, ViewKind
from kvxfer.layout.presets import (
    PRESETS,
    attn_block_size_for_state,
    describe,
    format_bytes,
    spec_for,
)
from kvxfer.layout.spec import AttnKind, LayoutSpec

REQUIRED = ("llama3-8b", "qwen-32b", "deepseek-v3", "nemotron-h", "qwen3.5-gdn", "tiny-gqa")


def fake_bases(spec: LayoutSpec) -> list[int]:
    return [(1 << 40) + i * (1 << 36) for i in range(len(spec.region_bytes()))]


def build(spec: LayoutSpec) -> CacheLayout:
    return spec.build(fake_bases(spec))


def test_required_presets_exist() -> None:
    assert set(REQUIRED) <= set(PRESETS)
    for name, shape in PRESETS.items():
        assert shape.name == name


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_every_preset_builds_on_every_rank(name: str, tp_size: int) -> None:
    for tp_rank in range(tp_size):
        spec = spec_for(name, tp_rank=tp_rank, tp_size=tp_size, num_blocks=32)
        layout = build(spec)
        assert layout.tp_rank == tp_rank and layout.tp_size == tp_size
        assert layout.num_logical_blocks == 32
        # regions never overlap with these fake bases (each < 64 GiB)
        assert all(r.num_bytes < (1 << 36) for r in layout.regions)
        shape = PRESETS[name]
        if shape.state is not None:
            n_sub = len(shape.state.conv_cols)
            assert len(layout.state_views) == shape.state.num_layers * (n_sub + 1)
            st_page = shape.state.page_bytes(tp_size, shape.dtype_bytes)
            assert st_page <= spec.page_bytes  # the attention page holds a state page
            assert spec.block_size % 16 == 0


def test_llama3_8b_tp1_numbers() -> None:
    spec = spec_for("llama3-8b", tp_rank=0, tp_size=1, num_blocks=100)
    assert spec.block_size == 16
    layout = build(spec)
    assert len(layout.regions) == 64
    assert all(v.length == 16 * 8 * 128 * 2 == 32768 for v in layout.views)
    assert all(r.num_bytes == 100 * 32768 for r in layout.regions)
    assert [v.name for v in layout.views[:3]] == ["L0.K", "L0.V", "L1.K"]


def test_llama3_8b_tp8_one_head_per_rank() -> None:
    layout = build(spec_for("llama3-8b", tp_rank=3, tp_size=8, num_blocks=4))
    assert layout.heads_per_rank == 1
    assert layout.views[0].length == 16 * 1 * 128 * 2


def test_deepseek_v3_is_replicated_mla() -> None:
    layouts = [build(spec_for("deepseek-v3", tp_rank=r, tp_size=4, num_blocks=8)) for r in (0, 3)]
    for layout in layouts:
        assert layout.is_mla and len(layout.regions) == 61
        assert all(v.shard is Shard.REPLICATED for v in layout.views)
        assert layout.views[0].length == 64 * 576 * 2
    assert layouts[0].views == layouts[1].views


NEMOTRON_TP1 = (8192 * 3 * 2, 1024 * 3 * 2, 1024 * 3 * 2, 128 * 64 * 128 * 2)
NEMOTRON_TP4 = (2048 * 3 * 2, 256 * 3 * 2, 256 * 3 * 2, 128 * 64 * 128 * 2 // 4)


@pytest.mark.parametrize(("tp_size", "parts"), [(1, NEMOTRON_TP1), (4, NEMOTRON_TP4)])
def test_nemotron_h_state_views(tp_size: int, parts: tuple[int, ...]) -> None:
    spec = spec_for("nemotron-h", tp_rank=0, tp_size=tp_size, num_blocks=10)
    layout = build(spec)
    # 2.06 MiB (TP1) state page over 4096 B (TP1) of K+V per token -> 33 x 16 tokens
    assert spec.block_size == 528
    assert len(layout.regions) == 24  # max(4 attention, 24 Mamba2) layers share regions
    assert len(layout.attn_views) == 2 * 4
    state = layout.state_views
    assert len(state) == 24 * 4
    page = spec.page_bytes
    assert page == 528 * 2 * (8 // tp_size) * 128 * 2
    for layer in range(24):
        views = state[4 * layer : 4 * layer + 4]
        assert [v.name for v in views] == [f"S{layer}.conv{j}" for j in range(3)] + [
            f"S{layer}.ssm"
        ]
        assert tuple(v.length for v in views) == parts
        assert [v.offset for v in views] == [0, parts[0], parts[0] + parts[1], sum(parts[:3])]
        assert all(v.region == layer and v.stride == page and v.count == 10 for v in views)
        assert all(v.kind is ViewKind.STATE for v in views)
    assert describe(spec)["state_page_bytes"] == sum(parts)


def test_qwen35_gdn_block_sizes_follow_tp() -> None:
    # TP1/2: 1097728 B state page / (2048 or 1024 B per token) -> 544 tokens;
    # TP4/8: heads replicate (2 KV heads) while the state keeps shrinking.
    got = {tp: spec_for("qwen3.5-gdn", tp_size=tp, num_blocks=1).block_size for tp in (1, 2, 4, 8)}
    assert got == {1: 544, 2: 544, 4: 272, 8: 144}
    layout = build(spec_for("qwen3.5-gdn", tp_size=1, num_blocks=2))
    s0 = layout.state_views[:4]
    assert [v.length for v in s0] == [2048 * 6, 2048 * 6, 4096 * 6, 32 * 128 * 128 * 2]


BYTES_PER_BLOCK_TP1 = {
    "llama3-8b": 64 * 32768,
    "qwen-32b": 128 * 32768,
    "deepseek-v3": 61 * 64 * 576 * 2,
    "nemotron-h": 24 * 528 * 2 * 8 * 128 * 2,
    "qwen3.5-gdn": 36 * 544 * 2 * 2 * 256 * 2,
    "tiny-gqa": 8 * 16 * 4 * 64 * 2,
}


@pytest.mark.parametrize(("name", "block_bytes"), sorted(BYTES_PER_BLOCK_TP1.items()))
def test_budget_to_num_blocks(name: str, block_bytes: int) -> None:
    spec = spec_for(name, tp_size=1, kv_budget_bytes=10 * block_bytes + block_bytes - 1)
    assert spec.num_blocks == 10
    assert sum(spec.region_bytes()) == 10 * block_bytes
    assert describe(spec)["bytes_per_block"] == block_bytes
    assert spec_for(name, kv_budget_bytes=block_bytes).num_blocks == 1
    with pytest.raises(LayoutError, match="below one block"):
        spec_for(name, kv_budget_bytes=block_bytes - 1)


def test_budget_scales_with_tp() -> None:
    budget = 1 << 30
    assert spec_for("llama3-8b", tp_size=1, kv_budget_bytes=budget).num_blocks == 512
    assert spec_for("llama3-8b", tp_size=4, kv_budget_bytes=budget).num_blocks == 2048


def test_explicit_block_size_and_ppl() -> None:
    spec = spec_for("llama3-8b", num_blocks=4, block_size=32, ppl=2)
    assert (spec.block_size, spec.ppl, spec.kernel_block_bytes) == (32, 2, 16 * 8 * 128 * 2)
    # hybrid with ppl 2: kernel blocks stay multiples of 16 tokens
    hybrid = spec_for("nemotron-h", num_blocks=4, ppl=2)
    assert hybrid.block_size % 32 == 0 and hybrid.block_size == 544
    assert build(hybrid).num_descriptors == 8 * 4 * 2 + 96 * 4


def test_hybrid_explicit_block_size_too_small_raises() -> None:
    with pytest.raises(LayoutError, match="does not fit"):
        spec_for("nemotron-h", num_blocks=4, block_size=16)
    assert spec_for("nemotron-h", num_blocks=4, block_size=1024).block_size == 1024


def test_kind_and_token_layout_overrides() -> None:
    spec = spec_for(
        "tiny-gqa", num_blocks=4, kind=AttnKind.BLOCKS_FIRST, token_layout=TokenLayout.NHD
    )
    layout = build(spec)
    assert len(layout.regions) == 4 and len(layout.views) == 8
    assert layout.token_layout is TokenLayout.NHD
    with pytest.raises(LayoutError, match="cannot use"):
        spec_for("deepseek-v3", num_blocks=4, kind=AttnKind.SPLIT_KV)
    with pytest.raises(LayoutError, match="cannot use"):
        spec_for("llama3-8b", num_blocks=4, kind=AttnKind.MLA)
    with pytest.raises(LayoutError, match="BLOCKS_FIRST"):
        spec_for("nemotron-h", num_blocks=4, kind=AttnKind.SPLIT_KV)


def test_unknown_preset_lists_known_names() -> None:
    with pytest.raises(LayoutError, match="unknown preset 'llama-9b'") as info:
        spec_for("llama-9b", num_blocks=1)
    for name in REQUIRED:
        assert name in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one"),
        ({"num_blocks": 4, "kv_budget_bytes": 1 << 30}, "exactly one"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 4, "tp_size": 3}, "num_kv_heads over tp_size"),
        ({"num_blocks": 4, "tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"num_blocks": 4, "tp_size": 0}, "tp_size"),
        ({"num_blocks": 4, "block_size": 24, "ppl": 16}, "block_size over ppl"),
    ],
)
def test_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        spec_for("llama3-8b", **kwargs)  # type: ignore[arg-type]


def test_attn_block_size_for_state() -> None:
    assert attn_block_size_for_state(4096, 0) == 16
    assert attn_block_size_for_state(4096, 16 * 4096) == 16
    assert attn_block_size_for_state(4096, 16 * 4096 + 1) == 32
    assert attn_block_size_for_state(4096, 1, min_block_size=40) == 48
    assert attn_block_size_for_state(4096, 1, ppl=4) == 64
    with pytest.raises(LayoutError):
        attn_block_size_for_state(0, 1)


def test_describe_numbers() -> None:
    d = describe(spec_for("llama3-8b", tp_rank=1, tp_size=2, num_blocks=1000))
    assert d["tp"] == "1/2" and d["kind"] == "split_kv"
    assert d["num_regions"] == 64 and d["num_attn_views"] == 64 and d["num_state_views"] == 0
    assert d["num_descriptors"] == 64_000
    assert d["bytes_per_block"] == 64 * 16384 and d["bytes_per_block_human"] == "1 MiB"
    assert d["total_bytes"] == 1000 * 64 * 16384 and d["total_bytes_human"] == "1000 MiB"


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(32768) == "32 KiB"
    assert format_bytes(1536 * 1024 * 1024) == "1.5 GiB"
    assert format_bytes(1 << 50) == "1024 TiB"
