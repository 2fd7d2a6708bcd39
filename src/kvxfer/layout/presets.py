"""Model shape presets -> :class:`LayoutSpec`, sized by block count or by a KV byte budget.

Shapes are "-like": close to the named model's config, good enough to size caches,
descriptor lists and benchmarks, not to run the model. Every number's source is noted.

Example::

    spec = spec_for("llama3-8b", tp_rank=0, tp_size=2, kv_budget_bytes=8 << 30)
    sizes = spec.region_bytes()  # allocate these, then spec.build(base_addrs)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvxfer._intmath import ceil_div, require_positive
from kvxfer.errors import LayoutError
from kvxfer.layout.model import TokenLayout
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec

__all__ = [
    "PRESETS",
    "ModelShape",
    "attn_block_size_for_state",
    "describe",
    "format_bytes",
    "spec_for",
]

# vLLM aligns a hybrid model's attention block size to this many tokens
# (HybridAttentionMambaModelConfig: kernel_block_alignment_size for FlashAttention).
HYBRID_BLOCK_ALIGN_TOKENS = 16


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The cache-relevant shape of a model, all TP ranks together.

    Attributes:
        name: preset key.
        num_attn_layers: attention layers (0 for a pure state model).
        num_kv_heads: total KV heads; 1 for MLA (one latent, replicated on every rank).
        head_dim: elements per head (the latent width for MLA).
        dtype_bytes: bytes per KV element.
        kind: attention memory layout; hybrid presets use BLOCKS_FIRST.
        state: Mamba / linear-attention state, or None for attention-only models.
        block_size: default tokens per block; for hybrids, the minimum before the
            state page is fitted (see :func:`attn_block_size_for_state`).
    """

    name: str
    num_attn_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    kind: AttnKind
    state: StateSpec | None = None
    block_size: int = 16

    @property
    def is_hybrid(self) -> bool:
        return self.state is not None


_PRESET_LIST = (
    # meta-llama/Meta-Llama-3-8B config.json: num_hidden_layers 32,
    # num_key_value_heads 8, head_dim 4096/32 = 128, bfloat16.
    ModelShape("llama3-8b", 32, 8, 128, 2, AttnKind.SPLIT_KV),
    # Qwen/Qwen2.5-32B(-like): num_hidden_layers 64, num_key_value_heads 8,
    # head_dim 5120/40 = 128, bfloat16.
    ModelShape("qwen-32b", 64, 8, 128, 2, AttnKind.SPLIT_KV),
    # deepseek-ai/DeepSeek-V3: 61 layers, MLA latent kv_lora_rank 512 +
    # qk_rope_head_dim 64 = 576 elements per token, bf16 KV, replicated on every
    # TP rank; vLLM's FlashMLA backend uses 64-token blocks.
    ModelShape("deepseek-v3", 61, 1, 576, 2, AttnKind.MLA, block_size=64),
    # nvidia/Nemotron-H-8B-Base-8K-like: 4 attention layers (32 q heads, 8 KV heads,
    # head_dim 128) + 24 Mamba2 layers: mamba_num_heads 128 x mamba_head_dim 64
    # -> d_inner 8192 (x); n_groups 8 x ssm_state_size 128 = 1024 (B and C);
    # conv_kernel 4; SSM state 128 heads x 64 x 128 d_state x 2 bytes (bf16).
    ModelShape(
        "nemotron-h",
        4,
        8,
        128,
        2,
        AttnKind.BLOCKS_FIRST,
        StateSpec(24, (8192, 1024, 1024), 4, 128 * 64 * 128 * 2),
    ),
    # Qwen/Qwen3-Next-80B-A3B-like (the Qwen3.5 hybrid family): 48 layers, every
    # 4th full attention -> 12 attention layers (2 KV heads, head_dim 256) + 36
    # gated-delta-net layers: linear_num_key_heads 16 x 128 = 2048 (Q and K),
    # linear_num_value_heads 32 x 128 = 4096 (V); conv kernel 4; recurrent state
    # 32 v-heads x 128 x 128 x 2 bytes (assumed bf16; vLLM may keep it in fp32).
    ModelShape(
        "qwen3.5-gdn",
        12,
        2,
        256,
        2,
        AttnKind.BLOCKS_FIRST,
        StateSpec(36, (2048, 2048, 4096), 4, 32 * 128 * 128 * 2),
    ),
    # Small GQA model for demos and tests: 8 regions of 8 KiB per block at TP 1.
    ModelShape("tiny-gqa", 4, 4, 64, 2, AttnKind.SPLIT_KV, block_size=16),
    # Tiny stand-ins of the shapes above, for end-to-end tests (same structure, small bytes).
    ModelShape("tiny-mla", 3, 1, 64, 2, AttnKind.MLA, block_size=16),
    ModelShape(
        "tiny-mamba2", 2, 4, 32, 2, AttnKind.BLOCKS_FIRST, StateSpec(3, (128, 32, 32), 4, 4096)
    ),
    ModelShape(
        "tiny-gdn", 2, 2, 64, 2, AttnKind.BLOCKS_FIRST, StateSpec(3, (64, 64, 128), 4, 4096)
    ),
)

PRESETS: dict[str, ModelShape] = {m.name: m for m in _PRESET_LIST}


def attn_block_size_for_state(
    attn_bytes_per_token: int, state_page_bytes: int, *, min_block_size: int = 16, ppl: int = 1
) -> int:
    """Smallest hybrid block size (tokens) whose attention page holds one state page.

    Mirrors vLLM: the block is a multiple of ``16 * ppl`` tokens (so each of the
    ``ppl`` kernel blocks stays a multiple of 16) and at least ``min_block_size``.

    Args:
        attn_bytes_per_token: per-rank K+V bytes of one token of one attention layer.
        state_page_bytes: per-rank bytes of one state page (conv + SSM).
        min_block_size: lower bound in tokens (rounded up to the alignment).
        ppl: kernel blocks per logical block.

    Returns:
        The block size in tokens.
    """
    require_positive(attn_bytes_per_token, "attn_bytes_per_token")
    require_positive(ppl, "ppl")
    align = HYBRID_BLOCK_ALIGN_TOKENS * ppl
    units = max(
        ceil_div(max(min_block_size, 1), align),
        ceil_div(state_page_bytes, align * attn_bytes_per_token),
    )
    return align * units


def _shape(preset_name: str) -> ModelShape:
    try:
        return PRESETS[preset_name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise LayoutError(f"unknown preset {preset_name!r}; known presets: {known}") from None


def spec_for(
    preset_name: str,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    num_blocks: int | None = None,
    kv_budget_bytes: int | None = None,
    block_size: int | None = None,
    ppl: int = 1,
    kind: AttnKind | None = None,
    token_layout: TokenLayout = TokenLayout.HND,
) -> LayoutSpec:
    """Return the validated per-rank :class:`LayoutSpec` of a preset.

    Args:
        preset_name: a key of :data:`PRESETS`.
        tp_rank, tp_size: this rank and the engine's tensor-parallel size.
        num_blocks: logical blocks in the pool. Exactly one of this and ``kv_budget_bytes``.
        kv_budget_bytes: bytes this rank may spend on its cache (all regions);
            ``num_blocks = budget // bytes per logical block``.
        block_size: tokens per logical block. Default: the preset's; for hybrid
            presets the smallest vLLM-like size whose attention page holds a state
            page (an explicit size that is too small raises from LayoutSpec).
        ppl: attention kernel blocks per logical block.
        kind: attention layout override (MLA presets stay MLA; hybrids need BLOCKS_FIRST).
        token_layout: HND or NHD inside attention blocks.

    Raises:
        LayoutError: unknown preset, both or neither sizing argument, a budget below
            one block, or a shape LayoutSpec refuses (TP not dividing heads, ...).
    """
    shape = _shape(preset_name)
    if (num_blocks is None) == (kv_budget_bytes is None):
        raise LayoutError("give exactly one of num_blocks and kv_budget_bytes")
    if kind is None:
        kind = shape.kind
    elif (kind is AttnKind.MLA) != (shape.kind is AttnKind.MLA):
        raise LayoutError(f"preset {preset_name!r} is {shape.kind.value}; cannot use {kind.value}")
    require_positive(tp_size, "tp_size")
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank {tp_rank} not in [0, tp_size={tp_size})")
    spec = LayoutSpec(
        kind=kind,
        num_layers=shape.num_attn_layers,
        num_blocks=1,
        block_size=shape.block_size if block_size is None else block_size,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype_bytes=shape.dtype_bytes,
        tp_rank=tp_rank,
        tp_size=tp_size,
        token_layout=token_layout,
        ppl=ppl,
        state=shape.state,
    )
    if shape.state is not None and block_size is None and shape.num_attn_layers:
        # K + V of one token of one attention layer on this rank
        per_token = 2 * spec.heads_per_rank * shape.head_dim * shape.dtype_bytes
        state_page = shape.state.page_bytes(tp_size, shape.dtype_bytes)
        auto = attn_block_size_for_state(
            per_token, state_page, min_block_size=shape.block_size, ppl=ppl
        )
        spec = replace(spec, block_size=auto)
    if kv_budget_bytes is not None:
        block_bytes = sum(spec.region_bytes())  # num_blocks is 1 here
        num_blocks = kv_budget_bytes // block_bytes
        if num_blocks < 1:
            raise LayoutError(
                f"kv_budget_bytes {kv_budget_bytes} is below one block of {preset_name!r} "
                f"at tp {tp_rank}/{tp_size}: {block_bytes} bytes"
            )
    assert num_blocks is not None
    spec = replace(spec, num_blocks=num_blocks)
    spec.region_bytes()  # validate now rather than at build time
    return spec


def format_bytes(num_bytes: int) -> str:
    """``32768`` -> ``'32 KiB'``; binary units, at most two decimals."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            text = f"{value:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def describe(spec: LayoutSpec) -> dict[str, int | str]:
    """Human-readable facts about a spec, for the CLI.

    Returns:
        A flat dict: kind, tp, block_size, ppl, num_blocks, heads_per_rank,
        num_attn_layers, num_state_layers, num_regions, num_attn_views,
        num_state_views, num_descriptors, bytes_per_block (one logical block over
        all regions), total_bytes, state_page_bytes (0 without state), and
        ``*_human`` strings for the byte counts.
    """
    sizes = spec.region_bytes()
    # synthetic back-to-back bases: only the shape of the layout matters here
    bases, addr = [], 1 << 40
    for n in sizes:
        bases.append(addr)
        addr += n
    layout = spec.build(bases)
    total = sum(sizes)
    block_bytes = total // spec.num_blocks
    state_page = spec.state.page_bytes(spec.tp_size, spec.dtype_bytes) if spec.state else 0
    return {
        "kind": spec.kind.value,
        "tp": f"{spec.tp_rank}/{spec.tp_size}",
        "token_layout": spec.token_layout.value,
        "block_size": spec.block_size,
        "ppl": spec.ppl,
        "num_blocks": spec.num_blocks,
        "heads_per_rank": spec.heads_per_rank,
        "head_dim": spec.head_dim,
        "dtype_bytes": spec.dtype_bytes,
        "num_attn_layers": spec.num_layers,
        "num_state_layers": spec.state.num_layers if spec.state else 0,
        "num_regions": len(layout.regions),
        "num_attn_views": len(layout.attn_views),
        "num_state_views": len(layout.state_views),
        "num_descriptors": layout.num_descriptors,
        "bytes_per_block": block_bytes,
        "bytes_per_block_human": format_bytes(block_bytes),
        "state_page_bytes": state_page,
        "state_page_bytes_human": format_bytes(state_page),
        "total_bytes": total,
        "total_bytes_human": format_bytes(total),
    }
