"""check_integrity: views of one kind in one region never share a byte (local and remote)."""

from __future__ import annotations

import time
from dataclasses import replace

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.errors import LayoutError, ProtocolError
from kvxfer.layout.model import CacheLayout, Region, View, ViewKind
from kvxfer.layout.overlap import check_views_disjoint
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec
from kvxfer.wire.records import layout_from_record, record_from_layout

KB = 64  # bytes of one K (or V) kernel block below


def layout(views: tuple[View, ...], region_bytes: int = 1 << 20, **kw: object) -> CacheLayout:
    args: dict[str, object] = {"block_size": 4, "num_kv_heads": 2, "head_dim": 8, "dtype_bytes": 2}
    args.update(kw)
    regions = (Region(1 << 32, region_bytes), Region(1 << 33, region_bytes))
    return CacheLayout(regions, views, **args)  # type: ignore[arg-type]


def blocks_first(v_offset: int) -> tuple[View, ...]:
    return (View(0, 0, KB, 2 * KB, 8, name="K"), View(0, v_offset, KB, 2 * KB, 8, name="V"))


@pytest.mark.parametrize("v_offset", [0, KB // 2, KB + KB // 2, 2 * KB])
def test_v_view_over_k_view_refused(v_offset: int) -> None:
    with pytest.raises(LayoutError, match=r"views 0 \(K\) and 1 \(V\) of region 0 overlap"):
        layout(blocks_first(v_offset))


def test_disjoint_views_accepted() -> None:
    layout(blocks_first(KB))  # the real blocks-first layout
    # two layers stacked in one region: same stride, offsets a whole pool apart
    layout((View(0, 0, KB, KB, 8, name="L0"), View(0, 8 * KB, KB, KB, 8, name="L1")))
    # the same offsets in two regions never collide
    layout((View(0, 0, KB, KB, 8), View(1, 0, KB, KB, 8)))


def test_stacked_views_one_block_apart_refused() -> None:
    # L1 starts inside L0's last block
    views = (View(0, 0, KB, KB, 8, name="L0"), View(0, 7 * KB, KB, KB, 8, name="L1"))
    with pytest.raises(LayoutError, match="overlap"):
        layout(views)


def test_different_strides_interleaved_refused() -> None:
    views = (View(0, 0, KB, 2 * KB, 8, name="a"), View(0, KB, KB, 3 * KB, 8, name="b"))
    with pytest.raises(LayoutError, match="overlap"):
        layout(views)


def hybrid(ssm_bytes: int) -> CacheLayout:
    st = StateSpec(1, (32, 8, 8), 4, ssm_bytes)
    spec = LayoutSpec(AttnKind.BLOCKS_FIRST, 1, 10, 16, 2, 8, 2, state=st)
    return spec.build([1 << 32])


def test_hybrid_state_page_larger_than_its_page_refused() -> None:
    good = hybrid(256)
    page = good.state_views[0].stride
    ssm = good.views[-1]
    assert ssm.name == "S0.ssm" and ssm.offset + ssm.length <= page
    # the SSM part grows past the page: it covers the next page's conv parts
    bad_views = (*good.views[:-1], replace(ssm, length=page - ssm.offset + 16))
    with pytest.raises(LayoutError, match=r"\(S0\.conv0\) and 5 \(S0\.ssm\) of region 0 overlap"):
        replace_views(good, bad_views)


def replace_views(lay: CacheLayout, views: tuple[View, ...]) -> CacheLayout:
    regions = tuple(replace(r, num_bytes=2 * r.num_bytes) for r in lay.regions)
    return CacheLayout(
        regions, views, lay.block_size, lay.num_kv_heads, lay.head_dim, lay.dtype_bytes,
        lay.tp_rank, lay.tp_size, lay.token_layout, lay.ppl,
    )  # fmt: skip


def test_hybrid_attention_and_state_share_pages() -> None:
    lay = hybrid(256)  # ATTN and STATE views overlap by design: a block is one or the other
    assert {v.kind for v in lay.views} == {ViewKind.ATTN, ViewKind.STATE}


def test_remote_record_with_overlapping_views_refused() -> None:
    good = layout(blocks_first(KB))
    rec = record_from_layout(good, agent_name="a", agent_metadata=b"m", generation=1)
    v1 = msgspec.structs.replace(rec.views[1], offset=KB // 2)
    bad = msgspec.structs.replace(rec, views=(rec.views[0], v1))
    with pytest.raises(ProtocolError, match=r"peer record: views 0 \(K\) and 1 \(V\) .*overlap"):
        layout_from_record(bad)


def test_many_views_checked_fast() -> None:
    # 4096 stacked views in one region and 4096 interleaved in another: linear-ish time
    n = 4096
    views = tuple(View(0, i * 8 * KB, KB, KB, 8) for i in range(n))
    views += tuple(View(1, i * 16, 16, 16 * n, 8) for i in range(n))
    t0 = time.perf_counter()
    layout(views, region_bytes=n * 8 * KB)
    assert time.perf_counter() - t0 < 2.0


def brute_overlap(views: list[View]) -> bool:
    owner: dict[int, int] = {}
    for i, v in enumerate(views):
        for b in range(v.count):
            for x in range(v.offset + b * v.stride, v.offset + b * v.stride + v.length):
                if owner.setdefault(x, i) != i:
                    return True
    return False


@st.composite
def small_views(draw: st.DrawFn) -> list[View]:
    strides = draw(st.lists(st.integers(1, 12), min_size=1, max_size=2))
    out = []
    for _ in range(draw(st.integers(2, 5))):
        count = draw(st.integers(1, 4))
        stride = draw(st.sampled_from(strides))
        length = draw(st.integers(1, stride))
        out.append(View(0, draw(st.integers(0, 40)), length, stride, count))
    return out


@settings(max_examples=400, deadline=None)
@given(small_views())
def test_check_matches_brute_force(views: list[View]) -> None:
    """Exact for one stride; with two strides it may also refuse interleaved disjoint views."""
    try:
        check_views_disjoint(0, views, range(len(views)))
        refused = False
    except LayoutError:
        refused = True
    truth = brute_overlap(views)
    multi = {v.stride for v in views if v.count > 1}
    if truth:
        assert refused
    elif len(multi) <= 1:
        assert not refused
