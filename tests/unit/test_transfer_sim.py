"""End-to-end arithmetic through a memmove seam: every layout and TP pair, byte-exact."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.layout.model import TokenLayout
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec
from tests.sim import run_case

MAMBA2 = StateSpec(num_layers=2, conv_cols=(32, 8, 8), conv_kernel=4, ssm_bytes=256)
GDN = StateSpec(num_layers=2, conv_cols=(16, 16, 32), conv_kernel=4, ssm_bytes=512)


def spec(
    kind: AttnKind,
    tp: int,
    *,
    heads: int = 4,
    block: int = 4,
    ppl: int = 1,
    state: StateSpec | None = None,
    nb: int = 12,
    layout: TokenLayout = TokenLayout.HND,
) -> LayoutSpec:
    return LayoutSpec(kind, 2, nb, block, heads, 8, 2, 0, tp, layout, ppl, state)


TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]


@pytest.mark.parametrize(
    "kind", [AttnKind.SPLIT_KV, AttnKind.BLOCKS_FIRST, AttnKind.PACKED, AttnKind.MLA]
)
@pytest.mark.parametrize(("tp_p", "tp_d"), TP_PAIRS)
def test_layouts_and_tp_pairs(kind: AttnKind, tp_p: int, tp_d: int) -> None:
    remote = spec(kind, tp_p)
    lids, rids = [3, 7, 1, 10], [5, 0, 11, 2]
    for d in range(tp_d):
        bad, req, _ = run_case(spec(kind, tp_d).with_rank(d), remote, lids, rids)
        assert bad == 0
        assert req.num_descriptors > 0


@pytest.mark.parametrize("state", [MAMBA2, GDN])
@pytest.mark.parametrize(("tp_p", "tp_d"), TP_PAIRS)
def test_hybrid_state(state: StateSpec, tp_p: int, tp_d: int) -> None:
    def hy(tp: int) -> LayoutSpec:
        return spec(AttnKind.BLOCKS_FIRST, tp, block=16, state=state)

    for d in range(tp_d):
        bad, _, _ = run_case(
            hy(tp_d).with_rank(d),
            hy(tp_p),
            [4, 2],
            [9, 3],
            local_state_ids=[6],
            remote_state_ids=[1],
        )
        assert bad == 0


def test_gqa_tp_above_heads() -> None:
    # 2 KV heads, P TP 2 -> D TP 8: each D rank holds one (replicated) head
    for d in range(8):
        bad, req, peer = run_case(
            spec(AttnKind.SPLIT_KV, 8, heads=2).with_rank(d),
            spec(AttnKind.SPLIT_KV, 2, heads=2),
            [1, 2],
            [3, 4],
        )
        assert bad == 0 and peer.tp.source_ranks == (d // 4,)


def test_fan_out_gqa_dedup() -> None:
    # 2 KV heads, P TP 4 (replicated pairs) -> D TP 1: reads P ranks 0 and 2 only
    bad, req, peer = run_case(
        spec(AttnKind.SPLIT_KV, 1, heads=2), spec(AttnKind.SPLIT_KV, 4, heads=2), [1], [2]
    )
    assert bad == 0
    assert peer.tp.source_ranks == (0, 2) and peer.notify_only == (1, 3)


@pytest.mark.parametrize("kind", [AttnKind.SPLIT_KV, AttnKind.BLOCKS_FIRST, AttnKind.PACKED])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (1, 2), (2, 4)])
def test_block_size_ratio_2(kind: AttnKind, tp_p: int, tp_d: int) -> None:
    # D blocks of 8 tokens hold 2 P blocks of 4; 5 remote blocks end inside the 3rd local block
    for d in range(tp_d):
        bad, req, peer = run_case(
            spec(kind, tp_d, block=8).with_rank(d),
            spec(kind, tp_p, block=4),
            [2, 9, 4],
            [0, 7, 3, 11, 5],
        )
        assert bad == 0 and peer.kernel_bsr == 2


@pytest.mark.parametrize(
    ("ppl_d", "ppl_p", "bd", "bp"),
    [(2, 2, 8, 8), (1, 2, 8, 16), (2, 4, 8, 16), (4, 2, 16, 8), (1, 4, 16, 16)],
)
def test_ppl_both_sides(ppl_d: int, ppl_p: int, bd: int, bp: int) -> None:
    local = spec(AttnKind.SPLIT_KV, 1, block=bd, ppl=ppl_d)
    remote = spec(AttnKind.SPLIT_KV, 1, block=bp, ppl=ppl_p)
    n_remote = 3
    n_local = -(-n_remote * bp // bd)
    lids = list(range(11, 11 - n_local, -1))
    bad, req, _ = run_case(local, remote, lids, [4, 1, 8])
    assert bad == 0


def test_prefix_hit_trims_both_sides() -> None:
    bad, req, _ = run_case(
        spec(AttnKind.SPLIT_KV, 1),
        spec(AttnKind.SPLIT_KV, 1),
        [3, 4, 5],
        [6, 7, 8],
        num_cached_blocks=1,
    )
    assert bad == 0
    # 2 layers x K,V = 4 views, 2 uncached blocks each
    assert req.num_descriptors == 8
    assert 6 not in set((req.sources[0].remote_ids % 12).tolist())


def test_nhd_same_tp_ok_and_bsr_nhd() -> None:
    nhd = TokenLayout.NHD
    bad, _, _ = run_case(
        spec(AttnKind.SPLIT_KV, 2, layout=nhd).with_rank(1),
        spec(AttnKind.SPLIT_KV, 2, layout=nhd),
        [1, 2],
        [3, 4],
    )
    assert bad == 0
    bad, _, _ = run_case(
        spec(AttnKind.SPLIT_KV, 1, block=8, layout=nhd),
        spec(AttnKind.SPLIT_KV, 1, block=4, layout=nhd),
        [1, 2],
        [3, 4, 5, 6],
    )
    assert bad == 0


def test_cross_layer_same_tp() -> None:
    bad, req, _ = run_case(
        spec(AttnKind.CROSS_LAYER, 2).with_rank(1),
        spec(AttnKind.CROSS_LAYER, 2),
        [0, 5, 6],
        [1, 2, 3],
    )
    assert bad == 0 and req.num_descriptors == 3 and req.num_runs == 2


def test_corruption_is_detected() -> None:
    """The oracle must catch a wrong head offset: swap source rank data and see bytes differ."""
    from kvxfer.planning.pairing import pair_layouts
    from kvxfer.planning.request import plan_request
    from kvxfer.testing.pattern import mismatches
    from tests.sim import alloc, transfer

    local = alloc(spec(AttnKind.SPLIT_KV, 2).with_rank(1))
    remote = {0: alloc(spec(AttnKind.SPLIT_KV, 1), pattern=True)}
    peer = pair_layouts(local.layout, {0: remote[0].layout})
    req = plan_request(peer, [1], [2])
    bad_req = type(req)(
        (type(req.sources[0])(0, req.sources[0].local_ids, req.sources[0].remote_ids + 1, 0),), ()
    )
    transfer(peer, bad_req, local, remote)
    assert mismatches(local.spec, local.bufs, remote[0].spec, [1], [2]) > 0
    assert np.all(local.bufs[0][: 2 * 4 * 8 * 2] == 0)  # block 0 untouched


def test_local_kernel_smaller_than_remote_refused() -> None:
    from kvxfer.errors import IncompatibleError

    with pytest.raises(IncompatibleError, match="not a multiple of remote 8 tokens"):
        run_case(
            spec(AttnKind.SPLIT_KV, 1, block=8, ppl=2),
            spec(AttnKind.SPLIT_KV, 1, block=8),
            [1],
            [2],
        )


@pytest.mark.parametrize(
    "kind",
    [AttnKind.SPLIT_KV, AttnKind.BLOCKS_FIRST, AttnKind.PACKED, AttnKind.MLA, AttnKind.CROSS_LAYER],
)
@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("max_run", [2, 4, 16])
def test_run_rows_coalesce_contiguous_runs(
    kind: AttnKind, tp_p: int, tp_d: int, max_run: int
) -> None:
    """Runs contiguous on both sides move as fewer, longer descriptors; bytes stay exact."""
    if kind is AttnKind.CROSS_LAYER and tp_p != tp_d:
        return
    lids = [0, 1, 2, 3, 4, 5, 6, 9, 10, 11]  # runs of 7 and 3 on the local side
    rids = [2, 3, 4, 5, 6, 7, 8, 1, 0, 11]  # runs of 7, then 1, 1, 1
    for d in range(tp_d):
        bad, req, _ = run_case(
            spec(kind, tp_d, nb=16).with_rank(d),
            spec(kind, tp_p, nb=16),
            lids,
            rids,
            max_run_blocks=max_run,
        )
        assert bad == 0
        assert req.num_descriptors <= req.num_block_descriptors
        dense_both = kind is not AttnKind.BLOCKS_FIRST and (tp_p == tp_d or kind is AttnKind.MLA)
        if dense_both:  # 7 = 4+2+1 (or 2+2+2+1 at max 2), then 3 singles
            per_view = {2: 4 + 3, 4: 3 + 3, 16: 3 + 3}[max_run]
            assert req.num_descriptors == per_view * (req.num_block_descriptors // len(lids))
        else:
            assert req.num_descriptors == req.num_block_descriptors


def test_run_rows_with_unequal_pool_sizes() -> None:
    """Run rows exist on both sides for every phase even when pools differ in size."""
    local, remote = spec(AttnKind.SPLIT_KV, 1, nb=40), spec(AttnKind.SPLIT_KV, 1, nb=7)
    for lids, rids in (([30, 31, 32, 33], [0, 1, 2, 3]), ([2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6])):
        bad, req, peer = run_case(local, remote, lids, rids, max_run_blocks=8)
        assert bad == 0
        assert req.num_descriptors < req.num_block_descriptors
        assert (peer.sources[0].run_rows[:, 3, :] == -1).all()  # 8-block level needs 15 blocks
