"""Worked examples: addresses, offsets, lengths and ids written by hand from docs/domain notes.

Every expected number below is derived in the comments from the domain formulas
(block bytes ``T*H*D*e``, fan-in offset ``(d mod r) * local_len``, GQA head offset
``d*K//T_D - p*K//T_P``, conv sub-projection ``cols/tp * (kernel-1) * e`` ...), not from
the code under test. Fake base addresses: no memory is touched.
"""

from __future__ import annotations

import numpy as np

from kvxfer.layout.model import CacheLayout, Shard, ViewKind
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec
from kvxfer.planning.descriptors import dense_rows
from kvxfer.planning.pairing import PeerPlan, SourcePlan, pair_layouts
from kvxfer.planning.request import SourceIds, plan_request
from kvxfer.planning.tp import plan_tp

GiB4 = 1 << 32
LB = 1 << 40  # local region i at LB + i * GiB4


def RB(rank: int, region: int = 0) -> int:
    """Base of remote rank ``rank``'s region ``region``."""
    return (1 << 44) + rank * (1 << 38) + region * GiB4


def build_local(spec: LayoutSpec) -> CacheLayout:
    return spec.build([LB + i * GiB4 for i in range(len(spec.region_bytes()))])


def build_remote(spec: LayoutSpec, rank: int) -> CacheLayout:
    s = spec.with_rank(rank)
    return s.build([RB(rank, i) for i in range(len(s.region_bytes()))])


def pair(local: LayoutSpec, remote: LayoutSpec) -> PeerPlan:
    remotes = {r: build_remote(remote, r) for r in range(remote.tp_size)}
    return pair_layouts(build_local(local), remotes)


def rows(a: np.ndarray) -> list[list[int]]:
    return [[int(x) for x in r] for r in a.tolist()]


def pairs(ids: SourceIds) -> list[tuple[int, int]]:
    """(local id, remote id) pairs sorted by local id."""
    return sorted(zip(ids.local_ids.tolist(), ids.remote_ids.tolist(), strict=True))


def assert_view_major(src: SourcePlan, ids: SourceIds) -> None:
    """Ids are grouped by row (view-major): the row of each local id never decreases."""
    row = np.searchsorted(src.local_starts, ids.local_ids, side="right") - 1
    assert (np.diff(row) >= 0).all()


def kv(
    kind: AttnKind, tp: int, *, heads: int = 4, block: int = 4, nb: int = 8, **kw: object
) -> LayoutSpec:
    return LayoutSpec(kind, 1, nb, block, heads, 8, 2, 0, tp, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- split K/V fan-in


def test_split_kv_fan_in_1_to_2() -> None:
    # K=4 heads, D=8, bf16, block 4: one head of one block = 4*8*2 = 64 B.
    # P TP1 holds 4 heads: 256 B per block. D TP2 holds 2 heads: 128 B per block.
    # D rank 1 reads P rank 0, head slice 1 of 2: remote offset 1*128, len 128, stride 256.
    peer = pair(kv(AttnKind.SPLIT_KV, 2).with_rank(1), kv(AttnKind.SPLIT_KV, 1))
    assert peer.tp.source_ranks == (0,) and peer.notify_only == ()
    assert peer.tp.consumers_per_producer == 2
    (src,) = peer.sources
    # rows: (addr, len, dev, stride, count); views K (region 0), V (region 1), 8 blocks each
    assert rows(src.local_rows) == [[LB, 128, 0, 128, 8], [LB + GiB4, 128, 0, 128, 8]]
    assert rows(src.remote_rows) == [
        [RB(0, 0) + 128, 128, 0, 256, 8],
        [RB(0, 1) + 128, 128, 0, 256, 8],
    ]
    # 2-block request: local [3, 5] <- remote [6, 1]; V ids are offset by 8 (K's count)
    req = plan_request(peer, [3, 5], [6, 1])
    (ids,) = req.sources
    assert ids.local_ids.tolist() == [3, 5, 11, 13]
    assert ids.remote_ids.tolist() == [6, 1, 14, 9]
    assert ids.num_runs == 4  # remote rows are head slices (stride != len): nothing merges
    # D rank 0 takes the first half of each P block
    (src0,) = pair(kv(AttnKind.SPLIT_KV, 2), kv(AttnKind.SPLIT_KV, 1)).sources
    assert rows(src0.remote_rows)[0] == [RB(0, 0), 128, 0, 256, 8]


def test_split_kv_fan_in_2_to_4() -> None:
    # P TP2: 2 heads, 128 B/block. D TP4: 1 head, 64 B/block. r = 2.
    # D rank 3 -> P rank 1, slice 3 mod 2 = 1: offset 64; D rank 2 -> P rank 1, offset 0.
    for d, p, off in [(0, 0, 0), (1, 0, 64), (2, 1, 0), (3, 1, 64)]:
        peer = pair(kv(AttnKind.SPLIT_KV, 4).with_rank(d), kv(AttnKind.SPLIT_KV, 2))
        (src,) = peer.sources
        assert src.rank == p
        assert rows(src.local_rows) == [[LB, 64, 0, 64, 8], [LB + GiB4, 64, 0, 64, 8]]
        assert rows(src.remote_rows) == [
            [RB(p, 0) + off, 64, 0, 128, 8],
            [RB(p, 1) + off, 64, 0, 128, 8],
        ]
        (ids,) = plan_request(peer, [0, 7], [2, 3]).sources
        assert pairs(ids) == [(0, 2), (7, 3), (8, 10), (15, 11)]


def test_dense_equal_tp_merges_runs() -> None:
    # equal TP, dense both sides: consecutive blocks on both sides merge into one run per view
    peer = pair(kv(AttnKind.SPLIT_KV, 1), kv(AttnKind.SPLIT_KV, 1))
    (ids,) = plan_request(peer, [2, 3, 4], [5, 6, 7]).sources
    assert pairs(ids) == [(2, 5), (3, 6), (4, 7), (10, 13), (11, 14), (12, 15)]
    assert ids.num_descriptors == 6 and ids.num_runs == 2


# ---------------------------------------------------------------- fan-out with local splits


def test_split_kv_fan_out_2_to_1() -> None:
    # P TP2: 2 heads, 128 B/block; D TP1: 4 heads, 256 B/block. Two sources; D splits each
    # local block into 2 pieces: source s at local offset s * 256/2, len 128, stride 256.
    peer = pair(kv(AttnKind.SPLIT_KV, 1), kv(AttnKind.SPLIT_KV, 2))
    assert peer.tp.source_ranks == (0, 1) and peer.notify_only == ()
    assert peer.tp.consumers_per_producer == 1
    for s, src in enumerate(peer.sources):
        assert rows(src.local_rows) == [
            [LB + s * 128, 128, 0, 256, 8],
            [LB + GiB4 + s * 128, 128, 0, 256, 8],
        ]
        assert rows(src.remote_rows) == [[RB(s, 0), 128, 0, 128, 8], [RB(s, 1), 128, 0, 128, 8]]
    req = plan_request(peer, [2], [5])
    for ids in req.sources:
        assert pairs(ids) == [(2, 5), (10, 13)] and ids.num_runs == 2
    # the two pieces of local block 2 of K: [LB+512, +128) and [LB+640, +128), together 256 B
    got = sorted(
        (int(a), int(n))
        for src, ids in zip(peer.sources, req.sources, strict=True)
        for a, n, _ in dense_rows(src.local_rows)[ids.local_ids[:1]].tolist()
    )
    assert got == [(LB + 512, 128), (LB + 640, 128)]


def test_blocks_first_fan_out_2_to_1() -> None:
    # blocks-first [NB, 2, H, T, D]: K half at 0, V half at 256 of a 512 B block (TP1, 4 heads).
    # Source s writes K piece at s*128 and V piece at 256 + s*128; remote halves are 128 B
    # at 0 and 128 of a 256 B block.
    peer = pair(kv(AttnKind.BLOCKS_FIRST, 1), kv(AttnKind.BLOCKS_FIRST, 2))
    for s, src in enumerate(peer.sources):
        assert rows(src.local_rows) == [
            [LB + s * 128, 128, 0, 512, 8],
            [LB + 256 + s * 128, 128, 0, 512, 8],
        ]
        assert rows(src.remote_rows) == [[RB(s), 128, 0, 256, 8], [RB(s) + 128, 128, 0, 256, 8]]


# ---------------------------------------------------------------- GQA, TP above heads


def test_gqa_tp_above_heads_head_offsets() -> None:
    # K=2, P TP1 (2 heads, 128 B/block), D TP8 (1 head, 64 B). r = 8, p = 0 for every d.
    # head offset = d*2//8 - 0*2//1 = d//4  ->  0 for d < 4, one head (64 B) for d >= 4.
    for d in range(8):
        peer = pair(
            kv(AttnKind.SPLIT_KV, 8, heads=2).with_rank(d), kv(AttnKind.SPLIT_KV, 1, heads=2)
        )
        assert peer.tp.sources[0].head_offset == d // 4
        assert peer.tp.consumers_per_producer == 8
        (src,) = peer.sources
        assert rows(src.remote_rows)[0] == [RB(0) + 64 * (d // 4), 64, 0, 128, 8]
    # K=4, P TP2 (2 heads, 128 B), D TP8 (1 head, 64 B): p = d // 4,
    # offset = d*4//8 - p*4//2 = d//2 - 2*(d//4)  ->  0,0,1,1,0,0,1,1 heads
    for d, off in enumerate([0, 0, 1, 1, 0, 0, 1, 1]):
        peer = pair(kv(AttnKind.SPLIT_KV, 8).with_rank(d), kv(AttnKind.SPLIT_KV, 2))
        (src,) = peer.sources
        assert src.rank == d // 4
        assert rows(src.remote_rows)[1] == [RB(d // 4, 1) + 64 * off, 64, 0, 128, 8]
    # K=2, P TP2 -> D TP8: both sides hold one head: whole 64 B blocks, offset 0, dense
    for d in range(8):
        (src,) = pair(
            kv(AttnKind.SPLIT_KV, 8, heads=2).with_rank(d), kv(AttnKind.SPLIT_KV, 2, heads=2)
        ).sources
        assert src.rank == d // 4 and rows(src.remote_rows)[0] == [RB(d // 4), 64, 0, 64, 8]


def test_gqa_fan_out_dedup() -> None:
    # K=2, P TP4: ranks 0,1 hold head 0; ranks 2,3 head 1. D TP1 reads ranks 0 and 2 only.
    t = plan_tp(0, 1, 4, 2)
    assert t.source_ranks == (0, 2) and t.notify_only == (1, 3)
    assert [(s.head_slot, s.num_head_slots) for s in t.sources] == [(0, 2), (1, 2)]


# ---------------------------------------------------------------- MLA


def mla(tp: int, nb: int = 8) -> LayoutSpec:
    # latent width 16, bf16, block 4: 4*16*2 = 128 B per block on every rank
    return LayoutSpec(AttnKind.MLA, 1, nb, 4, 1, 16, 2, 0, tp)


def test_mla_fan_out_4_to_1() -> None:
    peer = pair(mla(1), mla(4))
    assert peer.tp.source_ranks == (0,) and peer.notify_only == (1, 2, 3)
    assert peer.tp.consumers_per_producer == 1
    (src,) = peer.sources
    assert rows(src.local_rows) == [[LB, 128, 0, 128, 8]]
    assert rows(src.remote_rows) == [[RB(0), 128, 0, 128, 8]]
    req = plan_request(peer, [1, 2], [4, 5])
    assert req.notify_only == (1, 2, 3)
    assert pairs(req.sources[0]) == [(1, 4), (2, 5)] and req.num_runs == 1


def test_mla_fan_in_1_to_2_and_2_to_4() -> None:
    for d in range(2):
        peer = pair(mla(2).with_rank(d), mla(1))
        assert peer.tp.source_ranks == (0,) and peer.notify_only == ()
        assert peer.tp.consumers_per_producer == 2  # P rank 0 frees after 2 reads
        (src,) = peer.sources
        assert rows(src.remote_rows) == [[RB(0), 128, 0, 128, 8]]
    peer = pair(mla(4).with_rank(3), mla(2))
    assert peer.tp.source_ranks == (1,) and rows(peer.sources[0].remote_rows) == [
        [RB(1), 128, 0, 128, 8]
    ]


# ---------------------------------------------------------------- Mamba2 / GDN state

# Nemotron-H-like Mamba2 layer: conv (x, B, C) cols (8192, 1024, 1024), kernel 4, bf16;
# SSM = 128 heads * 64 head dim * 128 state * 2 B = 2 MiB (all ranks).
NEMO = StateSpec(
    num_layers=1, conv_cols=(8192, 1024, 1024), conv_kernel=4, ssm_bytes=128 * 64 * 128 * 2
)


def state_only(state: StateSpec, tp: int, nb: int = 4) -> LayoutSpec:
    return LayoutSpec(AttnKind.BLOCKS_FIRST, 0, nb, 16, 8, 128, 2, 0, tp, state=state)


def views(lay: CacheLayout) -> list[tuple[int, int, int]]:
    return [(v.offset, v.length, v.stride) for v in lay.views]


def test_mamba2_conv_decomposition() -> None:
    # TP1: x = 8192*3*2 = 49152, B = C = 1024*3*2 = 6144, ssm = 2097152; page = 2158592
    tp1 = build_local(state_only(NEMO, 1))
    assert views(tp1) == [
        (0, 49152, 2158592),
        (49152, 6144, 2158592),
        (55296, 6144, 2158592),
        (61440, 2097152, 2158592),
    ]
    assert all(v.kind is ViewKind.STATE and v.shard is Shard.SPLIT for v in tp1.views)
    # TP4: x = 8192/4*3*2 = 12288, B = C = 256*3*2 = 1536, ssm = 524288; page = 539648
    tp4 = build_local(state_only(NEMO, 4))
    assert views(tp4) == [
        (0, 12288, 539648),
        (12288, 1536, 539648),
        (13824, 1536, 539648),
        (15360, 524288, 539648),
    ]
    assert tp4.regions[0].num_bytes == 4 * 539648


def test_mamba2_fan_in_1_to_4() -> None:
    # sub-projection j of P's page at sum_{i<j} proj_i * r + (d mod r) * proj_j, len proj_j
    # (proj = TP4 sizes 12288, 1536, 1536; r = 4); SSM at conv_size_P 61440 + d * 524288.
    for d in range(4):
        peer = pair(state_only(NEMO, 4).with_rank(d), state_only(NEMO, 1))
        (src,) = peer.sources
        stride_l, stride_r = 539648, 2158592
        assert rows(src.local_rows) == [
            [LB + 0, 12288, 0, stride_l, 4],
            [LB + 12288, 1536, 0, stride_l, 4],
            [LB + 13824, 1536, 0, stride_l, 4],
            [LB + 15360, 524288, 0, stride_l, 4],
        ]
        assert rows(src.remote_rows) == [
            [RB(0) + d * 12288, 12288, 0, stride_r, 4],
            [RB(0) + 49152 + d * 1536, 1536, 0, stride_r, 4],
            [RB(0) + 55296 + d * 1536, 1536, 0, stride_r, 4],
            [RB(0) + 61440 + d * 524288, 524288, 0, stride_r, 4],
        ]
    # d = 3 explicitly: x 36864, B 53760, C 59904, ssm 1634304
    (src,) = pair(state_only(NEMO, 4).with_rank(3), state_only(NEMO, 1)).sources
    assert (src.remote_rows[:, 0] - RB(0)).tolist() == [36864, 53760, 59904, 1634304]


# gated delta net: conv (Q, K, V) cols (2048, 2048, 4096), kernel 4, bf16;
# SSM = 32 heads * 128 * 128 * 2 B = 1 MiB (all ranks).
GDN = StateSpec(
    num_layers=1, conv_cols=(2048, 2048, 4096), conv_kernel=4, ssm_bytes=32 * 128 * 128 * 2
)


def test_gdn_views_and_fan_in_1_to_2() -> None:
    # TP1: Q = K = 2048*3*2 = 12288, V = 24576, ssm 1048576; page 1097728
    assert views(build_local(state_only(GDN, 1))) == [
        (0, 12288, 1097728),
        (12288, 12288, 1097728),
        (24576, 24576, 1097728),
        (49152, 1048576, 1097728),
    ]
    # TP2: Q = K = 6144, V = 12288, ssm 524288; page 548864
    assert views(build_local(state_only(GDN, 2))) == [
        (0, 6144, 548864),
        (6144, 6144, 548864),
        (12288, 12288, 548864),
        (24576, 524288, 548864),
    ]
    # D rank 1 of 2 reads P rank 0: Q at 6144, K at 12288+6144, V at 24576+12288, ssm 49152+524288
    (src,) = pair(state_only(GDN, 2).with_rank(1), state_only(GDN, 1)).sources
    assert (src.remote_rows[:, 0] - RB(0)).tolist() == [6144, 18432, 36864, 573440]
    assert src.remote_rows[:, 1].tolist() == [6144, 6144, 12288, 524288]


def test_gdn_fan_out_2_to_1() -> None:
    # D TP1 page: Q [0, 12288) K [12288, 24576) V [24576, 49152) ssm [49152, ...).
    # Source s places its slice of each part at part_offset + s * part_len_P.
    peer = pair(state_only(GDN, 1), state_only(GDN, 2))
    assert peer.tp.source_ranks == (0, 1) and peer.notify_only == ()
    for s, src in enumerate(peer.sources):
        assert (src.local_rows[:, 0] - LB).tolist() == [
            s * 6144,
            12288 + s * 6144,
            24576 + s * 12288,
            49152 + s * 524288,
        ]
        assert (src.remote_rows[:, 0] - RB(s)).tolist() == [0, 6144, 12288, 24576]
        assert src.local_rows[:, 1].tolist() == [6144, 6144, 12288, 524288]
        assert src.local_rows[:, 3].tolist() == [1097728] * 4  # local page stride
        assert src.remote_rows[:, 3].tolist() == [548864] * 4


# ---------------------------------------------------------------- hybrid ids


def test_hybrid_attention_and_state_ids() -> None:
    # blocks-first attention, 1 layer, K=2, D=8, bf16, block 16, TP1: K half = 16*2*8*2 = 512,
    # page 1024. Mamba2 state (32, 8, 8) kernel 4: x 192, B 48, C 48, ssm 256 (544 <= 1024).
    st = StateSpec(num_layers=1, conv_cols=(32, 8, 8), conv_kernel=4, ssm_bytes=256)
    spec = LayoutSpec(AttnKind.BLOCKS_FIRST, 1, 10, 16, 2, 8, 2, state=st)
    lay = build_local(spec)
    assert views(lay) == [
        (0, 512, 1024),
        (512, 512, 1024),
        (0, 192, 1024),
        (192, 48, 1024),
        (240, 48, 1024),
        (288, 256, 1024),
    ]
    # flat indices (10 blocks per view): K 0-9, V 10-19, x 20-29, B 30-39, C 40-49, ssm 50-59
    peer = pair(spec, spec)
    req = plan_request(peer, [4, 2], [9, 3], local_state_ids=[6], remote_state_ids=[1])
    (ids,) = req.sources
    assert pairs(ids) == [
        (2, 3), (4, 9), (12, 13), (14, 19),  # attention K, V
        (26, 21), (36, 31), (46, 41), (56, 51),  # state x, B, C, ssm: page 6 <- page 1
    ]  # fmt: skip
    assert_view_major(peer.sources[0], ids)
    # attention first, then state (the list order of the layout)
    assert ids.local_ids.tolist()[:4] == [4, 2, 14, 12]


# ---------------------------------------------------------------- ppl and block size ratio


def test_ppl_both_sides_kernel_bsr_2() -> None:
    # local ppl 2, block 16 -> kernel 8 tokens; remote ppl 4, block 16 -> kernel 4 tokens.
    # kernel bsr = 8 / 4 = 2. K=1, D=4, bf16: local kernel block 8*4*2 = 64 B, remote 32 B.
    local = LayoutSpec(AttnKind.SPLIT_KV, 1, 6, 16, 1, 4, 2, ppl=2)  # 12 kernel blocks
    remote = LayoutSpec(AttnKind.SPLIT_KV, 1, 6, 16, 1, 4, 2, ppl=4)  # 24 kernel blocks
    peer = pair(local, remote)
    assert peer.kernel_bsr == 2 and (peer.local_ppl, peer.remote_ppl) == (2, 4)
    (src,) = peer.sources
    # rows: (K, sub 0), (K, sub 1), (V, sub 0), (V, sub 1); sub-block k at +k*32 locally
    assert rows(src.local_rows) == [
        [LB, 32, 0, 64, 12],
        [LB + 32, 32, 0, 64, 12],
        [LB + GiB4, 32, 0, 64, 12],
        [LB + GiB4 + 32, 32, 0, 64, 12],
    ]
    assert rows(src.remote_rows) == [
        [RB(0, 0), 32, 0, 32, 24],
        [RB(0, 0), 32, 0, 32, 24],
        [RB(0, 1), 32, 0, 32, 24],
        [RB(0, 1), 32, 0, 32, 24],
    ]
    assert src.row_sub.tolist() == [0, 1, 0, 1]
    # local logical [3, 0] -> kernel [6, 7, 0, 1]; remote logical [5, 1] -> kernel
    # [20, 21, 22, 23, 4, 5, 6, 7]; local kernel i sub k <- remote kernel 2i + k.
    # row starts: local 0, 12, 24, 36; remote 0, 24, 48, 72
    (ids,) = plan_request(peer, [3, 0], [5, 1]).sources
    rk = [20, 21, 22, 23, 4, 5, 6, 7]
    want = [
        (l_start + lk, r_start + rk[2 * i + k])
        for l_start, r_start, k in [(0, 0, 0), (12, 24, 1), (24, 48, 0), (36, 72, 1)]
        for i, lk in enumerate([6, 7, 0, 1])
    ]
    assert pairs(ids) == sorted(want)
    k_rows = [(6, 20), (7, 22), (0, 4), (1, 6), (18, 45), (19, 47), (12, 29), (13, 31)]
    v_rows = [(30, 68), (31, 70), (24, 52), (25, 54), (42, 93), (43, 95), (36, 77), (37, 79)]
    assert pairs(ids) == sorted([*k_rows, *v_rows])
    assert_view_major(src, ids)


def test_ppl_expansion_uses_owning_side() -> None:
    # local ppl 1 block 8 (kernel 8) <- remote ppl 2 block 16 (kernel 8): kbsr 1.
    # remote logical 3 -> kernel 6, 7; they fill local logical blocks [5, 2].
    local = LayoutSpec(AttnKind.SPLIT_KV, 1, 6, 8, 1, 4, 2, ppl=1)
    remote = LayoutSpec(AttnKind.SPLIT_KV, 1, 6, 16, 1, 4, 2, ppl=2)
    peer = pair(local, remote)
    assert peer.kernel_bsr == 1
    (ids,) = plan_request(peer, [5, 2], [3]).sources
    assert pairs(ids) == [(2, 7), (5, 6), (8, 19), (11, 18)]  # V: local +6, remote +12


def test_block_size_ratio_2_odd_remote_count() -> None:
    # local block 8 tokens, remote 4; K=2, D=4, bf16: local 8*2*4*2 = 128 B, remote 64 B.
    local = LayoutSpec(AttnKind.SPLIT_KV, 1, 6, 8, 2, 4, 2)
    remote = LayoutSpec(AttnKind.SPLIT_KV, 1, 10, 4, 2, 4, 2)
    peer = pair(local, remote)
    (src,) = peer.sources
    assert peer.kernel_bsr == 2
    assert rows(src.local_rows) == [
        [LB, 64, 0, 128, 6],
        [LB + 64, 64, 0, 128, 6],
        [LB + GiB4, 64, 0, 128, 6],
        [LB + GiB4 + 64, 64, 0, 128, 6],
    ]
    assert rows(src.remote_rows) == [
        [RB(0, 0), 64, 0, 64, 10],
        [RB(0, 0), 64, 0, 64, 10],
        [RB(0, 1), 64, 0, 64, 10],
        [RB(0, 1), 64, 0, 64, 10],
    ]
    # 3 remote blocks [1, 7, 3] into local [2, 5]: local 2 <- (1, 7), local 5 <- (3, clipped).
    # local starts 0, 6, 12, 18; remote starts 0, 10, 20, 30
    (ids,) = plan_request(peer, [2, 5], [1, 7, 3]).sources
    assert pairs(ids) == [(2, 1), (5, 3), (8, 17), (14, 21), (17, 23), (20, 37)]
    assert ids.num_descriptors == 6  # 2 views x 3 remote blocks
    dl = dense_rows(src.local_rows)
    assert int(dl[ids.local_ids, 1].sum()) == 3 * 64 * 2


def test_prefix_hit_skips_remote_blocks_of_cached_local_blocks() -> None:
    # bsr 2 as above: 1 cached local block skips remote kernel blocks 0..1 of the request
    local = LayoutSpec(AttnKind.SPLIT_KV, 1, 6, 8, 2, 4, 2)
    remote = LayoutSpec(AttnKind.SPLIT_KV, 1, 10, 4, 2, 4, 2)
    peer = pair(local, remote)
    (ids,) = plan_request(peer, [2, 5], [1, 7, 3], num_cached_blocks=1).sources
    assert pairs(ids) == [(5, 3), (17, 23)]
