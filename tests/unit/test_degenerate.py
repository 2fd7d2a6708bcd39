"""Degenerate inputs: each raises a typed error whose message names the problem."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvxfer.errors import IncompatibleError, KvxferError, LayoutError
from kvxfer.layout.model import CacheLayout, Region, Shard, View, ViewKind
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec
from kvxfer.planning.descriptors import view_rows
from kvxfer.planning.pairing import PeerPlan, pair_layouts
from kvxfer.planning.request import plan_request
from kvxfer.planning.tp import plan_tp

BASE = 1 << 40


def build(spec: LayoutSpec, base: int = BASE) -> CacheLayout:
    return spec.build([base + i * (1 << 32) for i in range(len(spec.region_bytes()))])


def kv(tp: int = 1, rank: int = 0, **kw: object) -> LayoutSpec:
    args: dict[str, object] = {
        "kind": AttnKind.SPLIT_KV,
        "num_layers": 1,
        "num_blocks": 8,
        "block_size": 4,
        "num_kv_heads": 4,
        "head_dim": 8,
        "tp_rank": rank,
        "tp_size": tp,
    }
    args.update(kw)
    return LayoutSpec(**args)  # type: ignore[arg-type]


def remotes(spec: LayoutSpec) -> dict[int, CacheLayout]:
    return {r: build(spec.with_rank(r), (1 << 44) + r * (1 << 38)) for r in range(spec.tp_size)}


def layout(regions: tuple[Region, ...], views: tuple[View, ...], **kw: object) -> CacheLayout:
    args: dict[str, object] = {"block_size": 4, "num_kv_heads": 2, "head_dim": 8, "dtype_bytes": 2}
    args.update(kw)
    return CacheLayout(regions, views, **args)  # type: ignore[arg-type]


def simple_peer() -> PeerPlan:
    return pair_layouts(build(kv()), remotes(kv()))


# ---------------------------------------------------------------- layouts


def test_no_regions() -> None:
    with pytest.raises(LayoutError, match="no regions"):
        layout((), (View(0, 0, 64, 64, 4),))


def test_no_views() -> None:
    with pytest.raises(LayoutError, match="no views"):
        layout((Region(BASE, 256),), ())
    with pytest.raises(LayoutError, match="no views"):
        view_rows(build(kv()), ())


@pytest.mark.parametrize("field", ["num_blocks", "block_size", "num_kv_heads", "head_dim"])
def test_zero_sizes_in_spec(field: str) -> None:
    with pytest.raises(LayoutError, match=f"{field} must be > 0, got 0"):
        kv(**{field: 0}).region_bytes()


def test_zero_blocks_in_view() -> None:
    with pytest.raises(LayoutError, match="count must be > 0, got 0"):
        layout((Region(BASE, 256),), (View(0, 0, 64, 64, 0),))


def test_zero_length_view() -> None:
    with pytest.raises(LayoutError, match="length 0 > 0"):
        layout((Region(BASE, 256),), (View(0, 0, 0, 64, 4),))


@pytest.mark.parametrize(("base", "size"), [(0, 256), (BASE, 0), (-1, 256)])
def test_missing_base_address_or_size(base: int, size: int) -> None:
    with pytest.raises(LayoutError, match=f"region 0: base_addr {base} and num_bytes {size}"):
        layout((Region(base, size),), (View(0, 0, 64, 64, 1),))


def test_remote_layout_with_base_0_via_spec() -> None:
    spec = kv()
    with pytest.raises(LayoutError, match="base_addr 0"):
        spec.build([BASE, 0])


def test_wrong_number_of_base_addresses() -> None:
    with pytest.raises(LayoutError, match="expected 2 base addresses, got 1"):
        kv().build([BASE])


def test_region_past_2_64() -> None:
    with pytest.raises(LayoutError, match="past 2\\*\\*64"):
        layout((Region((1 << 64) - 100, 256),), (View(0, 0, 64, 64, 1),))


def test_view_past_region_end() -> None:
    # 4 blocks of 64 B need 256 B; block 3 ends at 64 + 3*64 + 64 = 320 with offset 64
    with pytest.raises(LayoutError, match="ends at byte 320, past region 0 of 256 bytes"):
        layout((Region(BASE, 256),), (View(0, 64, 64, 64, 4, name="L0.K"),))


def test_view_on_missing_region() -> None:
    with pytest.raises(LayoutError, match="region 1 not in"):
        layout((Region(BASE, 256),), (View(1, 0, 64, 64, 4),))


def test_views_disagree_on_blocks() -> None:
    with pytest.raises(LayoutError, match="disagree on the number of logical blocks"):
        layout((Region(BASE, 512),), (View(0, 0, 64, 128, 4), View(0, 64, 64, 128, 3)))


def test_attention_after_state() -> None:
    state = View(0, 0, 32, 64, 4, ViewKind.STATE, Shard.SPLIT)
    with pytest.raises(LayoutError, match="ATTN view after a STATE view"):
        layout((Region(BASE, 256),), (state, View(0, 0, 64, 64, 4)))


def test_block_size_not_divisible_by_ppl() -> None:
    with pytest.raises(LayoutError, match="block_size over ppl: 6 is not divisible by 4"):
        kv(block_size=6, ppl=4).region_bytes()


def test_heads_not_divisible_by_tp_in_spec() -> None:
    with pytest.raises(LayoutError, match="num_kv_heads over tp_size: 6 is not divisible by 4"):
        kv(tp=4, num_kv_heads=6).region_bytes()


def test_state_page_does_not_fit() -> None:
    st = StateSpec(1, (64,), 4, 4096)
    with pytest.raises(LayoutError, match="does not fit the attention page"):
        kv(kind=AttnKind.BLOCKS_FIRST, state=st).region_bytes()


def test_state_cols_not_divisible_by_tp() -> None:
    st = StateSpec(1, (12, 6), 4, 64)
    with pytest.raises(LayoutError, match=r"conv_cols\[1\] over tp_size: 6 is not divisible by 4"):
        st.conv_bytes(4, 2)


# ---------------------------------------------------------------- pairing


def test_no_remote_records() -> None:
    with pytest.raises(LayoutError, match="no remote records"):
        pair_layouts(build(kv()), {})


def test_remote_record_missing_needed_rank() -> None:
    # D rank 1 of 2 reads P rank 1 of 2; only rank 0's record arrived
    with pytest.raises(LayoutError, match=r"no record for remote rank 1 \(have \[0\]\)"):
        pair_layouts(build(kv(2, 1)), {0: remotes(kv(2))[0]})


def test_fan_out_missing_one_source() -> None:
    all_ = remotes(kv(4))
    with pytest.raises(LayoutError, match="no record for remote rank 2"):
        pair_layouts(build(kv()), {r: all_[r] for r in (0, 1, 3)})


def test_remote_record_claims_other_rank() -> None:
    rs = remotes(kv(2))
    with pytest.raises(LayoutError, match="remote record for rank 1 claims rank 0/2"):
        pair_layouts(build(kv(2)), {0: rs[0], 1: rs[0]})


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("head_dim", 16, "head_dim differs: local 8, remote 16"),
        ("dtype_bytes", 1, "dtype_bytes differs: local 2, remote 1"),
        ("num_kv_heads", 8, "num_kv_heads differs: local 4, remote 8"),
        ("num_layers", 2, "view count differs: local 2, remote 4"),
        ("kind", AttnKind.MLA, "num_kv_heads differs: local 4, remote 1"),
        ("kind", AttnKind.CROSS_LAYER, "is_cross_layer differs: local False, remote True"),
    ],
)
def test_mismatched_model_facts(field: str, value: object, match: str) -> None:
    with pytest.raises(IncompatibleError, match=match):
        pair_layouts(build(kv()), remotes(kv(**{field: value})))  # type: ignore[arg-type]


def test_mla_against_attention() -> None:
    # MLA layouts record one KV head; with one head on both sides the MLA flag itself differs
    mla = kv(kind=AttnKind.MLA)
    with pytest.raises(IncompatibleError, match="is_mla differs: local False, remote True"):
        pair_layouts(build(kv(num_kv_heads=1)), remotes(mla))


def test_view_shapes_differ() -> None:
    # packed K/V has one view per layer, split K/V two
    with pytest.raises(IncompatibleError, match="view count differs: local 2, remote 1"):
        pair_layouts(build(kv()), remotes(kv(kind=AttnKind.PACKED)))


@pytest.mark.parametrize(("tp_d", "tp_p"), [(3, 2), (2, 3), (4, 6), (6, 4)])
def test_tp_sizes_do_not_divide(tp_d: int, tp_p: int) -> None:
    heads = 12
    with pytest.raises(IncompatibleError, match=f"local {tp_d}, remote {tp_p}"):
        pair_layouts(build(kv(tp_d, num_kv_heads=heads)), remotes(kv(tp_p, num_kv_heads=heads)))


def test_plan_tp_errors() -> None:
    with pytest.raises(
        IncompatibleError, match="TP sizes must divide each other: local 3, remote 2"
    ):
        plan_tp(0, 3, 2, 6)
    with pytest.raises(IncompatibleError, match="3 KV heads do not divide over local TP 2"):
        plan_tp(0, 2, 1, 3)
    with pytest.raises(IncompatibleError, match="remote TP 6 is not a multiple of 4 KV heads"):
        plan_tp(0, 2, 6, 4)
    with pytest.raises(LayoutError, match="local_rank 2 not in"):
        plan_tp(2, 2, 1, 4)
    with pytest.raises(LayoutError, match="remote_size must be > 0"):
        plan_tp(0, 1, 0, 4)


def hand_pair(
    local_len: int,
    remote_len: int,
    *,
    tp: tuple[int, int],
    block: tuple[int, int],
    kind: ViewKind = ViewKind.ATTN,
) -> PeerPlan:
    """Pair hand-built one-view layouts: ``tp=(local, remote)``, ``block=(local, remote)``."""
    shard = Shard.HEADS if kind is ViewKind.ATTN else Shard.SPLIT

    def side(n: int, t: int, bs: int, base: int, rank: int) -> CacheLayout:
        view = View(0, 0, n, n, 4, kind, shard, name="v0")
        return layout(
            (Region(base, 4 * n),), (view,), block_size=bs, num_kv_heads=4, tp_size=t, tp_rank=rank
        )

    local = side(local_len, tp[0], block[0], BASE, 0)
    rs = {r: side(remote_len, tp[1], block[1], (1 << 44) + (r << 36), r) for r in range(tp[1])}
    return pair_layouts(local, rs)


def test_block_bytes_not_divisible_by_tp_ratio() -> None:
    # fan-out 2 -> 1: a 129 B local block cannot be split into 2 equal pieces
    with pytest.raises(
        LayoutError, match="local block bytes over 2 sources: 129 is not divisible by 2"
    ):
        hand_pair(129, 64, tp=(1, 2), block=(4, 4))


def test_state_bytes_not_divisible_by_tp_ratio() -> None:
    with pytest.raises(
        LayoutError, match="local state bytes over TP ratio: 129 is not divisible by 2"
    ):
        hand_pair(129, 64, tp=(1, 2), block=(4, 4), kind=ViewKind.STATE)


def test_block_bytes_not_divisible_by_block_size_ratio() -> None:
    with pytest.raises(LayoutError, match="over block size ratio 2: 129 is not divisible by 2"):
        hand_pair(129, 64, tp=(1, 1), block=(8, 4))


def test_remote_block_length_mismatch() -> None:
    with pytest.raises(IncompatibleError, match="remote block 60 B != local piece 64 B"):
        hand_pair(128, 60, tp=(1, 2), block=(4, 4))
    with pytest.raises(IncompatibleError, match="remote state 100 B != local 64 B x TP ratio 2"):
        hand_pair(64, 100, tp=(2, 1), block=(4, 4), kind=ViewKind.STATE)


# ---------------------------------------------------------------- request ids


@pytest.mark.parametrize(
    ("lids", "rids", "match"),
    [
        ([-1, 2], [3, 4], r"local_block_ids: block id -1 out of range \[0, 8\)"),
        ([1, 8], [3, 4], r"local_block_ids: block id 8 out of range \[0, 8\)"),
        ([1, 2], [3, -5], r"remote_block_ids: block id -5 out of range"),
        ([1, 2], [3, 100], r"remote_block_ids: block id 100 out of range \[0, 8\)"),
        ([[1, 2]], [3, 4], r"local_block_ids must be 1-D, got shape \(1, 2\)"),
        ([1, 2], [[3], [4]], r"remote_block_ids must be 1-D, got shape \(2, 1\)"),
        (5, [3], r"local_block_ids must be 1-D, got shape \(\)"),
        ([1.0, 2.0], [3, 4], "local_block_ids must be integers, got float64"),
        ([1, 2], [3.5, 4.0], "remote_block_ids must be integers, got float64"),
        ([True, False], [3, 4], "local_block_ids must be integers, got bool"),
        ([1, 2], ["3", "4"], "remote_block_ids must be integers"),
        ([1, 2], [3], "2 local kernel blocks .* cannot hold 1 remote kernel blocks"),
        ([1], [3, 4], "1 local kernel blocks .* cannot hold 2 remote kernel blocks"),
        ([], [3], "0 local kernel blocks .* cannot hold 1 remote"),
    ],
)
def test_bad_request_ids(lids: object, rids: object, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        plan_request(simple_peer(), lids, rids)  # type: ignore[arg-type]


def test_huge_unsigned_ids_are_out_of_range() -> None:
    with pytest.raises(LayoutError, match="out of range"):
        plan_request(simple_peer(), np.array([1 << 63], dtype=np.uint64), [3])


@pytest.mark.parametrize("num_cached", [-1, 3, 10])
def test_num_cached_blocks_out_of_range(num_cached: int) -> None:
    with pytest.raises(LayoutError, match=rf"num_cached_blocks {num_cached} not in \[0, 2\]"):
        plan_request(simple_peer(), [1, 2], [3, 4], num_cached_blocks=num_cached)


def test_empty_request_is_empty_plan() -> None:
    req = plan_request(simple_peer(), [], [])
    assert req.num_descriptors == 0 and req.num_runs == 0
    req = plan_request(simple_peer(), [1, 2], [3, 4], num_cached_blocks=2)
    assert req.num_descriptors == 0


def hybrid_peer() -> PeerPlan:
    st = StateSpec(1, (32, 8, 8), 4, 256)
    spec = LayoutSpec(AttnKind.BLOCKS_FIRST, 1, 10, 16, 2, 8, 2, state=st)
    return pair_layouts(build(spec), remotes(spec))


def test_state_ids_length_and_range() -> None:
    with pytest.raises(LayoutError, match="state ids differ in length: local 2, remote 1"):
        plan_request(hybrid_peer(), [1], [2], local_state_ids=[3, 4], remote_state_ids=[5])
    with pytest.raises(LayoutError, match=r"remote_state_ids: block id 10 out of range \[0, 10\)"):
        plan_request(hybrid_peer(), [1], [2], local_state_ids=[3], remote_state_ids=[10])
    with pytest.raises(LayoutError, match="local_state_ids must be 1-D"):
        plan_request(hybrid_peer(), [1], [2], local_state_ids=[[3]], remote_state_ids=[5])


def test_errors_are_value_errors_under_the_root() -> None:
    with pytest.raises(ValueError, match="no remote records") as err:
        pair_layouts(build(kv()), {})
    assert isinstance(err.value, KvxferError)


# ---------------------------------------------------------------- regressions of bugs found (fixed)


def test_remote_ranks_disagree_on_num_blocks() -> None:
    rs = remotes(kv(2, num_blocks=40))
    rs[1] = build(kv(2, 1, num_blocks=10), (1 << 44) + (1 << 38))
    with pytest.raises(LayoutError):
        peer = pair_layouts(build(kv(num_blocks=40)), rs)
        plan_request(peer, [0], [20])  # rank 1 has only 2 x 10 descriptors; id 30 is past them


def test_remote_ranks_disagree_on_ppl() -> None:
    # rank 0: block 4, ppl 1; rank 1: block 8, ppl 2 (same 4-token kernel blocks, same bytes)
    rs = remotes(kv(2))
    rs[1] = build(replace(kv(2, 1), block_size=8, ppl=2), (1 << 44) + (1 << 38))
    with pytest.raises(IncompatibleError):
        pair_layouts(build(kv()), rs)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        # a negative state layer count used to drop the state silently (plan exit 0)
        (StateSpec(-5, (32,), 4, 256), r"state.num_layers must be > 0, got -5"),
        (StateSpec(0, (32,), 4, 256), r"state.num_layers must be > 0, got 0"),
        (StateSpec(1, (32, 0), 4, 256), r"state.conv_cols\[1\] must be > 0, got 0"),
        (StateSpec(1, (), 4, 256), r"state.conv_cols must name at least one sub-projection"),
        (StateSpec(1, (32,), 1, 256), r"state.conv_kernel must be >= 2, got 1"),
        (StateSpec(1, (32,), 4, -8), r"state.ssm_bytes must be > 0, got -8"),
    ],
)
def test_bad_state_fields_are_named(state: StateSpec, match: str) -> None:
    spec = LayoutSpec(AttnKind.BLOCKS_FIRST, 1, 10, 16, 2, 8, 2, state=state)
    with pytest.raises(LayoutError, match=match):
        spec.region_bytes()
