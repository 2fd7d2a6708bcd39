"""plan_request refuses requests that would move bytes wrongly: duplicate local ids, int32 wrap."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout, Region, View
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec
from kvxfer.planning.pairing import PeerPlan, pair_layouts
from kvxfer.planning.request import plan_request


def build(spec: LayoutSpec, base: int) -> CacheLayout:
    return spec.build([base + i * (1 << 32) for i in range(len(spec.region_bytes()))])


def peer(spec: LayoutSpec) -> PeerPlan:
    return pair_layouts(build(spec, 1 << 40), {0: build(spec, 1 << 44)})


KV = LayoutSpec(AttnKind.SPLIT_KV, 1, 8, 4, 4, 8)
HYBRID = LayoutSpec(AttnKind.BLOCKS_FIRST, 1, 10, 16, 2, 8, 2, state=StateSpec(1, (32,), 4, 256))


@pytest.mark.parametrize(
    ("lids", "rids", "match"),
    [
        ([3, 3], [1, 2], r"local_block_ids: block 3 given twice"),
        ([0, 5, 7, 5], [1, 2, 3, 4], r"local_block_ids: block 5 given twice"),
    ],
)
def test_duplicate_local_ids_refused(lids: list[int], rids: list[int], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        plan_request(peer(KV), lids, rids)


def test_duplicate_local_id_in_cached_prefix_refused() -> None:
    # block 3 is cached (not written) and also written: the cached bytes would be clobbered
    with pytest.raises(LayoutError, match="local_block_ids: block 3 given twice"):
        plan_request(peer(KV), [3, 4, 3], [1, 2, 5], num_cached_blocks=1)


def test_duplicate_local_state_ids_refused() -> None:
    with pytest.raises(LayoutError, match="local_state_ids: block 6 given twice"):
        plan_request(peer(HYBRID), [1, 2], [3, 4], local_state_ids=[6, 6], remote_state_ids=[7, 8])


def test_duplicate_remote_ids_read_the_same_block_twice() -> None:
    # legitimate: reading one remote block into two local blocks writes each local byte once
    req = plan_request(peer(KV), [1, 2], [5, 5])
    (src,) = req.sources
    assert src.local_ids.tolist() == [1, 2, 9, 10]
    assert src.remote_ids.tolist() == [5, 5, 13, 13]


def huge_peer() -> PeerPlan:
    """Three views of 2**30 one-byte blocks: a 3 x 2**30-descriptor list (no memory)."""
    n = 1 << 30

    def lay(base: int) -> CacheLayout:
        regions = tuple(Region(base + i * (1 << 32), n) for i in range(3))
        views = tuple(View(i, 0, 1, 1, n) for i in range(3))
        return CacheLayout(regions, views, block_size=1, num_kv_heads=1, head_dim=1, dtype_bytes=1)

    return pair_layouts(lay(1 << 40), {0: lay(1 << 44)})


def test_descriptor_ids_past_int32_refused() -> None:
    p = huge_peer()
    # view 2 starts at 2**31: any block of it has an index NIXL's int32 cannot carry
    with pytest.raises(LayoutError, match=r"descriptor index 2147483653 .*int32"):
        plan_request(p, [5], [5])


def test_descriptor_ids_below_int32_still_planned_on_big_lists() -> None:
    p = huge_peer()
    small = plan_request(p, np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert small.num_descriptors == 0


# In a hybrid pool a logical block holds an attention page or a state page, never
# both: region i carries attention layer i and state layer i in the same bytes.


def test_hybrid_request_without_state_ids_refused() -> None:
    # the state ids used to default to the attention ids: every attention block also
    # took that layer's state page, in the same bytes
    with pytest.raises(LayoutError, match="needs local_state_ids and remote_state_ids"):
        plan_request(peer(HYBRID), [2], [3])
    with pytest.raises(LayoutError, match="needs local_state_ids and remote_state_ids"):
        plan_request(peer(HYBRID), [2], [3], local_state_ids=[4])


@pytest.mark.parametrize(
    ("ls", "rs", "match"),
    [
        ([2], [7], "local block 2 is given as an attention block and as a state block"),
        ([6], [3], "remote block 3 is given as an attention block and as a state block"),
    ],
)
def test_hybrid_block_as_attention_and_state_refused(
    ls: list[int], rs: list[int], match: str
) -> None:
    with pytest.raises(LayoutError, match=match):
        plan_request(peer(HYBRID), [1, 2], [3, 4], local_state_ids=ls, remote_state_ids=rs)


def test_state_only_pool_takes_the_block_ids_as_state_ids() -> None:
    # no attention views: the block ids are the state blocks (nothing to confuse)
    spec = LayoutSpec(AttnKind.BLOCKS_FIRST, 0, 10, 16, 2, 8, 2, state=StateSpec(1, (32,), 4, 256))
    default = plan_request(peer(spec), [2, 5], [3, 7])
    explicit = plan_request(
        peer(spec), [2, 5], [3, 7], local_state_ids=[2, 5], remote_state_ids=[3, 7]
    )
    (d,), (e,) = default.sources, explicit.sources
    assert d.local_ids.tolist() == e.local_ids.tolist() and d.local_ids.size > 0
    assert d.remote_ids.tolist() == e.remote_ids.tolist()


def test_overlapping_regions_refused() -> None:
    # views are checked within a region; two regions sharing bytes let a K view and a
    # V view of different regions name the same bytes
    with pytest.raises(LayoutError, match=r"regions 0 and 1 overlap: \[0x100000, 0x102000\)"):
        CacheLayout(regions=(Region(1 << 20, 8192), Region((1 << 20) + 4096, 8192)),
                    views=(View(0, 0, 1024, 1024, 8), View(1, 0, 1024, 1024, 8)),
                    block_size=16, num_kv_heads=1, head_dim=32, dtype_bytes=2)  # fmt: skip
    # adjacent regions (one allocation cut per layer, as vLLM's CPU cache is) are fine
    CacheLayout(regions=(Region(1 << 20, 8192), Region((1 << 20) + 8192, 8192)),
                views=(View(0, 0, 1024, 1024, 8), View(1, 0, 1024, 1024, 8)),
                block_size=16, num_kv_heads=1, head_dim=32, dtype_bytes=2)  # fmt: skip


def test_a_request_past_the_descriptor_limit_is_refused_before_allocating() -> None:
    # 256 layers x 2 views x 131,072 kernel blocks per logical block, one block: 2**26
    # descriptors (GBs of ids) from a 400-byte plan file or a peer's record
    deep = LayoutSpec(AttnKind.BLOCKS_FIRST, 256, 1, 1 << 17, 1, 1, 1, ppl=1 << 17)
    with pytest.raises(LayoutError, match=r"67108864 descriptors .* limit of 16777216"):
        plan_request(peer(deep), [0], [0])
    # the local ids alone: one block id a million times over is refused before expanding
    wide = LayoutSpec(AttnKind.BLOCKS_FIRST, 1, 1 << 20, 1 << 10, 1, 1, 1, ppl=1 << 10)
    with pytest.raises(
        LayoutError, match=r"are 1073741824 kernel blocks, past the limit of 16777216"
    ):
        plan_request(peer(wide), list(range(1 << 20)), list(range(1 << 20)))
