"""Build a :class:`CacheLayout` from the KV tensors an engine allocated (optional torch).

torch is an optional extra (``pip install kvxfer[torch]``): it is imported inside
the functions only, so this module imports without it.

Accepted per-layer tensors (``NB`` kernel blocks, ``T = block_size // ppl`` tokens,
``H = max(1, num_kv_heads // tp_size)`` heads on this rank, ``D`` head dim; the
``H, T`` pair is written for HND and swaps to ``T, H`` for NHD)::

    SPLIT_KV      one (2, NB, T, H, D) per layer   vLLM FlashAttention; NHD by default
                  or K0, V0, K1, V1, ... each (NB, H, T, D)             HND by default
    BLOCKS_FIRST  one (NB, 2, H, T, D) per layer   FlashInfer           HND by default
    PACKED        one (NB, H, T, 2D) per layer
    MLA           one (NB, T, D) per layer         replicated latent

Every K or V tensor becomes one region (the two halves of a ``(2, NB, ...)`` tensor
are two regions); addresses come from ``data_ptr()``, sizes from
``numel() * element_size()`` and block strides from ``stride()``. The layout
borrows the tensors' memory: keep them alive while the layout is registered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvxfer._intmath import exact_div, require_positive
from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout, Region, Shard, TokenLayout, View
from kvxfer.layout.spec import AttnKind

if TYPE_CHECKING:
    import torch

__all__ = ["layout_from_kv_tensors"]


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
        raise ImportError("kvxfer.layout.tensors needs torch: pip install 'kvxfer[torch]'") from exc
    return torch


def layout_from_kv_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    kind: AttnKind,
    block_size: int,
    num_kv_heads: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    ppl: int = 1,
    token_layout: TokenLayout | None = None,
    engine_id: str = "",
) -> CacheLayout:
    """Return the layout of this rank's KV cache over already-allocated tensors.

    Args:
        tensors: per-layer tensors in layer order, shaped as in the module docstring;
            all of one shape, dtype and device, and contiguous.
        kind: the attention layout the tensors follow (CROSS_LAYER is not supported).
        block_size: tokens per logical block.
        num_kv_heads: total KV heads of the model (ignored for MLA).
        tp_rank, tp_size: this rank and the engine's tensor-parallel size.
        ppl: kernel blocks per logical block (the tensors hold kernel blocks).
        token_layout: HND or NHD inside a block; None picks the default listed above.
        engine_id: carried into the layout.

    Returns:
        A CacheLayout whose views follow the tensors' byte strides.

    Raises:
        LayoutError: unsupported kind, a tensor that is not a contiguous torch.Tensor,
            or shapes that disagree with block_size / heads (the message names the
            tensor index and both shapes).
        ImportError: torch is not installed.
    """
    torch = _import_torch()
    if not tensors:
        raise LayoutError("no tensors given")
    require_positive(tp_size, "tp_size")
    kernel_tokens = exact_div(block_size, require_positive(ppl, "ppl"), "block_size over ppl")
    heads = 1 if kind is AttnKind.MLA else max(1, num_kv_heads // tp_size)
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"tensor {i}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise LayoutError(
                f"tensor {i}: not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                "pass the tensor as allocated, not a permuted view"
            )
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise LayoutError(
                f"tensor {i}: {tuple(t.shape)} {t.dtype} on {t.device} differs from tensor 0: "
                f"{tuple(first.shape)} {first.dtype} on {first.device}"
            )
    shape = tuple(int(n) for n in first.shape)
    if len(shape) < 3:
        raise LayoutError(f"tensor 0: shape {shape} has fewer than 3 dims")
    is_fa = kind is AttnKind.SPLIT_KV and len(shape) == 5
    if token_layout is None:
        token_layout = TokenLayout.NHD if is_fa else TokenLayout.HND
    ht = (heads, kernel_tokens) if token_layout is TokenLayout.HND else (kernel_tokens, heads)
    head_dim = shape[-1]
    expected: tuple[int, ...]
    if kind is AttnKind.SPLIT_KV:
        expected = (2, shape[1], *ht, head_dim) if is_fa else (shape[0], *ht, head_dim)
    elif kind is AttnKind.BLOCKS_FIRST:
        expected = (shape[0], 2, *ht, head_dim)
    elif kind is AttnKind.PACKED:
        expected = (shape[0], *ht, head_dim)
        head_dim //= 2  # K and V side by side in the last dim
    elif kind is AttnKind.MLA:
        expected = (shape[0], kernel_tokens, head_dim)
    else:
        raise LayoutError(f"layout_from_kv_tensors does not support {kind.value}")
    if shape != expected or head_dim <= 0:
        raise LayoutError(
            f"tensor 0: shape {shape} does not match {kind.value} {token_layout.value} "
            f"{expected} (T={kernel_tokens} tokens, H={heads} heads per rank)"
        )
    if kind is AttnKind.PACKED and shape[-1] % 2:
        raise LayoutError(f"tensor 0: packed last dim {shape[-1]} is not 2 * head_dim")
    if kind is AttnKind.SPLIT_KV and not is_fa and len(tensors) % 2:
        raise LayoutError(f"separate K/V tensors come in pairs, got {len(tensors)}")
    regions, views = _regions_and_views(tensors, kind, is_fa)
    return CacheLayout(
        regions=tuple(regions),
        views=tuple(views),
        block_size=block_size,
        num_kv_heads=1 if kind is AttnKind.MLA else num_kv_heads,
        head_dim=head_dim,
        dtype_bytes=int(first.element_size()),
        tp_rank=tp_rank,
        tp_size=tp_size,
        token_layout=token_layout,
        ppl=ppl,
        is_mla=kind is AttnKind.MLA,
        engine_id=engine_id,
    )


def _region(t: torch.Tensor, index: int) -> Region:
    """One contiguous tensor as a region; CPU tensors are device 0."""
    device_id = t.device.index if t.device.index is not None else 0
    nbytes = int(t.numel()) * int(t.element_size())
    return Region(int(t.data_ptr()), nbytes, int(device_id), f"r{index}")


def _regions_and_views(
    tensors: Sequence[torch.Tensor], kind: AttnKind, is_fa: bool
) -> tuple[list[Region], list[View]]:
    """Regions in tensor order and views from byte strides (shapes already checked)."""
    regions: list[Region] = []
    views: list[View] = []
    for layer, t in enumerate(tensors):
        e = int(t.element_size())
        num = int(t.shape[1] if is_fa else t.shape[0])  # kernel blocks
        if is_fa:
            # (2, NB, T, H, D): K = t[0], V = t[1], each its own contiguous region
            for h in (0, 1):
                half = t[h]
                r = len(regions)
                regions.append(_region(half, r))
                length = math.prod(half.shape[1:]) * e
                views.append(
                    View(r, 0, length, int(half.stride(0)) * e, num, name=f"L{layer}.{'KV'[h]}")
                )
            continue
        r = len(regions)
        regions.append(_region(t, r))
        block_stride = int(t.stride(0)) * e
        if kind is AttnKind.SPLIT_KV:  # K0, V0, K1, V1, ...: tensor index = region index
            length = math.prod(t.shape[1:]) * e
            views.append(View(r, 0, length, block_stride, num, name=f"L{r // 2}.{'KV'[r % 2]}"))
        elif kind is AttnKind.BLOCKS_FIRST:
            # (NB, 2, ...): K half at offset 0, V half one stride(1) further
            half_stride, length = int(t.stride(1)) * e, math.prod(t.shape[2:]) * e
            for h in (0, 1):
                name = f"L{layer}.{'KV'[h]}"
                views.append(View(r, h * half_stride, length, block_stride, num, name=name))
        elif kind is AttnKind.PACKED:
            length = math.prod(t.shape[1:]) * e
            views.append(View(r, 0, length, block_stride, num, name=f"L{layer}.KV"))
        else:  # MLA
            length = math.prod(t.shape[1:]) * e
            views.append(
                View(
                    r, 0, length, block_stride, num, shard=Shard.REPLICATED, name=f"L{layer}.latent"
                )
            )
    return regions, views
