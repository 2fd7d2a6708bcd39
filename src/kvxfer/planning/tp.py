"""Heterogeneous tensor-parallel plans (pure).

A decode (local) rank ``d`` of ``T_D`` ranks reads from a prefill (remote) engine of
``T_P`` ranks. ``K`` is the model's total KV head count; each side holds
``max(1, K // T)`` heads per rank (GQA replicates heads when ``T > K``).

- fan-in (``T_D >= T_P``, ``r = T_D // T_P``): one source ``d // r``; HEADS views take
  the head slice at ``d*K//T_D - p*K//T_P`` head units; SPLIT (state) views take
  slot ``d % r``; REPLICATED (MLA) views are read whole.
- fan-out (``T_P > T_D``, ``r = T_P // T_D``): candidates ``d*r .. d*r+r-1``. HEADS views
  keep the first candidate of each distinct head group (GQA dedup) and split the
  local block into one piece per kept source; SPLIT views read every candidate;
  REPLICATED views read only the first candidate. Candidates that read nothing get a
  notification only, so every producer rank learns when to free its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.errors import IncompatibleError, LayoutError

__all__ = ["Source", "TpPlan", "plan_tp"]


@dataclass(frozen=True, slots=True)
class Source:
    """What local rank reads from one remote rank.

    Attributes:
        rank: the remote (producer) rank.
        head_slot, num_head_slots: this source's piece of a local HEADS block (fan-out),
            ``(0, 1)`` for fan-in. ``num_head_slots == 0`` means no HEADS views are read.
        head_offset: fan-in only: head units into the remote HEADS block.
        split_slot, num_split_slots: fan-in: the slice ``d % r`` of ``r`` of the remote
            SPLIT page; fan-out: this source's piece ``s`` of ``r`` of the local page.
        reads_replicated: whether REPLICATED (MLA) views are read from this source.
    """

    rank: int
    head_slot: int
    num_head_slots: int
    head_offset: int
    split_slot: int
    num_split_slots: int
    reads_replicated: bool

    @property
    def reads_heads(self) -> bool:
        return self.num_head_slots > 0


@dataclass(frozen=True, slots=True)
class TpPlan:
    """The sources of one local rank; see the module docstring.

    Attributes:
        local_rank, local_size, remote_size, num_kv_heads: the inputs.
        sources: remote ranks read, ascending.
        notify_only: remote ranks in this rank's group that read nothing but must be told.
        consumers_per_producer: reads (or notices) each producer rank expects per request.
    """

    local_rank: int
    local_size: int
    remote_size: int
    num_kv_heads: int
    sources: tuple[Source, ...]
    notify_only: tuple[int, ...]

    @property
    def is_fan_out(self) -> bool:
        return self.remote_size > self.local_size

    @property
    def ratio(self) -> int:
        """``T_D / T_P`` for fan-in, ``T_P / T_D`` for fan-out."""
        big, small = max(self.local_size, self.remote_size), min(self.local_size, self.remote_size)
        return big // small

    @property
    def consumers_per_producer(self) -> int:
        return max(1, self.local_size // self.remote_size)

    @property
    def source_ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.sources)


def _first_head(rank: int, size: int, num_kv_heads: int) -> int:
    """Index of the first KV head held by ``rank`` of ``size`` ranks."""
    return rank * num_kv_heads // size


def plan_tp(
    local_rank: int,
    local_size: int,
    remote_size: int,
    num_kv_heads: int,
    *,
    has_heads: bool = True,
    has_replicated: bool = False,
    has_split: bool = False,
) -> TpPlan:
    """Return the TP plan of ``local_rank`` reading from an engine of ``remote_size`` ranks.

    Args:
        local_rank, local_size: this (consumer) rank and its TP size.
        remote_size: the producer engine's TP size.
        num_kv_heads: total KV heads of the model (1 for MLA).
        has_heads, has_replicated, has_split: which view shards the layout has.

    Raises:
        LayoutError: a size or rank out of range.
        IncompatibleError: TP sizes that do not divide each other, or heads that do
            not divide across ranks.
    """
    for name, v in (
        ("local_size", local_size),
        ("remote_size", remote_size),
        ("num_kv_heads", num_kv_heads),
    ):
        if v <= 0:
            raise LayoutError(f"{name} must be > 0, got {v}")
    if not 0 <= local_rank < local_size:
        raise LayoutError(f"local_rank {local_rank} not in [0, {local_size})")
    big, small = max(local_size, remote_size), min(local_size, remote_size)
    if big % small:
        raise IncompatibleError(
            f"TP sizes must divide each other: local {local_size}, remote {remote_size}"
        )
    if has_heads:
        for name, t in (("local", local_size), ("remote", remote_size)):
            if t < num_kv_heads and num_kv_heads % t:
                raise IncompatibleError(f"{num_kv_heads} KV heads do not divide over {name} TP {t}")
            if t > num_kv_heads and t % num_kv_heads:
                raise IncompatibleError(
                    f"{name} TP {t} is not a multiple of {num_kv_heads} KV heads"
                )
    r = big // small
    if remote_size <= local_size:
        p = local_rank // r
        head_offset = _first_head(local_rank, local_size, num_kv_heads) - _first_head(
            p, remote_size, num_kv_heads
        )
        src = Source(
            rank=p,
            head_slot=0,
            num_head_slots=1 if has_heads else 0,
            head_offset=head_offset if has_heads else 0,
            split_slot=local_rank % r,
            num_split_slots=r if has_split else 0,
            reads_replicated=has_replicated,
        )
        return TpPlan(local_rank, local_size, remote_size, num_kv_heads, (src,), ())
    candidates = [local_rank * r + s for s in range(r)]
    head_ranks: list[int] = []
    if has_heads:
        seen: set[int] = set()
        for c in candidates:  # GQA dedup: first rank of each distinct head group
            h = _first_head(c, remote_size, num_kv_heads)
            if h not in seen:
                seen.add(h)
                head_ranks.append(c)
    sources: list[Source] = []
    notify: list[int] = []
    for s, c in enumerate(candidates):
        reads_heads = c in head_ranks
        reads_repl = has_replicated and s == 0
        if not (reads_heads or reads_repl or has_split):
            notify.append(c)
            continue
        sources.append(
            Source(
                rank=c,
                head_slot=head_ranks.index(c) if reads_heads else 0,
                num_head_slots=len(head_ranks) if reads_heads else 0,
                head_offset=0,
                split_slot=s,
                num_split_slots=r if has_split else 0,
                reads_replicated=reads_repl,
            )
        )
    return TpPlan(local_rank, local_size, remote_size, num_kv_heads, tuple(sources), tuple(notify))
