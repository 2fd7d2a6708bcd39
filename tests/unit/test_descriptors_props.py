"""Properties of the descriptor builders over random layouts (no memory is touched).

Every layout is built over fake base addresses ``(1 << 40) + i * (1 << 32)``; the checks
compare the vectorized builders with plain loops and with the domain formulas
(``addr(b) = base + offset + b * stride``, view-major block-minor indices).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout, TokenLayout, ViewKind
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec
from kvxfer.planning.descriptors import (
    ADDR,
    COUNT,
    LEN,
    dense_rows,
    layout_rows,
    reference_rows,
    row_starts,
    strided_rows,
    validate_rows,
    view_rows,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fake_bases(n: int) -> list[int]:
    return [(1 << 40) + i * (1 << 32) for i in range(n)]


@st.composite
def state_specs(draw: st.DrawFn) -> StateSpec:
    n_sub = draw(st.integers(1, 3))  # Mamba1 (x), GDN/Mamba2 (3 parts), or 2
    return StateSpec(
        num_layers=draw(st.integers(1, 3)),
        conv_cols=tuple(8 * draw(st.integers(1, 6)) for _ in range(n_sub)),  # /8 for TP 8
        conv_kernel=draw(st.integers(2, 5)),
        ssm_bytes=8 * draw(st.integers(1, 64)),
    )


@st.composite
def layout_specs(draw: st.DrawFn) -> LayoutSpec:
    kind = draw(st.sampled_from([*AttnKind, "hybrid"]))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    heads = draw(st.sampled_from([1, 2, 4, 8]))  # powers of two: always divide or are divided
    ppl = draw(st.sampled_from([1, 2, 4]))
    kernel_tokens = draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([1, 4, 8, 16]))
    dtype_bytes = draw(st.sampled_from([1, 2, 4]))
    num_layers = draw(st.integers(1, 4))
    state = None
    if kind == "hybrid":
        kind, state = AttnKind.BLOCKS_FIRST, draw(state_specs())
        num_layers = draw(st.integers(0, 3))
        heads_local = max(1, heads // tp)
        # the state page must fit one attention page (2 * kernel block * ppl): grow the block
        while num_layers and state.page_bytes(tp, dtype_bytes) > (
            2 * kernel_tokens * ppl * heads_local * head_dim * dtype_bytes
        ):
            kernel_tokens *= 2
    return LayoutSpec(
        kind=kind,
        num_layers=num_layers,
        num_blocks=draw(st.integers(1, 40)),
        block_size=kernel_tokens * ppl,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype_bytes=dtype_bytes,
        tp_rank=draw(st.integers(0, tp - 1)),
        tp_size=tp,
        token_layout=draw(st.sampled_from(TokenLayout)),
        ppl=ppl,
        state=state,
    )


def build(spec: LayoutSpec, device_id: int = 0) -> CacheLayout:
    return spec.build(fake_bases(len(spec.region_bytes())), device_id=device_id)


def manual_expand(rows5: np.ndarray) -> np.ndarray:
    """Each strided row expanded by hand, in Python ints (no uint64 wrap)."""
    out: list[tuple[int, int, int]] = []
    for addr, length, dev, stride, count in rows5.tolist():
        out.extend((addr + b * stride, length, dev) for b in range(count))
    return np.array(out, dtype=np.uint64).reshape(-1, 3)


@SETTINGS
@given(spec=layout_specs(), dev=st.integers(0, 7))
def test_dense_equals_reference_and_manual(spec: LayoutSpec, dev: int) -> None:
    lay = build(spec, dev)
    rows5 = layout_rows(lay)
    assert rows5.dtype == np.uint64 and rows5.shape == (len(lay.views), 5)
    assert rows5.flags.c_contiguous
    dense = dense_rows(rows5)
    assert dense.dtype == np.uint64 and dense.shape == (lay.num_descriptors, 3)
    np.testing.assert_array_equal(dense, np.array(reference_rows(rows5), dtype=np.uint64))
    np.testing.assert_array_equal(dense, manual_expand(rows5))


@SETTINGS
@given(spec=layout_specs(), dev=st.integers(0, 7))
def test_index_contract_and_inside_regions(spec: LayoutSpec, dev: int) -> None:
    lay = build(spec, dev)
    rows5 = layout_rows(lay)
    dense = dense_rows(rows5)
    starts = row_starts(rows5)
    assert starts.tolist() == [0, *np.cumsum([v.count for v in lay.views]).tolist()]
    start = 0  # view-major, block-minor: index(v, b) = sum(counts before v) + b
    for v, view in enumerate(lay.views):
        region = lay.regions[view.region]
        b = np.arange(view.count, dtype=np.uint64)
        got = dense[start + np.arange(view.count)]
        want = np.uint64(region.base_addr + view.offset) + b * np.uint64(view.stride)
        np.testing.assert_array_equal(got[:, 0], want)
        assert (got[:, 1] == view.length).all() and (got[:, 2] == dev).all()
        # every descriptor lies inside its region
        assert (got[:, 0] >= region.base_addr).all()
        assert (got[:, 0] + got[:, 1] <= region.base_addr + region.num_bytes).all()
        assert lay.view_addr(v) == region.base_addr + view.offset
        start += view.count
    assert start == lay.num_descriptors == dense.shape[0]


def expected_views(spec: LayoutSpec) -> list[tuple[int, int, int, int, int, ViewKind]]:
    """``(region, offset, length, stride, count, kind)`` per view from the domain formulas."""
    h = 1 if spec.kind is AttnKind.MLA else max(1, spec.num_kv_heads // spec.tp_size)
    kt, e, nl = spec.block_size // spec.ppl, spec.dtype_bytes, spec.num_layers
    kb = kt * h * spec.head_dim * e  # one K (or V, or latent) kernel block
    nk = spec.num_blocks * spec.ppl
    attn = ViewKind.ATTN
    out: list[tuple[int, int, int, int, int, ViewKind]] = []
    if spec.kind is AttnKind.SPLIT_KV:
        out = [(r, 0, kb, kb, nk, attn) for r in range(2 * nl)]
    elif spec.kind is AttnKind.BLOCKS_FIRST:
        out = [(i, half * kb, kb, 2 * kb, nk, attn) for i in range(nl) for half in (0, 1)]
    elif spec.kind is AttnKind.PACKED:
        out = [(i, 0, 2 * kb, 2 * kb, nk, attn) for i in range(nl)]
    elif spec.kind is AttnKind.MLA:
        out = [(i, 0, kb, kb, nk, attn) for i in range(nl)]
    else:
        out = [(0, 0, 2 * kb * nl, 2 * kb * nl, nk, attn)]
    st_ = spec.state
    if st_ is not None:
        parts = [c // spec.tp_size * (st_.conv_kernel - 1) * e for c in st_.conv_cols]
        parts.append(st_.ssm_bytes // spec.tp_size)
        page = 2 * kb * spec.ppl if nl else sum(parts)
        for i in range(st_.num_layers):
            offs = np.concatenate([[0], np.cumsum(parts[:-1])]).tolist()
            out += [
                (i, o, n, page, spec.num_blocks, ViewKind.STATE)
                for o, n in zip(offs, parts, strict=True)
            ]
    return out


@SETTINGS
@given(spec=layout_specs())
def test_views_follow_domain_formulas(spec: LayoutSpec) -> None:
    lay = build(spec)
    got = [(v.region, v.offset, v.length, v.stride, v.count, v.kind) for v in lay.views]
    assert got == expected_views(spec)


@SETTINGS
@given(spec=layout_specs())
def test_attention_tiles_regions_and_state_pages_do_not_overlap(spec: LayoutSpec) -> None:
    lay = build(spec)
    dense = dense_rows(layout_rows(lay))
    starts = row_starts(layout_rows(lay))
    for kind in (ViewKind.ATTN, ViewKind.STATE):
        for r, region in enumerate(lay.regions):
            sel = [
                np.arange(starts[v], starts[v + 1])
                for v, view in enumerate(lay.views)
                if view.kind is kind and view.region == r
            ]
            if not sel:
                continue
            rows = dense[np.concatenate(sel)]
            rows = rows[np.argsort(rows[:, ADDR], kind="stable")]
            ends = rows[:, ADDR] + rows[:, LEN]
            assert (ends[:-1] <= rows[1:, ADDR]).all(), f"{kind} descriptors overlap in region {r}"
            if kind is ViewKind.ATTN:  # K/V blocks cover the region exactly, no gap
                assert int(rows[:, LEN].sum()) == region.num_bytes
                assert int(rows[0, ADDR]) == region.base_addr


@st.composite
def random_rows(draw: st.DrawFn) -> np.ndarray:
    """Arbitrary ``(N, 5)`` rows; N above 4096 exercises the one-pass expansion."""
    n = draw(st.one_of(st.integers(1, 40), st.integers(4090, 4200)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return strided_rows(
        rng.integers(0, 1 << 48, n),
        rng.integers(1, 1 << 20, n),
        rng.integers(0, 8, n),
        rng.integers(0, 1 << 20, n),
        rng.integers(1, 6, n),
    )


@settings(max_examples=25, deadline=None)
@given(rows5=random_rows())
def test_dense_rows_of_arbitrary_rows(rows5: np.ndarray) -> None:
    dense = dense_rows(rows5)
    np.testing.assert_array_equal(dense, np.array(reference_rows(rows5), dtype=np.uint64))
    starts = row_starts(rows5)
    assert int(starts[-1]) == int(rows5[:, COUNT].sum()) == dense.shape[0]


def test_strided_rows_broadcasts_scalars() -> None:
    rows = strided_rows([100, 200], 8, 3, 16, [2, 1])
    assert rows.tolist() == [[100, 8, 3, 16, 2], [200, 8, 3, 16, 1]]
    assert dense_rows(rows).tolist() == [[100, 8, 3], [116, 8, 3], [200, 8, 3]]


def test_view_rows_needs_views() -> None:
    lay = build(LayoutSpec(AttnKind.SPLIT_KV, 1, 2, 4, 1, 4))
    with pytest.raises(LayoutError, match="no views"):
        view_rows(lay, [])


GOOD = strided_rows([1 << 40, (1 << 40) + 4096], 64, 0, 128, [3, 2])
BAD_ROWS: dict[str, tuple[np.ndarray, str]] = {
    "one_dim": (GOOD[0].copy(), "shape"),
    "three_dim": (GOOD[None].copy(), "shape"),
    "dense_width": (np.ascontiguousarray(GOOD[:, :3]), "shape"),
    "int64": (GOOD.astype(np.int64), "uint64"),
    "float64": (GOOD.astype(np.float64), "uint64"),
    "uint32": (GOOD.astype(np.uint32), "uint64"),
    "empty": (np.zeros((0, 5), dtype=np.uint64), "empty"),
    "fortran": (np.asfortranarray(GOOD), "C-contiguous"),
    "strided_slice": (np.repeat(GOOD, 2, axis=0)[::2], "C-contiguous"),
}


@pytest.mark.parametrize("name", sorted(BAD_ROWS))
def test_validate_rows_rejects(name: str) -> None:
    rows, match = BAD_ROWS[name]
    with pytest.raises(LayoutError, match=match):
        validate_rows(rows)
    with pytest.raises(LayoutError, match=match):
        dense_rows(rows)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 12),
    data=st.data(),
    column=st.sampled_from([LEN, COUNT]),
)
def test_validate_rows_rejects_zero_length_or_count(
    n: int, data: st.DataObject, column: int
) -> None:
    rows = strided_rows(np.arange(n) * 4096 + (1 << 40), 64, 0, 64, 3)
    bad = data.draw(st.integers(0, n - 1))
    rows[bad:, column] = 0  # the first zero is reported
    name = "length" if column == LEN else "count"
    with pytest.raises(LayoutError, match=f"row {bad} has {name} 0"):
        validate_rows(rows)
    with pytest.raises(LayoutError, match=f"row {bad} has {name} 0"):
        dense_rows(rows)


def test_validate_rows_rejects_lists() -> None:
    with pytest.raises(LayoutError, match=r"shape \(N, 5\), got list"):
        validate_rows(GOOD.tolist())  # type: ignore[arg-type, unused-ignore]


def test_validate_rows_width_3() -> None:
    rows3 = dense_rows(GOOD)
    assert validate_rows(rows3, width=3) is rows3
    with pytest.raises(LayoutError, match=r"shape \(N, 3\)"):
        validate_rows(GOOD, width=3)
    rows3 = rows3.copy()
    rows3[2, LEN] = 0
    with pytest.raises(LayoutError, match="row 2 has length 0"):
        validate_rows(rows3, width=3)
