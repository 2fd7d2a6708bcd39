"""Regions, strided views and cache layouts: pure data, no I/O.

A *region* is one contiguous registered buffer. A *view* is a strided family of
per-block descriptors over one region::

    addr(b) = region.base_addr + view.offset + b * view.stride,  len = view.length,
    for b in [0, view.count)

A :class:`CacheLayout` is what one TP rank of one engine exposes: its regions, its
views in descriptor order (all attention views first, then all state views) and
the model facts a planner needs to pair two layouts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import numpy.typing as npt

from kvxfer.errors import ConfigError, LayoutError
from kvxfer.layout.overlap import check_views_disjoint

__all__ = [
    "CacheLayout",
    "DeviceBuffer",
    "MemKind",
    "Region",
    "Shard",
    "TokenLayout",
    "View",
    "ViewKind",
    "region_places",
    "single_place",
]

MAX_ADDR = (1 << 64) - 1


class MemKind(str, Enum):
    """Where a region lives: host memory (DRAM) or GPU memory (VRAM, ``device_id`` = GPU)."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class TokenLayout(str, Enum):
    """Order of dims inside one attention block: heads outer (HND) or tokens outer (NHD)."""

    HND = "HND"
    NHD = "NHD"


class ViewKind(str, Enum):
    """What a view's blocks are: attention kernel blocks or per-logical-block state pages."""

    ATTN = "attn"
    STATE = "state"


class Shard(str, Enum):
    """How a view's bytes are divided among TP ranks.

    HEADS: a block holds this rank's KV heads, outermost (sliced by head for hetero TP).
    REPLICATED: every rank holds the same bytes (MLA latent); read from one rank only.
    SPLIT: evenly sharded by TP rank whatever the head count (Mamba conv / SSM state).
    """

    HEADS = "heads"
    REPLICATED = "replicated"
    SPLIT = "split"


@dataclass(frozen=True, slots=True)
class Region:
    """One contiguous registered buffer: ``num_bytes`` at ``base_addr`` on ``device_id``
    (the GPU index for VRAM) in memory of kind ``mem_kind``."""

    base_addr: int
    num_bytes: int
    device_id: int = 0
    name: str = ""
    mem_kind: MemKind = MemKind.DRAM


@dataclass(frozen=True, slots=True)
class DeviceBuffer:
    """Memory an engine uses by address, not as a NumPy array: e.g. one region of a GPU's
    KV cache by device pointer (``torch.Tensor.data_ptr()``), ``device_id`` the GPU index.

    The engines take these where they take ``uint8`` arrays, one per region; the caller
    keeps the memory alive while an engine has it registered. ``mem_kind`` tells the
    transport how to register and move it (VRAM needs a NIXL whose UCX has CUDA).
    """

    addr: int
    nbytes: int
    device_id: int = 0
    mem_kind: MemKind = MemKind.VRAM

    def __post_init__(self) -> None:
        for name in ("addr", "nbytes", "device_id"):
            value = getattr(self, name)
            low = -1 if name == "device_id" else 0
            if not isinstance(value, int) or isinstance(value, bool) or value <= low:
                raise LayoutError(f"DeviceBuffer {name} must be an int > {low}, got {value!r}")
        if self.addr + self.nbytes > MAX_ADDR + 1:
            raise LayoutError(f"DeviceBuffer [{self.addr:#x}, +{self.nbytes}) passes 2^64")
        try:
            object.__setattr__(self, "mem_kind", MemKind(self.mem_kind))
        except ValueError:
            raise ConfigError(
                f"DeviceBuffer mem_kind must be one of DRAM, VRAM, got {self.mem_kind!r}"
            ) from None


def single_place(places: Iterable[tuple[MemKind, int]], who: str) -> tuple[MemKind, int]:
    """The one ``(mem_kind, device_id)`` that all of a rank's memory shares (its regions'
    or its buffers').

    Raises:
        ConfigError: they span memory kinds or devices (a rank's cache lives in one
            place; the transport prepares each list under one kind).
    """
    found = sorted({(MemKind(k).value, d) for k, d in places})
    if len(found) != 1:
        raise ConfigError(
            f"{who} span {found}: a rank's cache must be in one memory kind on one device"
        )
    return MemKind(found[0][0]), found[0][1]


def region_places(regions: Sequence[Region]) -> list[tuple[MemKind, int]]:
    """``(mem_kind, device_id)`` of each region, for :func:`single_place`."""
    return [(r.mem_kind, r.device_id) for r in regions]


@dataclass(frozen=True, slots=True)
class View:
    """A strided family of ``count`` descriptors of ``length`` bytes over region ``region``.

    Block ``b`` starts at ``offset + b * stride`` bytes into the region.
    """

    region: int
    offset: int
    length: int
    stride: int
    count: int
    kind: ViewKind = ViewKind.ATTN
    shard: Shard = Shard.HEADS
    name: str = ""

    @property
    def is_dense(self) -> bool:
        """True when consecutive blocks touch (``stride == length``) and so can merge."""
        return self.stride == self.length


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The KV cache of one TP rank of one engine.

    Attributes:
        regions: registered buffers, indexed by ``View.region``.
        views: descriptor order; all ATTN views, then all STATE views.
        block_size: tokens per logical block.
        num_kv_heads: total KV heads of the model (all ranks); 1 for MLA.
        head_dim: elements per head (the latent width for MLA).
        dtype_bytes: bytes per element.
        tp_rank, tp_size: this rank and the engine's tensor-parallel size.
        token_layout: HND or NHD inside attention blocks.
        ppl: attention kernel blocks per logical block (ATTN view counts are kernel blocks).
        is_mla: attention views hold a replicated latent (Shard.REPLICATED).
        is_cross_layer: one view holds every layer of a block (heads are not outermost).
    """

    regions: tuple[Region, ...]
    views: tuple[View, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    tp_rank: int = 0
    tp_size: int = 1
    token_layout: TokenLayout = TokenLayout.HND
    ppl: int = 1
    is_mla: bool = False
    is_cross_layer: bool = False
    engine_id: str = field(default="", compare=False)
    view_table: npt.NDArray[np.uint64] = field(init=False, repr=False, compare=False)
    view_classes: npt.NDArray[np.int64] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.check_integrity()
        base = [(r.base_addr, r.device_id) for r in self.regions]
        table = np.array(  # (V, 5) uint64: addr of block 0, len, dev, stride, count
            [
                (base[v.region][0] + v.offset, v.length, base[v.region][1], v.stride, v.count)
                for v in self.views
            ],
            dtype=np.uint64,
        )
        table.flags.writeable = False  # shared: callers copy before changing
        object.__setattr__(self, "view_table", table)
        kinds, shards = list(ViewKind), list(Shard)  # (V,) class id = kind * 8 + shard
        classes = np.array([kinds.index(v.kind) * 8 + shards.index(v.shard) for v in self.views])
        classes.flags.writeable = False
        object.__setattr__(self, "view_classes", classes.astype(np.int64))

    @property
    def heads_per_rank(self) -> int:
        """KV heads held by this rank: ``max(1, K // T)`` (GQA replicates when T > K)."""
        if self.is_mla:
            return 1
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def state_mask(self) -> npt.NDArray[np.bool_]:
        """``(V,) bool``: which views are STATE views (from ``view_classes``)."""
        return self.view_classes // 8 == list(ViewKind).index(ViewKind.STATE)  # type: ignore[no-any-return]

    @property
    def kernel_block_size(self) -> int:
        """Tokens per attention kernel block (``block_size // ppl``)."""
        return self.block_size // self.ppl

    @property
    def attn_views(self) -> tuple[View, ...]:
        return tuple(v for v in self.views if v.kind is ViewKind.ATTN)

    @property
    def state_views(self) -> tuple[View, ...]:
        return tuple(v for v in self.views if v.kind is ViewKind.STATE)

    @property
    def num_logical_blocks(self) -> int:
        """Logical blocks in the pool (from the first view)."""
        v = self.views[0]
        return v.count // self.ppl if v.kind is ViewKind.ATTN else v.count

    @property
    def num_descriptors(self) -> int:
        """Length of the flat (dense) descriptor list: the sum of view counts."""
        return sum(v.count for v in self.views)

    def view_addr(self, view_index: int) -> int:
        """Absolute address of block 0 of view ``view_index``."""
        v = self.views[view_index]
        return self.regions[v.region].base_addr + v.offset

    def check_integrity(self) -> None:
        """Raise LayoutError naming the first field or numbers that disagree.

        Besides each field and each view alone, views of one kind in one region must not
        share a byte in any pair of blocks (a V view over its K view, a state page larger
        than its stride): one request would write the same local bytes twice.
        """
        if not self.regions:
            raise LayoutError("layout has no regions")
        if not self.views:
            raise LayoutError("layout has no views")
        for name in ("block_size", "num_kv_heads", "head_dim", "dtype_bytes", "tp_size", "ppl"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise LayoutError(f"{name} must be a positive int, got {value!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} not in [0, tp_size={self.tp_size})")
        big, small = max(self.num_kv_heads, self.tp_size), min(self.num_kv_heads, self.tp_size)
        if not self.is_mla and big % small:
            raise LayoutError(
                f"num_kv_heads {self.num_kv_heads} and tp_size {self.tp_size} must divide each other"
            )
        if self.block_size % self.ppl:
            raise LayoutError(f"block_size {self.block_size} not divisible by ppl {self.ppl}")
        for i, r in enumerate(self.regions):
            if r.base_addr <= 0 or r.num_bytes <= 0:
                raise LayoutError(
                    f"region {i}: base_addr {r.base_addr} and num_bytes {r.num_bytes} must be > 0"
                )
            if r.base_addr + r.num_bytes > MAX_ADDR:
                raise LayoutError(f"region {i}: ends past 2**64")
            if r.device_id < 0:
                raise LayoutError(f"region {i}: device_id {r.device_id} < 0")
        self._check_regions_disjoint()
        seen_state = False
        for i, v in enumerate(self.views):
            self._check_view(i, v)
            if v.kind is ViewKind.STATE:
                seen_state = True
            elif seen_state:
                raise LayoutError(f"view {i}: ATTN view after a STATE view (attention first)")
        counts = {v.count // self.ppl if v.kind is ViewKind.ATTN else v.count for v in self.views}
        if len(counts) != 1:
            raise LayoutError(f"views disagree on the number of logical blocks: {sorted(counts)}")
        groups: dict[tuple[int, ViewKind], list[int]] = {}
        for i, v in enumerate(self.views):  # ATTN and STATE views may share pages (hybrid)
            groups.setdefault((v.region, v.kind), []).append(i)
        for (region, _), idx in groups.items():
            if len(idx) > 1:
                check_views_disjoint(region, self.views, idx)

    def _check_regions_disjoint(self) -> None:
        """Two regions sharing bytes would let views of different regions (a K view and
        a V view, two layers) name the same bytes; the per-region view checks cannot
        see that."""
        order = sorted(range(len(self.regions)),
                       key=lambda i: (self.regions[i].device_id, self.regions[i].base_addr))  # fmt: skip
        for a, b in itertools.pairwise(order):
            ra, rb = self.regions[a], self.regions[b]
            if ra.device_id == rb.device_id and rb.base_addr < ra.base_addr + ra.num_bytes:
                raise LayoutError(
                    f"regions {min(a, b)} and {max(a, b)} overlap: [{ra.base_addr:#x}, "
                    f"{ra.base_addr + ra.num_bytes:#x}) and [{rb.base_addr:#x}, "
                    f"{rb.base_addr + rb.num_bytes:#x}) on device {ra.device_id}"
                )

    def _check_view(self, i: int, v: View) -> None:
        if not 0 <= v.region < len(self.regions):
            raise LayoutError(f"view {i}: region {v.region} not in [0, {len(self.regions)})")
        if v.count <= 0:
            raise LayoutError(f"view {i} ({v.name}): count must be > 0, got {v.count}")
        if v.length <= 0 or v.offset < 0 or v.stride < 0:
            raise LayoutError(
                f"view {i} ({v.name}): length {v.length} > 0, offset {v.offset} >= 0 "
                f"and stride {v.stride} >= 0 required"
            )
        if v.count > 1 and v.stride < v.length:
            raise LayoutError(
                f"view {i} ({v.name}): stride {v.stride} < length {v.length}: blocks would overlap"
            )
        if v.kind is ViewKind.ATTN and v.count % self.ppl:
            raise LayoutError(f"view {i} ({v.name}): count {v.count} not divisible by ppl")
        if v.kind is ViewKind.STATE and v.shard is not Shard.SPLIT:
            raise LayoutError(f"view {i} ({v.name}): STATE views must be Shard.SPLIT")
        if self.is_mla and v.kind is ViewKind.ATTN and v.shard is not Shard.REPLICATED:
            raise LayoutError(f"view {i} ({v.name}): MLA attention views must be REPLICATED")
        end = v.offset + (v.count - 1) * v.stride + v.length
        size = self.regions[v.region].num_bytes
        if end > size:
            raise LayoutError(
                f"view {i} ({v.name}): last block ends at byte {end}, past region "
                f"{v.region} of {size} bytes"
            )
