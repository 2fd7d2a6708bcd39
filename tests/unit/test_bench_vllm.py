"""``kvxfer bench vllm``'s arithmetic (no vLLM here): NixlConnector's descriptor count
from the layout, and the figures and targets derived from the driver's raw output."""

from __future__ import annotations

from typing import Any

import pytest

from kvxfer.bench.vllm import analyse, excess_rows, markdown_section, table_rows
from kvxfer.bench.vllm_driver import MODEL_SHAPE, nixl_descriptors, page_bytes, pool_blocks


def test_descriptor_count_follows_the_layout() -> None:
    # 32 tokens x 1 KV head x (K+V) x 32 x 4 B = 8 KiB per (layer, block)
    assert page_bytes() == 8192
    # 1 GiB over 64 layers of 8 KiB blocks: 2048 blocks, 64 x 2048 (layer, block) descriptors
    assert pool_blocks(1.0) == 2048
    assert nixl_descriptors(pool_blocks(1.0)) == 131_072
    assert nixl_descriptors(pool_blocks(8.0)) == 1 << 20


def _pair(conn: str, gib: float, first: float, warm: list[float], equal: bool = True) -> dict[str, Any]:  # fmt: skip
    reqs = [{"first": True, "ttft_s": first, "tokens_equal": equal}]
    reqs += [{"first": False, "ttft_s": w, "tokens_equal": True} for w in warm]
    return {"connector": conn, "kv_gib": gib, "init_s": {}, "requests": reqs}


def _raw(*pairs: dict[str, Any]) -> dict[str, Any]:
    """The driver's output for ``pairs`` (3 prompts, the benchmark's model)."""
    config = {**MODEL_SHAPE, "block_size": 32, "page_bytes_per_layer": 8192,
              "vllm": "0.32.0", "prompt_lengths": [200, 256, 131], "max_tokens": 8}  # fmt: skip
    return {"config": config, "pairs": list(pairs)}


def test_analyse_ratios_and_targets() -> None:
    raw = {
        "config": {
            **MODEL_SHAPE,
            "block_size": 32,
            "page_bytes_per_layer": 8192,
            "vllm": "0.32.0",
            "prompt_lengths": [200, 256, 131, 300],
            "max_tokens": 8,
        },
        "pairs": [
            _pair("nixl", 1.0, 0.30, [0.02, 0.03, 0.04]),
            _pair("kvxfer", 1.0, 0.10, [0.01, 0.02, 0.05]),
            _pair("nixl", 4.0, 0.90, [0.02, 0.02, 0.02]),
            _pair("kvxfer", 4.0, 0.03, [0.02, 0.02, 0.02], equal=False),
        ],
    }
    doc = analyse(raw)
    kx = {r["kv_gib"]: r for r in doc["rows"] if r["connector"] == "kvxfer"}
    assert kx[1.0]["warm_ttft_s"] == 0.02
    assert abs(kx[1.0]["first_over_warm"] - 5.0) < 1e-9
    assert abs(kx[1.0]["first_over_nixl_first"] - 1 / 3) < 1e-9
    assert kx[4.0]["nixl_descriptors_per_list"] == 64 * 8192
    t = doc["targets"]
    assert t["kvxfer_first_below_nixl_every_size"] and t["gap_grows_with_size"]
    assert abs(t["kvxfer_first_over_warm_largest"] - 1.5) < 1e-9
    assert not t["first_over_warm_met"]
    assert not t["all_tokens_equal"]
    rows = table_rows(doc)
    assert [r[0] for r in rows] == ["nixl", "kvxfer", "nixl", "kvxfer"]
    assert rows[3][-1] == "3/4" and rows[1][7] == "5x"
    md = "\n".join(markdown_section(doc))
    assert (
        "| kvxfer | 4 | 8,192 | 524,288 | 30 ms | 30 ms-30 ms (n=1) | 20 ms | 1.5x | 1.5x | 0.0333x | 3/4 |"
        in md
    )
    assert "(target <= 1.2x): **MISSED**" in md and "**NOT all**" in md


def test_bench_all_keeps_the_vllm_section(tmp_path) -> None:
    from kvxfer.bench.all import _kept_sections

    md = tmp_path / "benchmarks.md"
    md.write_text(
        "# Benchmarks\n\n## Descriptors\nold\n\n## vLLM: kvxfer connector vs NixlConnector\n\nrows\n"
    )
    assert _kept_sections(md) == "\n## vLLM: kvxfer connector vs NixlConnector\n\nrows\n"
    assert _kept_sections(tmp_path / "missing.md") == ""


def test_preconnected_variant_has_its_own_targets_and_timeline() -> None:
    from kvxfer.bench.vllm import timeline_rows
    from kvxfer.bench.vllm_driver import _timeline

    raw = _raw(
        _pair("nixl", 1.0, 0.30, [0.10, 0.10]),
        _pair("kvxfer", 1.0, 0.25, [0.05, 0.05]),
        _pair("kvxfer-pre", 1.0, 0.055, [0.05, 0.05]),
        _pair("nixl", 8.0, 1.30, [0.10, 0.10]),
        _pair("kvxfer", 8.0, 0.20, [0.05, 0.05]),
        _pair("kvxfer-pre", 8.0, 0.06, [0.05, 0.05]),
    )
    # the first request's timeline: contact phases only where the read paid them
    prof = {"started_at": 10.0, "posted_at": 10.1, "finished_at": 10.12,
            "peer_timings_s": {"fetch": 0.02, "add_agent": 0.05}}  # fmt: skip
    req = {"first": True, "t_add": 9.99, "ttft_s": 0.2}
    cold = _timeline(req, {**prof, "peer_ready_at_read": False})
    pre = _timeline(req, {**prof, "peer_ready_at_read": True})
    assert cold is not None and pre is not None
    assert abs(cold["contact_add_agent"] - 0.05) < 1e-9
    assert abs(cold["read_to_post_other"] - 0.03) < 1e-9
    assert "contact_fetch" not in pre and abs(pre["read_to_post_other"] - 0.1) < 1e-9
    raw["pairs"][4]["requests"][0]["timeline_s"] = cold
    raw["pairs"][5]["requests"][0]["timeline_s"] = pre
    doc = analyse(raw)
    t, tp = doc["targets"], doc["targets"]["preconnected"]
    assert abs(t["kvxfer_first_over_warm_largest"] - 4.0) < 1e-9 and not t["first_over_warm_met"]
    assert abs(tp["kvxfer_first_over_warm_largest"] - 1.2) < 1e-9 and tp["first_over_warm_met"]
    assert tp["gaps_s"] == pytest.approx([0.245, 1.24]) and tp["gap_grows_with_size"]
    assert [r[0] for r in table_rows(doc)][:3] == ["nixl", "kvxfer", "kvxfer-pre"]
    cols, trows = timeline_rows(doc)
    assert cols[:2] == ["connector", "KV GiB"] and "contact_add_agent" in cols
    by = {r[0]: r for r in trows}
    assert by["kvxfer-pre"][cols.index("contact_add_agent")] == "-"
    assert by["kvxfer"][cols.index("contact_add_agent")] == "50 ms"
    md = "\n".join(markdown_section(doc))
    assert "- kvxfer-pre first/warm at 8.0 GiB: 1.2x (target <= 1.2x): **met**" in md
    assert "- kvxfer first/warm at 8.0 GiB: 4x (target <= 1.2x): **MISSED**" in md
    assert "kvxfer-push" not in md  # not run: no push lines


def test_push_variant_gets_its_own_targets() -> None:
    """``kvxfer-push`` (the decode in push mode) is judged like the others, against the
    same NixlConnector rows, and listed after them."""
    raw = _raw(
        _pair("kvxfer-push", 1.0, 0.09, [0.06, 0.06]),
        _pair("nixl", 1.0, 0.30, [0.10, 0.10]),
        _pair("kvxfer-push", 8.0, 0.07, [0.05, 0.05]),
        _pair("nixl", 8.0, 1.30, [0.10, 0.10]),
    )
    doc = analyse(raw)
    tp = doc["targets"]["push"]
    assert tp["gaps_s"] == pytest.approx([0.21, 1.23]) and tp["gap_grows_with_size"]
    assert tp["kvxfer_first_below_nixl_every_size"]
    assert abs(tp["kvxfer_first_over_warm_largest"] - 1.4) < 1e-9 and not tp["first_over_warm_met"]
    assert [r[0] for r in table_rows(doc)] == ["nixl", "kvxfer-push", "nixl", "kvxfer-push"]
    md = "\n".join(markdown_section(doc))
    assert "- kvxfer-push first/warm at 8.0 GiB: 1.4x (target <= 1.2x): **MISSED**" in md


def test_first_ttft_is_the_median_over_prefill_incarnations() -> None:
    """Several first requests per pair (each to a new prefill): the median is reported, with
    its range and its timeline; the gap must widen at every step up in size."""

    def pair(conn: str, gib: float, firsts: list[float]) -> dict[str, Any]:
        p = _pair(conn, gib, firsts[0], [0.05, 0.05])
        for n, f in enumerate(firsts[1:], 1):
            p["requests"].append({"first": True, "sample": n, "ttft_s": f, "tokens_equal": True,
                                  "timeline_s": {"post_to_done": f / 10}})  # fmt: skip
        return p

    raw = {
        "config": {**MODEL_SHAPE, "block_size": 32, "page_bytes_per_layer": 8192,
                   "vllm": "0.32.0", "prompt_lengths": [200, 256, 131], "max_tokens": 8,
                   "first_samples": 3},
        "pairs": [
            pair("nixl", 1.0, [0.60, 0.40, 0.50]), pair("kvxfer", 1.0, [0.30, 0.10, 0.20]),
            pair("nixl", 2.0, [2.00, 0.45, 0.55]), pair("kvxfer", 2.0, [0.10, 0.30, 0.20]),
            pair("nixl", 4.0, [0.90, 1.00, 0.95]), pair("kvxfer", 4.0, [0.20, 0.25, 0.15]),
        ],
    }  # fmt: skip
    doc = analyse(raw)
    kx = {r["kv_gib"]: r for r in doc["rows"] if r["connector"] == "kvxfer"}
    assert kx[1.0]["first_ttft_s"] == 0.20 and kx[1.0]["first_ttfts_s"] == [0.30, 0.10, 0.20]
    assert kx[1.0]["first_timeline_s"] == {"post_to_done": pytest.approx(0.02)}
    assert kx[1.0]["first_over_warm"] == pytest.approx(4.0)
    assert kx[1.0]["requests"] == 5  # 3 firsts + 2 warm, all compared
    t = doc["targets"]  # medians: nixl 0.50, 0.55, 0.95; kvxfer 0.20, 0.20, 0.20
    assert t["gaps_s"] == pytest.approx([0.30, 0.35, 0.75]) and t["gap_grows_with_size"]
    assert t["gap_largest_over_smallest"] == pytest.approx(2.5)
    raw["pairs"][3] = pair("kvxfer", 2.0, [0.30, 0.30, 0.30])  # gap 0.25 < 0.30: a dip
    assert not analyse(raw)["targets"]["gap_grows_with_size"]
    row = next(r for r in table_rows(doc) if r[:2] == ["nixl", "2"])
    assert row[4:6] == ["550 ms", "450 ms-2 s (n=3)"]
    assert "median over 3 first requests per pair" in "\n".join(markdown_section(doc))


def test_paired_first_over_warm_compares_each_first_with_its_own_incarnation() -> None:
    """Each replacement prefill's first request is judged against the warm requests to
    that same incarnation; the global warm baseline stays the first incarnation's."""

    def req(first: bool, sample: int, ttft: float, tl: dict[str, float]) -> dict[str, Any]:
        return {"first": first, "sample": sample, "ttft_s": ttft, "tokens_equal": True,
                "timeline_s": tl}  # fmt: skip

    contact = {"contact_fetch": 0.004, "contact_add_agent": 0.002}
    reqs = [
        req(True, 0, 0.060, {"post_to_done": 0.010, **contact}),
        req(False, 0, 0.050, {"post_to_done": 0.008}),
        req(False, 0, 0.052, {"post_to_done": 0.008}),
        # incarnation 1: slow host, first 0.200 vs its warm 0.180 and 0.160 (median 0.170)
        req(True, 1, 0.200, {"post_to_done": 0.050, **contact}),
        req(False, 1, 0.180, {"post_to_done": 0.040}),
        req(False, 1, 0.160, {"post_to_done": 0.030}),
        # incarnation 2: first 0.090 vs 0.080 and 0.070 (0.075)
        req(True, 2, 0.090, {"post_to_done": 0.012, **contact}),
        req(False, 2, 0.080, {"post_to_done": 0.010}),
        req(False, 2, 0.070, {"post_to_done": 0.010}),
    ]
    raw = _raw(_pair("nixl", 8.0, 1.0, [0.1, 0.1]),
               {"connector": "kvxfer", "kv_gib": 8.0, "init_s": {}, "requests": reqs})  # fmt: skip
    doc = analyse(raw)
    kx = next(r for r in doc["rows"] if r["connector"] == "kvxfer")
    assert kx["warm_ttft_s"] == pytest.approx(0.051)  # sample 0's warm only
    assert kx["first_ttft_s"] == 0.090 and kx["first_over_warm"] == pytest.approx(0.090 / 0.051)
    assert kx["paired_ratios"] == pytest.approx([0.060 / 0.051, 0.200 / 0.170, 0.090 / 0.075])
    assert kx["paired_first_over_warm"] == pytest.approx(0.200 / 0.170)
    ex = kx["paired_excess_s"]  # medians over incarnations of first minus its warm median
    assert ex["contact_fetch"] == pytest.approx(0.004)
    assert ex["post_to_done"] == pytest.approx(0.002)  # 0.002, 0.015, 0.002
    t = doc["targets"]
    assert not t["first_over_warm_met"] and t["paired_first_over_warm_met"]
    assert t["kvxfer_paired_first_over_warm_largest"] == pytest.approx(0.200 / 0.170)
    md = "\n".join(markdown_section(doc))
    assert "- kvxfer paired first/warm at 8.0 GiB" in md and "1.18x: **met**" in md
    cols, rows = excess_rows(doc)
    assert rows == [["kvxfer", "8", *(
        {"post_to_done": "+2.0 ms", "contact_fetch": "+4.0 ms", "contact_add_agent": "+2.0 ms"}[c]
        for c in cols[2:])]]  # fmt: skip
    assert "beyond the warm requests to the same prefill incarnation" in md


def test_timeline_splits_the_wait_around_first_contact() -> None:
    """A read that waited before its contact thread ran, or after the contact was ready
    for its post, shows those waits apart from the contact's own phases."""
    from kvxfer.bench.vllm_driver import _timeline

    prof = {"started_at": 10.0, "posted_at": 10.100, "finished_at": 10.120,
            "peer_timings_s": {"fetch": 0.020, "add_agent": 0.010},
            "peer_ready_at": 10.060, "peer_ready_at_read": False}  # fmt: skip
    tl = _timeline({"first": True, "t_add": 9.99, "ttft_s": 0.2}, prof)
    assert tl is not None
    assert tl["read_to_contact"] == pytest.approx(0.030)  # contact began at 10.030
    assert tl["ready_to_post"] == pytest.approx(0.040)
    assert tl["read_to_post_other"] == pytest.approx(0.0)
    assert tl["done_to_first_token"] == pytest.approx(0.070)


def test_the_chart_has_series_only_for_connectors_that_ran() -> None:
    """A run of some connectors drew empty series, and legend entries, for the others."""
    from kvxfer.bench.vllm import chart_series

    rows = [
        {"connector": c, "kv_gib": g, "first_ttft_s": f, "warm_ttft_s": f / 2}
        for c, g, f in [("kvxfer", 2, 0.2), ("nixl", 1, 0.5), ("kvxfer", 1, 0.1)]
    ]
    series = chart_series({"rows": rows})
    assert [label for label, *_ in series] == ["nixl first", "nixl warm", "kvxfer first",
                                               "kvxfer warm"]  # fmt: skip
    assert series[2][2:] == ([1, 2], [0.1, 0.2])  # by size
    assert series[3][2:] == ([1, 2], [0.05, 0.1])
