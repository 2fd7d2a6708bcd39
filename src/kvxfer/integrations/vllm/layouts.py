"""vLLM's KV-cache tensors as a kvxfer :class:`~kvxfer.layout.spec.LayoutSpec` plus the
region buffers the engine registers (torch imported lazily, by the caller's tensors).

Logical per-layer shapes vLLM's attention backends allocate (``NB`` blocks, ``T``
tokens per block, ``H`` KV heads on this rank, ``D`` head size); the physical order
is read from the tensor's strides, so an HND stride order of a logically NHD shape is
recognised::

    CPU_ATTN     (NB, H, T, 2D)      one slab per (block, head): HND, K then V   PACKED
    FLASH_ATTN   (2, NB, T, H, D)    K and V halves; NHD or HND strides          SPLIT_KV
    FLASHINFER   (NB, 2, T, H, D)    K and V inside each block; NHD or HND       BLOCKS_FIRST
    *MLA*        (NB, T, D)          one latent per token, replicated over TP    MLA

The buffers are NumPy ``uint8`` views of the tensors' memory (CPU memory only; the
tensors must outlive the engine that registers them, as vLLM's do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.errors import LayoutError
from kvxfer.layout.buffers import host_view
from kvxfer.layout.model import DeviceBuffer, MemKind, TokenLayout
from kvxfer.layout.spec import AttnKind, LayoutSpec

__all__ = ["backend_kind", "distinct_layers", "spec_from_vllm_tensors"]

U8 = npt.NDArray[np.uint8]

# backend -> (kind, logical dims); dims name each axis of the logical shape
_SHAPES: dict[str, tuple[AttnKind, tuple[str, ...]]] = {
    "CPU_ATTN": (AttnKind.PACKED, ("B", "H", "T", "D2")),
    "FLASH_ATTN": (AttnKind.SPLIT_KV, ("KV", "B", "T", "H", "D")),
    "FLASHINFER": (AttnKind.BLOCKS_FIRST, ("B", "KV", "T", "H", "D")),
    "MLA": (AttnKind.MLA, ("B", "T", "D")),
}


def backend_kind(backend_name: str) -> str:
    """The :data:`_SHAPES` key of a vLLM attention backend name (``LayoutError`` if none)."""
    name = backend_name.upper()
    if "MLA" in name:
        return "MLA"
    for key in ("CPU_ATTN", "FLASHINFER", "FLASH_ATTN"):
        if name.startswith(key):
            return key
    raise LayoutError(
        f"attention backend {backend_name!r} is not supported by kvxfer "
        f"(supported: CPU_ATTN, FLASH_ATTN, FLASHINFER, *MLA*)"
    )


def _physical(t: Any, dims: tuple[str, ...]) -> tuple[str, ...]:
    """Dims in memory order (outermost first); LayoutError unless dense in that order."""
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))
    expect = 1
    for i in reversed(order):
        if t.shape[i] != 1 and t.stride(i) != expect:
            raise LayoutError(
                f"KV tensor of shape {tuple(t.shape)} strides {tuple(t.stride())} is not dense"
            )
        expect *= t.shape[i]
    return tuple(dims[i] for i in order)


def distinct_layers(kv_caches: dict[str, Any]) -> list[str]:
    """The layer names of ``kv_caches`` (vLLM's ``register_kv_caches`` dict, in its order)
    whose tensors start at an address no earlier name's does: with cross-layer KV
    sharing (``kv_sharing_target_layer_name``) several layers name one tensor, whose
    bytes are registered, and moved, once. Both sides of a pair drop the same names."""
    seen: set[tuple[str, int]] = set()
    out = []
    for name, t in kv_caches.items():
        key = (str(t.device), int(t.data_ptr()))
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


def spec_from_vllm_tensors(
    tensors: Sequence[Any],
    *,
    backend: str,
    block_size: int,
    num_kv_heads: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> tuple[LayoutSpec, list[U8 | DeviceBuffer]]:
    """The layout spec and region buffers of one rank's vLLM KV cache.

    Args:
        tensors: per-layer KV tensors in layer order, as the backend allocated them.
        backend: the attention backend's name (see :func:`backend_kind`).
        block_size: tokens per block of the kernel (``T``).
        num_kv_heads: KV heads of the whole model (before TP sharding).
        tp_rank, tp_size: this worker's rank and the engine's TP size.

    Returns:
        ``(spec, bufs)``: the spec, and per region (in the spec's region order) a
        ``uint8`` view of the tensors' memory (CPU tensors) or a
        :class:`~kvxfer.layout.model.DeviceBuffer` naming it as VRAM on the tensors' GPU
        (CUDA tensors), as :class:`~kvxfer.engine.Producer` and
        :class:`~kvxfer.engine.Consumer` take them.

    Raises:
        LayoutError: an unsupported backend, a tensor neither on the CPU nor on a CUDA
            device, tensors of different shapes, dtypes or devices, or a shape or stride
            order the backend does not use (the message names the layer and the shapes).
    """
    key = backend_kind(backend)
    kind, dims = _SHAPES[key]
    if not tensors:
        raise LayoutError("no KV tensors to register")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.device.type not in ("cpu", "cuda"):
            raise LayoutError(
                f"layer {i}: KV tensor on {t.device}; kvxfer moves host (cpu) and CUDA memory"
            )
        if (
            tuple(t.shape) != tuple(first.shape)
            or t.dtype != first.dtype
            or t.device != first.device
        ):
            raise LayoutError(
                f"layer {i}: KV tensor {tuple(t.shape)} {t.dtype} on {t.device} differs from "
                f"layer 0's {tuple(first.shape)} {first.dtype} on {first.device}"
            )
        if len(t.shape) != len(dims):
            raise LayoutError(f"layer {i}: {key} KV tensors have dims {dims}, got {tuple(t.shape)}")
    size = dict(zip(dims, (int(n) for n in first.shape), strict=True))
    phys = _physical(first, dims)
    e = first.element_size()
    if kind is AttnKind.PACKED:
        ok = phys == ("B", "H", "T", "D2")
        token_layout, head_dim, heads = TokenLayout.HND, size["D2"] // 2, size["H"]
    elif kind is AttnKind.MLA:
        ok = phys == ("B", "T", "D")
        token_layout, head_dim, heads = TokenLayout.HND, size["D"], 1
    else:
        outer = ("KV", "B") if kind is AttnKind.SPLIT_KV else ("B", "KV")
        ok = (
            size["KV"] == 2 and phys[:2] == outer and phys[2:] in {("T", "H", "D"), ("H", "T", "D")}
        )
        token_layout = TokenLayout.NHD if phys[2:] == ("T", "H", "D") else TokenLayout.HND
        head_dim, heads = size["D"], size["H"]
    if not ok:
        raise LayoutError(f"{key}: KV tensors of logical dims {dims} stored as {phys} are not "
                          "a layout vLLM allocates")  # fmt: skip
    if size["T"] != block_size:
        raise LayoutError(
            f"{key}: KV tensors hold {size['T']} tokens per block, expected {block_size}"
        )
    spec = LayoutSpec(
        kind=kind,
        num_layers=len(tensors),
        num_blocks=size["B"],
        block_size=block_size,
        num_kv_heads=num_kv_heads if kind is not AttnKind.MLA else 1,
        head_dim=head_dim,
        dtype_bytes=e,
        tp_rank=tp_rank,
        tp_size=tp_size,
        token_layout=token_layout,
    )
    if kind is not AttnKind.MLA and spec.heads_per_rank != heads:
        raise LayoutError(
            f"{key}: KV tensors hold {heads} heads per rank; {num_kv_heads} heads over "
            f"tp_size {tp_size} gives {spec.heads_per_rank}"
        )
    bufs: list[U8 | DeviceBuffer] = []
    gpu = (first.device.index or 0) if first.device.type == "cuda" else None

    def region(addr: int, nbytes: int) -> U8 | DeviceBuffer:
        if gpu is None:
            return host_view(addr, nbytes)
        return DeviceBuffer(addr, nbytes, gpu, MemKind.VRAM)  # by device pointer

    for t in tensors:
        nbytes = t.numel() * e
        if kind is AttnKind.SPLIT_KV:  # K half then V half of one (2, NB, ...) tensor
            bufs += [
                region(t.data_ptr(), nbytes // 2),
                region(t.data_ptr() + nbytes // 2, nbytes // 2),
            ]
        else:
            bufs.append(region(t.data_ptr(), nbytes))
    sizes = spec.region_bytes()
    if [b.nbytes for b in bufs] != sizes:
        raise LayoutError(
            f"{key}: tensor bytes {[b.nbytes for b in bufs][:4]}... != regions {sizes[:4]}..."
        )
    return spec, bufs
