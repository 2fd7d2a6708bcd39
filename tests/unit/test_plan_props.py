"""Properties of pairing + request plans over random layout pairs, TP pairs and requests.

The arithmetic checks use fake base addresses (no memory). The expected byte ranges are
computed here from the domain formulas, independently of the planner. A smaller set of
random cases moves real bytes through ``tests.sim.run_case`` (memmove) and must deliver
every byte. Combinations the planner must refuse are generated and asserted to raise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.errors import IncompatibleError, LayoutError
from kvxfer.layout.model import CacheLayout, TokenLayout, ViewKind
from kvxfer.layout.spec import AttnKind, LayoutSpec, StateSpec
from kvxfer.planning.descriptors import ADDR, LEN, dense_rows
from kvxfer.planning.pairing import PeerPlan, pair_layouts
from kvxfer.planning.request import RequestPlan, plan_request
from tests.sim import inside, run_case

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (1, 8), (8, 1)]  # (P, D)
LOCAL_BASE = 1 << 40
U64 = np.uint64


def remote_base(rank: int) -> int:
    return (1 << 44) + rank * (1 << 38)


def build(spec: LayoutSpec, base: int) -> CacheLayout:
    return spec.build([base + i * (1 << 32) for i in range(len(spec.region_bytes()))])


def heads_local(kind: AttnKind, heads: int, tp: int) -> int:
    return 1 if kind is AttnKind.MLA else max(1, heads // tp)


@dataclass(frozen=True)
class Case:
    """One request between a local engine (all ranks) and a remote engine (all ranks)."""

    local: LayoutSpec
    remote: LayoutSpec
    lids: tuple[int, ...]
    rids: tuple[int, ...]
    lstate: tuple[int, ...] | None
    rstate: tuple[int, ...] | None
    num_cached: int

    @property
    def kw(self) -> dict[str, object]:
        kw: dict[str, object] = {"num_cached_blocks": self.num_cached}
        if self.lstate is not None:
            kw.update(local_state_ids=list(self.lstate), remote_state_ids=list(self.rstate or ()))
        return kw


@st.composite
def state_specs(draw: st.DrawFn, col_unit: int = 8) -> StateSpec:
    n_sub = draw(st.integers(1, 3))
    return StateSpec(
        num_layers=draw(st.integers(1, 2)),
        conv_cols=tuple(col_unit * draw(st.integers(1, 4)) for _ in range(n_sub)),
        conv_kernel=draw(st.integers(2, 4)),
        ssm_bytes=col_unit * draw(st.integers(1, 32)),
    )


def fit_state(
    state: StateSpec, layers: int, kts: list[int], ppls: list[int], hs: list[int], tps: list[int]
) -> list[int]:
    """Double every side's kernel tokens until each side's state page fits its attention page."""
    d, e = 4, 2
    while layers and any(
        state.page_bytes(t, e) > 2 * kt * p * h * d * e
        for kt, p, h, t in zip(kts, ppls, hs, tps, strict=True)
    ):
        kts = [2 * kt for kt in kts]
    return kts


@st.composite
def valid_cases(draw: st.DrawFn, tiny: bool = False) -> Case:
    kind = draw(st.sampled_from([*AttnKind, "hybrid"]))
    tp_p, tp_d = draw(st.sampled_from(TP_PAIRS))
    hybrid = kind == "hybrid"
    akind = AttnKind.BLOCKS_FIRST if hybrid else AttnKind(kind)
    heads_choices = [1, 2, 4, 8]
    if akind is AttnKind.CROSS_LAYER:  # cross-layer blocks cannot be head-sliced
        heads_choices = [
            h for h in heads_choices if heads_local(akind, h, tp_p) == heads_local(akind, h, tp_d)
        ]
    heads = draw(st.sampled_from(heads_choices))
    sliced = heads_local(akind, heads, tp_p) != heads_local(akind, heads, tp_d)
    # NHD only where no head slice is taken
    token_layout = TokenLayout.HND if sliced else draw(st.sampled_from(TokenLayout))
    fan_in = tp_d >= tp_p
    # bsr > 1 is refused with cross-layer blocks (tested as a refusal below)
    bsr_ok = fan_in and not hybrid and akind is not AttnKind.CROSS_LAYER
    kbsr = draw(st.sampled_from([1, 2, 4])) if bsr_ok else 1
    kt_r = draw(st.sampled_from([1, 2, 4]))
    ppl_l, ppl_r = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    layers = draw(st.integers(1, 2 if tiny else 3))
    state = None
    if hybrid:
        state = draw(state_specs())
        layers = draw(st.integers(0, 2))
        hs = [heads_local(akind, heads, t) for t in (tp_d, tp_p)]
        kt_l, kt_r = fit_state(state, layers, [kt_r * kbsr, kt_r], [ppl_l, ppl_r], hs, [tp_d, tp_p])
    else:
        kt_l = kt_r * kbsr
    b_l, b_r = kt_l * ppl_l, kt_r * ppl_r
    n_r = draw(st.integers(1, 4 if tiny else 6))
    n_l = -(-n_r * b_r // b_l)
    n_s = draw(st.integers(1, 2)) if hybrid else 0
    cap = 10 if tiny else 40
    nb_r = draw(st.integers(n_r + n_s, max(n_r + n_s, cap)))
    nb_l = draw(st.integers(n_l + n_s, max(n_l + n_s, cap)))
    perm_l = draw(st.permutations(range(nb_l)))
    perm_r = draw(st.permutations(range(nb_r)))
    head_dim = 4 if tiny else draw(st.sampled_from([4, 8]))
    local = LayoutSpec(
        kind=akind,
        num_layers=layers,
        num_blocks=nb_l,
        block_size=b_l,
        num_kv_heads=heads,
        head_dim=4 if hybrid else head_dim,
        dtype_bytes=2,
        tp_size=tp_d,
        token_layout=token_layout,
        ppl=ppl_l,
        state=state,
    )
    remote = replace(local, num_blocks=nb_r, block_size=b_r, ppl=ppl_r, tp_size=tp_p)
    return Case(
        local,
        remote,
        tuple(perm_l[:n_l]),
        tuple(perm_r[:n_r]),
        tuple(perm_l[n_l : n_l + n_s]) if hybrid else None,
        tuple(perm_r[n_r : n_r + n_s]) if hybrid else None,
        draw(st.integers(0, n_l)),
    )


def plan_rank(
    case: Case, d: int
) -> tuple[CacheLayout, dict[int, CacheLayout], PeerPlan, RequestPlan]:
    local = build(case.local.with_rank(d), LOCAL_BASE)
    remotes = {
        r: build(case.remote.with_rank(r), remote_base(r)) for r in range(case.remote.tp_size)
    }
    peer = pair_layouts(local, remotes)
    req = plan_request(peer, list(case.lids), list(case.rids), **case.kw)  # type: ignore[arg-type]
    return local, remotes, peer, req


def spans(
    lay: CacheLayout, attn_blocks: list[tuple[int, int, int]], state_ids: list[int]
) -> np.ndarray:
    """``(S, 2)`` [start, end) byte ranges: attention ``(kernel id, sub k, num subs)`` pieces
    of every ATTN view, and whole state pages ``state_ids`` of every STATE view."""
    out: list[tuple[int, int]] = []
    for i, v in enumerate(lay.views):
        a = lay.view_addr(i)
        if v.kind is ViewKind.ATTN:
            for kid, k, n in attn_blocks:
                sub = v.length // n
                out.append((a + kid * v.stride + k * sub, a + kid * v.stride + (k + 1) * sub))
        else:
            out += [(a + s * v.stride, a + s * v.stride + v.length) for s in state_ids]
    return np.array(sorted(out), dtype=object).reshape(-1, 2)


def merge(iv: np.ndarray) -> list[tuple[int, int]]:
    """Coalesce sorted touching [start, end) ranges."""
    out: list[list[int]] = []
    for s, e in iv.tolist():
        if out and out[-1][1] == s:
            out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def expected_local(case: Case, lay: CacheLayout) -> np.ndarray:
    """Local byte ranges the request must fill, from the domain formulas."""
    lp, rp = case.local.ppl, case.remote.ppl
    kbsr = (case.local.block_size // lp) // (case.remote.block_size // rp)
    n_rk = len(case.rids) * rp - case.num_cached * lp * kbsr  # remote kernel blocks to move
    lk = [lid * lp + j for lid in case.lids[case.num_cached :] for j in range(lp)]
    pieces = [
        (kid, k, kbsr) for i, kid in enumerate(lk) for k in range(kbsr) if i * kbsr + k < n_rk
    ]
    return spans(lay, pieces, list(case.lstate or ()))


def expected_remote(case: Case, lay: CacheLayout) -> np.ndarray:
    """Remote byte ranges of the request (after the cached prefix), whole blocks."""
    lp, rp = case.local.ppl, case.remote.ppl
    kbsr = (case.local.block_size // lp) // (case.remote.block_size // rp)
    rk = [rid * rp + j for rid in case.rids for j in range(rp)][case.num_cached * lp * kbsr :]
    return spans(lay, [(kid, 0, 1) for kid in rk], list(case.rstate or ()))


def as_ranges(rows3: np.ndarray) -> np.ndarray:
    iv = np.stack([rows3[:, ADDR], rows3[:, ADDR] + rows3[:, LEN]], axis=1).astype(object)
    return iv[np.argsort(rows3[:, ADDR], kind="stable")]


def assert_disjoint(iv: np.ndarray, what: str) -> None:
    if len(iv) > 1:
        ends, nxt = iv[:-1, 1], iv[1:, 0]
        bad = [i for i, (e, s) in enumerate(zip(ends, nxt, strict=True)) if e > s]
        assert not bad, f"{what}: ranges overlap at {iv[bad[0]]} / {iv[bad[0] + 1]}"


def assert_within(iv: np.ndarray, allowed: np.ndarray, what: str) -> None:
    """Every range of ``iv`` lies inside one range of sorted, disjoint ``allowed``."""
    starts = np.array([int(s) for s in allowed[:, 0]], dtype=U64)
    for s, e in iv.tolist():
        j = int(np.searchsorted(starts, U64(s), side="right")) - 1
        assert j >= 0 and e <= allowed[j, 1], f"{what}: [{s}, {e}) outside the request's blocks"


def check_case(case: Case) -> None:
    tp_p, tp_d = case.remote.tp_size, case.local.tp_size
    remote_reads: dict[int, list[np.ndarray]] = {r: [] for r in range(tp_p)}
    for d in range(tp_d):
        local, remotes, peer, req = plan_rank(case, d)
        tp = peer.tp
        group = (
            {d // (tp_d // tp_p)}
            if tp_d >= tp_p
            else set(range(d * tp_p // tp_d, (d + 1) * tp_p // tp_d))
        )
        assert set(tp.source_ranks) | set(tp.notify_only) == group
        assert not set(tp.source_ranks) & set(tp.notify_only)
        assert req.notify_only == tp.notify_only
        assert tp.consumers_per_producer == max(1, tp_d // tp_p)
        assert (
            [s.rank for s in req.sources] == [s.rank for s in peer.sources] == list(tp.source_ranks)
        )
        local_iv = []
        for src, ids in zip(peer.sources, req.sources, strict=True):
            dl, dr = dense_rows(src.local_rows), dense_rows(src.remote_rows)
            assert int(src.local_starts[-1]) == len(dl) and int(src.remote_starts[-1]) == len(dr)
            assert ids.local_ids.dtype == np.int32 and ids.remote_ids.dtype == np.int32
            assert ids.local_ids.shape == ids.remote_ids.shape
            if ids.num_descriptors:
                assert ids.local_ids.min() >= 0 and ids.local_ids.max() < len(dl)
                assert ids.remote_ids.min() >= 0 and ids.remote_ids.max() < len(dr)
            ls, rs = dl[ids.local_ids], dr[ids.remote_ids]
            np.testing.assert_array_equal(ls[:, LEN], rs[:, LEN])
            assert (ls[:, LEN] > 0).all()
            assert inside(dl, local) and inside(dr, remotes[src.rank])
            assert 0 <= ids.num_runs <= ids.num_descriptors
            assert (ids.num_runs > 0) == (ids.num_descriptors > 0)
            # runs merge only neighbours contiguous on both sides: never fewer than that
            touch = (ls[1:, ADDR] == ls[:-1, ADDR] + ls[:-1, LEN]) & (
                rs[1:, ADDR] == rs[:-1, ADDR] + rs[:-1, LEN]
            )
            assert ids.num_runs >= ids.num_descriptors - int(np.count_nonzero(touch))
            local_iv.append(as_ranges(ls))
            remote_reads[src.rank].append(as_ranges(rs))
            assert_within(as_ranges(rs), expected_remote(case, remotes[src.rank]), "remote")
        want = expected_local(case, local)
        got = np.concatenate(local_iv) if local_iv else np.zeros((0, 2), dtype=object)
        got = got[np.argsort(got[:, 0].astype(U64), kind="stable")] if len(got) else got
        assert_disjoint(got, f"local rank {d}")
        total_got = sum(int(e) - int(s) for s, e in got.tolist())
        total_want = sum(int(e) - int(s) for s, e in want.tolist())
        assert total_got == total_want == req_bytes(case, local)
        assert merge(got) == merge(want), f"local rank {d}: covered bytes differ"
    # each remote byte of the request is read exactly once when no side replicates it
    akind, heads = case.local.kind, case.local.num_kv_heads
    has_attn = case.local.num_layers > 0
    if akind is not AttnKind.MLA and not (has_attn and max(tp_p, tp_d) > heads):
        for r, parts in remote_reads.items():
            got = np.concatenate(parts)
            got = got[np.argsort(got[:, 0].astype(U64), kind="stable")]
            assert_disjoint(got, f"remote rank {r}")
            want = expected_remote(case, build(case.remote.with_rank(r), remote_base(r)))
            assert merge(got) == merge(want), f"remote rank {r}: bytes read differ"


def req_bytes(case: Case, lay: CacheLayout) -> int:
    """Bytes a local rank must receive, in closed form (no per-block loop)."""
    lp, rp = case.local.ppl, case.remote.ppl
    kbsr = (case.local.block_size // lp) // (case.remote.block_size // rp)
    n_rk = len(case.rids) * rp - case.num_cached * lp * kbsr
    attn = sum(v.length for v in lay.views if v.kind is ViewKind.ATTN)
    state = sum(v.length for v in lay.views if v.kind is ViewKind.STATE)
    # each remote kernel block fills one 1/kbsr sub-block of every local ATTN view
    return max(0, n_rk) * attn // kbsr + len(case.lstate or ()) * state


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=valid_cases())
def test_plan_invariants(case: Case) -> None:
    check_case(case)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=valid_cases(tiny=True), max_run=st.sampled_from([1, 2, 3, 8, 64]), sort=st.booleans())
def test_bytes_arrive(case: Case, max_run: int, sort: bool) -> None:
    lids, rids = list(case.lids), list(case.rids)
    if sort:  # ascending ids make runs contiguous on both sides: exercises run rows
        lids, rids = sorted(lids), sorted(rids)
    for d in range(case.local.tp_size):
        bad, req, _ = run_case(
            case.local.with_rank(d), case.remote, lids, rids, max_run_blocks=max_run, **case.kw
        )
        assert bad == 0, f"local rank {d}: {bad} bytes differ"
        assert req.num_runs <= req.num_descriptors <= req.num_block_descriptors
        if max_run == 1:
            assert req.num_descriptors == req.num_block_descriptors


# ---------------------------------------------------------------- combinations to refuse

INVALID = [
    "tp_not_divisible",
    "bsr_fan_out",
    "bsr_hybrid",
    "nhd_head_slice",
    "cross_layer_head_slice",
    "local_kernel_smaller",
]


@st.composite
def invalid_cases(draw: st.DrawFn, what: str) -> tuple[str, LayoutSpec, LayoutSpec, str]:
    """``(what, local rank spec, remote spec, message regex)`` that pairing must refuse."""
    kinds = list(AttnKind)
    pairs = TP_PAIRS
    heads = [1, 2, 4, 8]
    kbsr, shrink, kt_r, layout, state = (
        1,
        1,
        draw(st.sampled_from([1, 2, 4])),
        TokenLayout.HND,
        None,
    )
    col_unit = 8
    if what == "tp_not_divisible":
        pairs, heads, col_unit = [(3, 2), (2, 3), (4, 6), (6, 4), (3, 4), (4, 3)], [1, 12], 24
        match = "TP sizes must divide"
    elif what == "bsr_fan_out":
        pairs, kbsr, match = (
            [p for p in TP_PAIRS if p[0] > p[1]],
            draw(st.sampled_from([2, 4])),
            "fan-out",
        )
    elif what == "bsr_hybrid":
        kinds, kbsr = ["hybrid"], draw(st.sampled_from([2, 4]))  # type: ignore[list-item]
        pairs, match = [p for p in TP_PAIRS if p[0] <= p[1]], "hybrid state"
    elif what == "nhd_head_slice":
        kinds = [AttnKind.SPLIT_KV, AttnKind.BLOCKS_FIRST, AttnKind.PACKED, "hybrid"]  # type: ignore[list-item]
        pairs, match = [p for p in TP_PAIRS if p[0] != p[1]], "NHD"
        layout = TokenLayout.NHD
    elif what == "cross_layer_head_slice":
        kinds, pairs, match = (
            [AttnKind.CROSS_LAYER],
            [p for p in TP_PAIRS if p[0] != p[1]],
            "cross-layer",
        )
    else:
        shrink = draw(st.sampled_from([2, 4]))
        kt_r, match = kt_r * shrink, "not a multiple of remote"
    kind = draw(st.sampled_from(kinds))
    tp_p, tp_d = draw(st.sampled_from(pairs))
    akind = AttnKind.BLOCKS_FIRST if kind == "hybrid" else kind
    if what in ("nhd_head_slice", "cross_layer_head_slice"):  # heads must differ per rank
        heads = [h for h in heads if heads_local(akind, h, tp_p) != heads_local(akind, h, tp_d)]
    h = draw(st.sampled_from(heads))
    kt_l = kt_r // shrink if what == "local_kernel_smaller" else kt_r * kbsr
    ppl_l, ppl_r = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    layers = draw(st.integers(1, 2))
    if kind == "hybrid":
        state = draw(state_specs(col_unit))
        hs = [heads_local(akind, h, t) for t in (tp_d, tp_p)]
        kt_l, kt_r = fit_state(state, layers, [kt_l, kt_r], [ppl_l, ppl_r], hs, [tp_d, tp_p])
    sides = []
    for side, tp, kt, ppl in (("local", tp_d, kt_l, ppl_l), ("remote", tp_p, kt_r, ppl_r)):
        nhd = layout is TokenLayout.NHD and (side == "local" or draw(st.booleans()))
        spec = LayoutSpec(
            kind=akind,
            num_layers=layers,
            num_blocks=draw(st.integers(1, 8)),
            block_size=kt * ppl,
            num_kv_heads=h,
            head_dim=4,
            tp_size=tp,
            token_layout=TokenLayout.NHD if nhd else TokenLayout.HND,
            ppl=ppl,
            state=state,
        )
        sides.append(spec)
    local, remote = sides
    if what == "nhd_head_slice" and draw(st.booleans()):  # NHD on the remote side only
        local, remote = (
            replace(local, token_layout=TokenLayout.HND),
            replace(remote, token_layout=TokenLayout.NHD),
        )
    return what, local.with_rank(draw(st.integers(0, tp_d - 1))), remote, match


@pytest.mark.parametrize("what", INVALID)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_refused_combinations(what: str, data: st.DataObject) -> None:
    _, local_spec, remote_spec, match = data.draw(invalid_cases(what))
    local = build(local_spec, LOCAL_BASE)  # both sides are valid on their own
    remotes = {
        r: build(remote_spec.with_rank(r), remote_base(r)) for r in range(remote_spec.tp_size)
    }
    with pytest.raises(IncompatibleError, match=match):
        pair_layouts(local, remotes)


def test_id_errors_are_layout_errors() -> None:
    """LayoutError, not IncompatibleError, for bad request ids (caller input)."""
    spec = LayoutSpec(AttnKind.SPLIT_KV, 1, 4, 4, 2, 4)
    peer = pair_layouts(build(spec, LOCAL_BASE), {0: build(spec, remote_base(0))})
    with pytest.raises(LayoutError, match="out of range") as err:
        plan_request(peer, [4], [0])
    assert not isinstance(err.value, IncompatibleError)


# ---------------------------------------------------------------- regressions of bugs found (fixed)


def test_cross_layer_block_size_ratio_bytes() -> None:
    local = LayoutSpec(AttnKind.CROSS_LAYER, 2, 12, 8, 4, 8)
    remote = LayoutSpec(AttnKind.CROSS_LAYER, 2, 12, 4, 4, 8)
    try:
        bad, _, _ = run_case(local, remote, [2, 9, 4], [0, 7, 3, 11, 5])
    except IncompatibleError:
        return  # refusing the pairing is an acceptable fix
    assert bad == 0


@pytest.mark.parametrize(("local_layout", "remote_layout"), [("NHD", "HND"), ("HND", "NHD")])
def test_mixed_token_layouts_refused_or_correct(local_layout: str, remote_layout: str) -> None:
    def spec(layout: str) -> LayoutSpec:
        return LayoutSpec(AttnKind.SPLIT_KV, 1, 6, 4, 4, 8, token_layout=TokenLayout(layout))

    try:
        bad, _, _ = run_case(spec(local_layout), spec(remote_layout), [1, 2], [3, 4])
    except IncompatibleError:
        return
    assert bad == 0


def test_packed_nhd_block_size_ratio_bytes() -> None:
    nhd = TokenLayout.NHD
    local = LayoutSpec(AttnKind.PACKED, 1, 6, 8, 4, 8, token_layout=nhd)
    remote = LayoutSpec(AttnKind.PACKED, 1, 10, 4, 4, 8, token_layout=nhd)
    try:
        bad, _, _ = run_case(local, remote, [2, 5], [1, 7, 3])
    except IncompatibleError:
        return  # refusing the pairing is an acceptable fix
    assert bad == 0
