"""Quick modes of ``kvxfer bench first-contact / per-request / bandwidth / all``.

Document structure and verified bytes only: no timing assertions. The multi-process
benchmarks are marked e2e.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl_cu12")

from kvxfer.bench.coalescing import _chunks, coalesced_ids, coalesced_rows
from kvxfer.cli.main import main

pytestmark = pytest.mark.timeout(120)

PNG = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["bench", *argv, "--quick", "--json", str(out_json), "--png", str(out_png)]) == 0
    assert out_png.read_bytes()[:8] == PNG
    doc: dict[str, Any] = json.loads(out_json.read_text())
    assert {"platform", "cpu_count", "numpy"} <= set(doc["machine"])
    return doc


@pytest.mark.e2e
def test_first_contact_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    doc = _run(tmp_path, "first-contact")
    assert "first contact" in capsys.readouterr().out
    assert doc["benchmark"] == "first_contact" and doc["config"]["blocks"] == [1000, 5000]
    for r in doc["results"]:
        assert r["verified"] is True
        assert r["num_descriptors"] == r["num_blocks"] * doc["config"]["num_views"]
        for mode in ("strided", "runs", "dense"):
            m = r[mode]
            assert m["verified"] is True and not m["errors"]
            assert set(m["phases_s"]) == {"fetch", "add_agent", "build", "prepare", "xfer",
                                          "verify", "other"}  # fmt: skip
            if mode != "runs":  # run rows add descriptors to the lists
                assert m["request_descriptors"] == 64 * doc["config"]["num_views"]
                assert m["num_descriptors"] == 2 * r["num_descriptors"]  # local + remote
        assert set(r["ratios"]) >= {"dense_over_strided_build_prepare", "dense_over_strided_total"}
    assert doc["targets"]["evaluated"] is False


def test_per_request_quick(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    doc = _run(tmp_path, "per-request", "--repeat", "1")
    assert doc["benchmark"] == "per_request"
    cases = {(r["tp"], r["tokens"], r["contiguous"]) for r in doc["results"]}
    assert len(cases) == 3 * 2 * 2
    for r in doc["results"]:
        assert r["verified"] is True and r["preset_counts_match"] is True
        assert r["num_runs"] <= r["num_descriptors"]
        assert set(r["cpu_s"]) == set(r["wall_s"]) == {"ids", "make", "post", "done"}
        blocks = r["tokens"] // 16 * 2 * doc["config"]["num_layers"]
        assert r["num_descriptors"] == blocks * (2 if r["tp"].startswith("2->1") else 1)
    assert len(doc["coalesced"]) in (4, 8) and all(c["verified"] for c in doc["coalesced"])
    contig = [c for c in doc["coalesced"] if c["contiguous"] and c["variant"] == "prototype"]
    assert all(c["num_descriptors"] == 2 * doc["config"]["num_layers"] for c in contig)  # 1 a view
    assert doc["targets"]["evaluated"] is False  # 8K tokens are not in the quick sizes


@pytest.mark.e2e
def test_bandwidth_quick(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    doc = _run(tmp_path, "bandwidth", "--repeat", "1")
    assert doc["benchmark"] == "bandwidth" and doc["memcpy_gbps"] > 0
    assert {p["op"] for p in doc["sizes"]} == {"READ", "WRITE"}
    assert len(doc["sizes"]) == 2 * len(doc["config"]["sizes"])
    assert all(p["verified"] for p in doc["sizes"] + doc["runs"])
    assert all(p["gbps"] > 0 for p in doc["sizes"] + doc["runs"])
    assert doc["targets"]["evaluated"] is True


@pytest.mark.e2e
def test_hold_check_quick(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    doc = _run(tmp_path, "hold-check", "--repeat", "5", "--blocks", "1", "4")
    assert doc["benchmark"] == "hold_check"
    assert [r["blocks"] for r in doc["results"]] == [1, 4]
    for r in doc["results"]:
        assert r["verified"] is True
        assert len(r["samples"]["with"]) == len(r["samples"]["without"]) == 5
        med = r["median_s"]
        assert r["extra_median_s"] == pytest.approx(med["with"] - med["without"])
        assert r["descriptors"] == r["blocks"] * doc["config"]["num_views"]


@pytest.mark.e2e
def test_all_quick_writes_every_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import kvxfer.bench.all as all_mod

    # the other quick modes are covered above: stub them to keep this test short
    def fake_args(name: str, quick: bool, seed: int, out: Path) -> Any:
        args = real_args(name, quick, seed, out)
        if name == "first_contact":
            args.blocks = [1000]
        return args

    real_args = all_mod._args
    monkeypatch.setattr(all_mod, "_args", fake_args)
    md = tmp_path / "docs" / "benchmarks.md"
    assert main(["bench", "all", "--quick", "--out-dir", str(tmp_path / "docs" / "bench"),
                 "--md", str(md)]) == 0  # fmt: skip
    for name in all_mod.BENCHES:
        assert (tmp_path / "docs" / "bench" / f"{name}.png").read_bytes()[:8] == PNG
        assert json.loads((tmp_path / "docs" / "bench" / f"{name}.json").read_text())
    text = md.read_text()
    assert "Machine:" in text and "nixl-cu12" in text and "(bench/per_request.png)" in text
    assert text.count("\n## ") == 5 and "## Hold check" in text


def test_coalesced_chunks_cover_runs() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 600))
        lk = np.sort(rng.choice(4000, n, replace=False)).astype(np.int64)
        rk = (lk + 3) if rng.random() < 0.5 else rng.permutation(lk)
        w, lb, rb = _chunks(lk, rk, 5)
        assert int((1 << w).sum()) == n  # chunks cover the request exactly
        cover = np.concatenate([lb[i] + np.arange(1 << w[i]) for i in range(w.size)])
        assert np.array_equal(np.sort(cover), lk)
        pair = dict(zip(lk.tolist(), rk.tolist(), strict=True))
        for i in range(w.size):  # each chunk is contiguous on both sides
            assert all(pair[int(lb[i]) + j] == int(rb[i]) + j for j in range(1 << int(w[i])))


def test_coalesced_ids_address_the_same_bytes() -> None:
    # 2 dense views of 64 blocks of 16 B; ids into coalesced rows -> (addr, len) pairs
    rows = np.array([[1 << 20, 16, 0, 16, 64], [1 << 21, 16, 0, 16, 64]], dtype=np.uint64)
    crow, table = coalesced_rows(rows, 9)
    assert table.shape[0] == 6  # widths 1..32: 2^(K+1) <= 64 blocks
    starts = np.zeros(crow.shape[0] + 1, dtype=np.int64)
    np.cumsum(crow[:, 4], out=starts[1:])

    def extent(i: int) -> tuple[int, int]:
        r = int(np.searchsorted(starts, i, side="right")) - 1
        a, ln, _, st, _ = (int(x) for x in crow[r])
        return a + (i - int(starts[r])) * st, ln

    lids = np.array([3, 4, 5, 6, 7, 8, 9, 20, 40, 41], dtype=np.int64)
    loc, rem = coalesced_ids(table, table, lids, lids)
    got = sorted(extent(int(i)) for i in loc)
    want = []  # bytes covered per view, merged
    for v in range(2):
        base = (1 << 20) * (v + 1)
        want += [(base + 3 * 16, 7 * 16), (base + 20 * 16, 16), (base + 40 * 16, 32)]
    assert sum(ln for _, ln in got) == sum(ln for _, ln in want)
    covered = {a + k for a, ln in got for k in range(0, ln, 16)}
    assert covered == {a + k for a, ln in want for k in range(0, ln, 16)}
    assert np.array_equal(loc, rem)
