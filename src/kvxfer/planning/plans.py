"""What pairing two engines' layouts yields (pure values): :class:`PeerPlan`, one per
local rank, with a :class:`SourcePlan` of matched rows per source rank. Built by
:func:`kvxfer.planning.pairing.pair_layouts`; request ids are mapped onto the rows by
:mod:`kvxfer.planning.request`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxfer.planning.descriptors import U64, row_starts
from kvxfer.planning.tp import TpPlan

__all__ = ["PeerPlan", "SourcePlan"]


@dataclass(frozen=True, slots=True, eq=False)
class SourcePlan:
    """Matched rows for one source rank.

    Attributes:
        rank: the remote rank.
        local_rows, remote_rows: ``(R, 5) uint64`` strided rows; row ``j`` of each side
            moves the same bytes (equal ``len``) for paired blocks.
        row_view: ``(R,) int64`` local view index of each row.
        row_sub: ``(R,) int64`` block-size-ratio sub-block ``k`` of each ATTN row (0 for STATE).
        row_is_state: ``(R,) bool``.
        local_starts, remote_starts: ``(R + 1,) int64`` flat index of block 0 of each row.
        num_base_rows: rows ``[0, num_base_rows)`` hold one block per descriptor. The rows
            after them are *run rows*: for a base row dense on both sides
            (``stride == len``), level ``k`` repeats it with ``len * 2**k`` and
            ``count - 2**k + 1``, so a run of ``2**k`` blocks contiguous on both sides
            moves as one descriptor (see :func:`kvxfer.planning.pairing.with_run_rows`). ``run_rows[j, k, p]`` is
            the row of base row ``j`` at level ``k``, phase ``p`` (``run_rows[j, 0, 0] == j``;
            -1 where absent).
    """

    rank: int
    local_rows: U64
    remote_rows: U64
    row_view: npt.NDArray[np.int64]
    row_sub: npt.NDArray[np.int64]
    row_is_state: npt.NDArray[np.bool_]
    num_base_rows: int = -1
    run_rows: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros((0, 1, 1), np.int64))
    local_starts: npt.NDArray[np.int64] = field(init=False)
    remote_starts: npt.NDArray[np.int64] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_base_rows < 0:
            object.__setattr__(self, "num_base_rows", int(self.local_rows.shape[0]))
        if self.run_rows.shape[0] != self.num_base_rows:
            ident = np.arange(self.num_base_rows, dtype=np.int64)[:, None, None]
            object.__setattr__(self, "run_rows", ident)
        object.__setattr__(self, "local_starts", row_starts(self.local_rows))
        object.__setattr__(self, "remote_starts", row_starts(self.remote_rows))

    @property
    def num_rows(self) -> int:
        return int(self.local_rows.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class PeerPlan:
    """How one local rank reads a remote engine.

    Attributes:
        tp: the TP plan.
        sources: one :class:`SourcePlan` per source rank, in ``tp.sources`` order.
        kernel_bsr: local kernel block tokens / remote kernel block tokens (>= 1).
        local_ppl, remote_ppl: kernel blocks per logical block on each side.
        local_num_blocks, remote_num_blocks: logical blocks in each side's pool.
    """

    tp: TpPlan
    sources: tuple[SourcePlan, ...]
    kernel_bsr: int
    local_ppl: int
    remote_ppl: int
    local_num_blocks: int
    remote_num_blocks: int

    @property
    def notify_only(self) -> tuple[int, ...]:
        return self.tp.notify_only
