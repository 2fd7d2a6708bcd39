"""What push mode on the producer knows: a consumer engine (its agents, plans and
memory kinds, learnt from its records) and one push job. Owned by the
:class:`~kvxfer.engine.pusher.PushWorker`'s thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvxfer.engine.rank import RankCache
from kvxfer.errors import KvxferError
from kvxfer.layout.model import MemKind, region_places, single_place
from kvxfer.planning.pairing import pair_layouts
from kvxfer.planning.plans import PeerPlan
from kvxfer.transport.backend import XferHandleLike
from kvxfer.transport.nixl import PreparedList
from kvxfer.wire import LayoutRecord, PushRequest, layout_from_record

__all__ = ["ConsumerPeer", "PushJob", "consumer_peer"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ConsumerPeer:
    """A consumer engine as push mode knows it (owned by the push thread)."""

    agents: dict[int, str]  # consumer rank -> agent name
    plans: dict[int, PeerPlan]  # consumer rank -> its pairing with this producer engine
    generation: int = 0  # the consumer incarnation these agents belong to
    mem_kinds: dict[int, MemKind] = field(default_factory=dict)  # consumer rank -> memory
    lists: dict[tuple[int, int], tuple[PreparedList, PreparedList]] = field(default_factory=dict)


@dataclass(slots=True)
class PushJob:
    """One PushRequest on the producer (owned by the push thread)."""

    rank: int  # producer rank that received the request
    sender: str  # agent that sent it: the job is bound to it
    req: PushRequest
    deadline: float  # local monotonic seconds
    xfer: XferHandleLike | None = None
    fetched: bool = False  # its consumer's records were fetched once already
    parked: bool = False  # waiting for its consumer's records (still pending)
    key: tuple[int, str, int] = (0, "", 0)  # (rank, sender, attempt) as submitted
    pending: bool = True  # queued or parked: an Abort for it is remembered exactly
    cancelled: bool = False  # its WRITE runs on, but its consumer gave up (Abort, deadline)
    wrote: bool = False  # a WRITE (or its WriteDone) went to its consumer's agent


def consumer_peer(
    address: str, recs: list[LayoutRecord], ranks: dict[int, RankCache], run_blocks: int
) -> ConsumerPeer:
    """Pair the consumer engine at ``address`` (its ``recs``) with this process's producer
    ``ranks`` from the consumer's point of view, and add its agents to every rank's
    backend."""
    gens = {r.generation for r in recs}
    layouts = {r.tp_rank: layout_from_record(r) for r in recs}
    mine = {p: c.layout for p, c in ranks.items()}
    plans = {  # this process may host only some producer ranks: plan those
        d: pair_layouts(lay, mine, max_run_blocks=run_blocks, require_all=False)
        for d, lay in layouts.items()
    }
    kinds = {
        r: single_place(region_places(lay.regions), f"consumer {address} rank {r} regions")[0]
        for r, lay in layouts.items()
    }
    added: list[tuple[RankCache, str]] = []
    try:
        for cache in ranks.values():
            for rec in recs:
                added.append((cache, cache.backend.add_remote(rec.agent_metadata)))
    except BaseException:  # not installed, so nothing else would ever remove them
        for cache, name in added:
            try:
                cache.backend.remove_remote(name)
            except KvxferError as e:
                log.debug("remove_remote %s: %s", name, e)
        raise
    agents = {r.tp_rank: r.agent_name for r in recs}
    return ConsumerPeer(agents, plans, min(gens, default=0), kinds)
