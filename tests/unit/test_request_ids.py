"""RequestIds: one request's ids as one value; ``.plan(peer)`` is ``plan_request(peer, ...)``."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.errors import LayoutError
from kvxfer.layout.model import CacheLayout
from kvxfer.layout.presets import spec_for
from kvxfer.layout.spec import LayoutSpec
from kvxfer.planning.pairing import PeerPlan, pair_layouts
from kvxfer.planning.request import RequestIds, RequestPlan, plan_request


def build(spec: LayoutSpec, base: int) -> CacheLayout:
    return spec.build([base + i * (1 << 36) for i in range(len(spec.region_bytes()))])


def hybrid_peer() -> PeerPlan:
    """A nemotron-h (attention + Mamba state) consumer at TP2 reading a TP4 producer."""
    local = build(spec_for("nemotron-h", tp_rank=0, tp_size=2, num_blocks=16), 1 << 40)
    remotes = {
        r: build(spec_for("nemotron-h", tp_rank=r, tp_size=4, num_blocks=12), (1 << 44) * (r + 1))
        for r in (0, 1)
    }
    return pair_layouts(local, remotes)


def assert_same_plan(got: RequestPlan, want: RequestPlan) -> None:
    assert got.notify_only == want.notify_only
    assert len(got.sources) == len(want.sources)
    for g, w in zip(got.sources, want.sources, strict=True):
        assert g.rank == w.rank
        assert g.local_ids.dtype == w.local_ids.dtype and g.remote_ids.dtype == w.remote_ids.dtype
        np.testing.assert_array_equal(g.local_ids, w.local_ids)
        np.testing.assert_array_equal(g.remote_ids, w.remote_ids)
        assert g.num_block_descriptors == w.num_block_descriptors
        assert g.num_runs == w.num_runs


def test_plan_equals_plan_request_with_state_ids_and_cached_blocks() -> None:
    peer = hybrid_peer()
    assert len(peer.sources) == 2  # both producer ranks are sources
    ids = RequestIds.of(
        [3, 7, 1, 9], (2, 5, 11, 0), local_state=[4, 6], remote_state=[8, 10], num_cached_blocks=1
    )
    assert ids.local.dtype == ids.remote.dtype == np.int64
    assert ids.local_state is not None and ids.local_state.dtype == np.int64
    want = plan_request(
        peer,
        [3, 7, 1, 9],
        [2, 5, 11, 0],
        local_state_ids=[4, 6],
        remote_state_ids=[8, 10],
        num_cached_blocks=1,
    )
    assert want.num_descriptors > 0
    assert_same_plan(ids.plan(peer), want)


def test_defaults_plan_like_plan_request_defaults() -> None:
    spec = spec_for("tiny-gqa", tp_rank=0, tp_size=1, num_blocks=16)
    peer = pair_layouts(build(spec, 1 << 40), {0: build(spec, 1 << 44)})
    ids = RequestIds.of([3, 7], [2, 5])
    assert ids.local_state is None and ids.remote_state is None and ids.num_cached_blocks == 0
    assert_same_plan(ids.plan(peer), plan_request(peer, [3, 7], [2, 5]))
    assert_same_plan(RequestIds.of([], []).plan(peer), plan_request(peer, [], []))
    # a hybrid pool has no default state ids (a block is attention or state): both refuse
    with pytest.raises(LayoutError, match="needs local_state_ids and remote_state_ids"):
        ids.plan(hybrid_peer())


@pytest.mark.parametrize(
    ("lids", "rids", "match"),
    [
        ([1.5, 2.0], [3, 4], "local_block_ids must be integers, got float64"),
        ([True, False], [3, 4], "local_block_ids must be integers, got bool"),
        ([1, 2], ["3", "4"], "remote_block_ids must be integers"),
        ([[1, 2]], [3, 4], r"local_block_ids must be 1-D"),
        ([1, 20], [3, 4], "local_block_ids: block id 20 out of range"),
    ],
)
def test_of_leaves_validation_to_plan_request(lids: object, rids: object, match: str) -> None:
    ids = RequestIds.of(lids, rids)  # type: ignore[arg-type]  # no error here: plan validates
    with pytest.raises(LayoutError, match=match):
        ids.plan(hybrid_peer())
