"""Declarative cache shapes -> region sizes -> :class:`CacheLayout` (pure).

A :class:`LayoutSpec` says what one TP rank's cache looks like without any
address. :meth:`LayoutSpec.region_bytes` tells the caller what to allocate;
:meth:`LayoutSpec.build` turns the allocated base addresses into a layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from kvxfer._intmath import exact_div, require_positive
from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout, MemKind, Region, Shard, TokenLayout, View, ViewKind

__all__ = ["AttnKind", "LayoutSpec", "StateSpec"]


class AttnKind(str, Enum):
    """How attention KV is laid out in memory."""

    SPLIT_KV = "split_kv"  # per layer: K region, V region      [NB, H, T, D] each
    BLOCKS_FIRST = "blocks_first"  # per layer: one region        [NB, 2, H, T, D]
    PACKED = "packed"  # per layer: one region                    [NB, H, T, 2D]
    MLA = "mla"  # per layer: one region, replicated latent       [NB, T, D]
    CROSS_LAYER = "cross_layer"  # one region for all layers      [NB, L, 2, H, T, D]


@dataclass(frozen=True, slots=True)
class StateSpec:
    """Mamba / linear-attention state, TP-total sizes (each rank holds 1/tp of each part).

    Attributes:
        num_layers: state layers.
        conv_cols: columns of each conv sub-projection, e.g. Mamba2 ``(x, B, C)``,
            gated delta net ``(Q, K, V)``, Mamba1 ``(x,)``.
        conv_kernel: conv kernel width; a sub-projection holds ``kernel - 1`` columns of state.
        ssm_bytes: SSM state bytes per page (all ranks together).
    """

    num_layers: int
    conv_cols: tuple[int, ...]
    conv_kernel: int
    ssm_bytes: int

    def conv_bytes(self, tp_size: int, dtype_bytes: int) -> tuple[int, ...]:
        """Per-rank bytes of each conv sub-projection: ``cols/tp * (kernel-1) * e``."""
        return tuple(
            exact_div(c, tp_size, f"conv_cols[{j}] over tp_size")
            * (self.conv_kernel - 1)
            * dtype_bytes
            for j, c in enumerate(self.conv_cols)
        )

    def page_bytes(self, tp_size: int, dtype_bytes: int) -> int:
        """Per-rank bytes of one state page: conv sub-projections then SSM state."""
        ssm = exact_div(self.ssm_bytes, tp_size, "ssm_bytes over tp_size")
        return sum(self.conv_bytes(tp_size, dtype_bytes)) + ssm


def _check_state(st: StateSpec) -> None:
    """Raise LayoutError naming the first state field out of range."""
    for name in ("num_layers", "ssm_bytes"):
        value = getattr(st, name)
        if value <= 0:
            raise LayoutError(f"state.{name} must be > 0, got {value}")
    if not st.conv_cols:
        raise LayoutError("state.conv_cols must name at least one sub-projection")
    for j, c in enumerate(st.conv_cols):
        if c <= 0:
            raise LayoutError(f"state.conv_cols[{j}] must be > 0, got {c}")
    if st.conv_kernel < 2:  # a sub-projection keeps kernel - 1 columns of state
        raise LayoutError(f"state.conv_kernel must be >= 2, got {st.conv_kernel}")


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """Shape of one TP rank's KV cache, without addresses.

    With ``state`` set, attention (``num_layers`` layers, blocks-first K/V per kernel
    block) and state layers share one pool: region ``i`` carries attention layer ``i``
    and/or state layer ``i``; a logical page is ``ppl`` kernel blocks and must hold a
    state page.
    """

    kind: AttnKind
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    tp_rank: int = 0
    tp_size: int = 1
    token_layout: TokenLayout = TokenLayout.HND
    ppl: int = 1
    state: StateSpec | None = None

    def with_rank(self, tp_rank: int, tp_size: int | None = None) -> LayoutSpec:
        return replace(self, tp_rank=tp_rank, tp_size=self.tp_size if tp_size is None else tp_size)

    @property
    def heads_per_rank(self) -> int:
        if self.kind is AttnKind.MLA:
            return 1
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def kernel_block_bytes(self) -> int:
        """Bytes of one K (or V, or MLA latent) kernel block on this rank."""
        return (
            (self.block_size // self.ppl) * self.heads_per_rank * self.head_dim * self.dtype_bytes
        )

    @property
    def page_bytes(self) -> int:
        """Bytes per logical block of one hybrid region (attention K+V of ``ppl`` kernel blocks)."""
        return 2 * self.kernel_block_bytes * self.ppl

    def _validate(self) -> None:
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype_bytes"):
            require_positive(getattr(self, name), name)
        require_positive(self.tp_size, "tp_size")
        require_positive(self.ppl, "ppl")
        if self.num_layers < 0 or (self.num_layers == 0 and self.state is None):
            raise LayoutError(f"num_layers must be > 0 without state, got {self.num_layers}")
        exact_div(self.block_size, self.ppl, "block_size over ppl")
        if self.kind is not AttnKind.MLA and self.num_kv_heads > self.tp_size:
            exact_div(self.num_kv_heads, self.tp_size, "num_kv_heads over tp_size")
        elif self.kind is not AttnKind.MLA:
            exact_div(
                self.tp_size, self.num_kv_heads, "tp_size over num_kv_heads (GQA replication)"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} not in [0, tp_size={self.tp_size})")
        if self.state is not None:
            _check_state(self.state)
            if self.kind is not AttnKind.BLOCKS_FIRST:
                raise LayoutError("hybrid pools use AttnKind.BLOCKS_FIRST attention")
            st = self.state.page_bytes(self.tp_size, self.dtype_bytes)
            if self.num_layers and st > self.page_bytes:
                raise LayoutError(
                    f"state page {st} B does not fit the attention page {self.page_bytes} B: "
                    "raise block_size"
                )

    def region_bytes(self) -> list[int]:
        """Bytes to allocate for each region, in region order."""
        self._validate()
        nb, kb = self.num_blocks, self.kernel_block_bytes
        nk = nb * self.ppl  # kernel blocks
        if self.state is not None:
            st = self.state.page_bytes(self.tp_size, self.dtype_bytes)
            page = self.page_bytes if self.num_layers else st
            return [nb * page] * max(self.num_layers, self.state.num_layers)
        if self.kind is AttnKind.SPLIT_KV:
            return [nk * kb] * (2 * self.num_layers)
        if self.kind in (AttnKind.BLOCKS_FIRST, AttnKind.PACKED):
            return [nk * 2 * kb] * self.num_layers
        if self.kind is AttnKind.MLA:
            return [nk * kb] * self.num_layers
        return [nk * 2 * kb * self.num_layers]  # CROSS_LAYER

    def build(
        self,
        base_addrs: Sequence[int],
        device_id: int = 0,
        engine_id: str = "",
        mem_kind: MemKind = MemKind.DRAM,
    ) -> CacheLayout:
        """Return the layout over regions allocated at ``base_addrs`` (one per region), all
        in ``mem_kind`` memory on ``device_id``."""
        sizes = self.region_bytes()
        if len(base_addrs) != len(sizes):
            raise LayoutError(f"expected {len(sizes)} base addresses, got {len(base_addrs)}")
        regions = tuple(
            Region(int(a), n, device_id, f"r{i}", mem_kind)
            for i, (a, n) in enumerate(zip(base_addrs, sizes, strict=True))
        )
        return CacheLayout(
            regions=regions,
            views=tuple(self._attn_views() + self._state_views()),
            block_size=self.block_size,
            num_kv_heads=1 if self.kind is AttnKind.MLA else self.num_kv_heads,
            head_dim=self.head_dim,
            dtype_bytes=self.dtype_bytes,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            token_layout=self.token_layout,
            ppl=self.ppl,
            is_mla=self.kind is AttnKind.MLA,
            is_cross_layer=self.kind is AttnKind.CROSS_LAYER,
            engine_id=engine_id,
        )

    def _attn_views(self) -> list[View]:
        kb, nk, L = self.kernel_block_bytes, self.num_blocks * self.ppl, self.num_layers
        if self.kind is AttnKind.SPLIT_KV:
            return [View(r, 0, kb, kb, nk, name=f"L{r // 2}.{'KV'[r % 2]}") for r in range(2 * L)]
        if self.kind is AttnKind.BLOCKS_FIRST:
            # virtual split: K half at offset 0, V half at kb, both strided by the full block
            return [
                View(i, h * kb, kb, 2 * kb, nk, name=f"L{i}.{'KV'[h]}")
                for i in range(L)
                for h in (0, 1)
            ]
        if self.kind is AttnKind.PACKED:
            return [View(i, 0, 2 * kb, 2 * kb, nk, name=f"L{i}.KV") for i in range(L)]
        if self.kind is AttnKind.MLA:
            return [
                View(i, 0, kb, kb, nk, shard=Shard.REPLICATED, name=f"L{i}.latent")
                for i in range(L)
            ]
        block = 2 * kb * L
        return [View(0, 0, block, block, nk, name="all_layers")]

    def _state_views(self) -> list[View]:
        st = self.state
        if st is None:
            return []
        page = self.page_bytes if self.num_layers else st.page_bytes(self.tp_size, self.dtype_bytes)
        views: list[View] = []
        for i in range(st.num_layers):
            off = 0
            parts = [*st.conv_bytes(self.tp_size, self.dtype_bytes), st.ssm_bytes // self.tp_size]
            for j, n in enumerate(parts):
                name = f"S{i}.conv{j}" if j < len(parts) - 1 else f"S{i}.ssm"
                views.append(
                    View(i, off, n, page, self.num_blocks, ViewKind.STATE, Shard.SPLIT, name)
                )
                off += n
        return views
