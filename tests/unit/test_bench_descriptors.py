"""``kvxfer bench descriptors --quick``: document structure and correctness (no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvxfer.bench.descriptors import BUILDERS, bench_layout, fill_contiguous, fill_floor
from kvxfer.bench.report import dumps_json
from kvxfer.cli.main import main
from kvxfer.planning.descriptors import dense_rows, layout_rows, reference_rows


def test_quick_writes_json_and_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "b.json", tmp_path / "sub" / "b.png"
    pytest.importorskip("matplotlib")
    code = main(
        ["bench", "descriptors", "--quick", "--repeat", "1", "--json", str(out_json),
         "--png", str(out_png)]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "descriptors" in out and "dense/floor" in out
    doc = json.loads(out_json.read_text())
    assert doc["benchmark"] == "descriptors"
    assert doc["config"]["blocks"] == [1000, 2000] and doc["config"]["num_views"] == 16
    assert {"platform", "cpu_count", "numpy"} <= set(doc["machine"])
    assert doc["targets"]["evaluated"] is False  # quick sizes are far below 6.5 M
    for r, nb in zip(doc["results"], (1000, 2000), strict=True):
        assert (r["num_blocks"], r["num_descriptors"]) == (nb, nb * 16)
        assert r["verified"] is True
        assert set(BUILDERS) <= set(r["seconds"]) and set(BUILDERS) == set(r["peak_bytes"])
        assert all(r["seconds"][k] > 0 for k in BUILDERS)
        assert r["peak_bytes"]["dense"] >= nb * 16 * 3 * 8  # the (M, 3) output at least
        assert set(r["ratios"]) >= {"dense_over_floor", "dense_over_strided", "loop_over_dense"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rows_equal_reference_loop() -> None:
    layout = bench_layout(1000, 16)
    rows = layout_rows(layout)  # (16, 5)
    dense = dense_rows(rows)
    ref = np.array(reference_rows(rows), dtype=np.uint64)
    assert dense.shape == (16_000, 3)
    np.testing.assert_array_equal(dense, ref)
    # view-major, block-minor: block 1 of view 1 sits one stride after its block 0
    assert dense[1001, 0] - dense[1000, 0] == rows[1, 3]


def test_floors_have_the_dense_shape() -> None:
    for fill in (fill_floor, fill_contiguous):
        out = fill(10)
        assert out.shape == (10, 3) and out.dtype == np.uint64 and out.flags.c_contiguous


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "descriptors", "--views", "3"]) == 2
    assert "--views" in capsys.readouterr().err
    assert main(["bench"]) == 2


def test_dumps_json_keeps_rows_on_one_line() -> None:
    text = dumps_json({"rows": [[1, 2, 3], [4, 5, 6]], "ids": [1, 2], "x": {"a": 1}})
    assert "[1, 2, 3]" in text and "[1, 2]" in text and '"x": {"a": 1}' in text
    assert json.loads(text) == {"rows": [[1, 2, 3], [4, 5, 6]], "ids": [1, 2], "x": {"a": 1}}
