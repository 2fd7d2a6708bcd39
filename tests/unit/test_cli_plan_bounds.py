"""``kvxfer plan`` on crafted files: every bad file exits 2 with one line naming the field,
fast and in bounded memory; sizes are checked against the wire's bounds before building."""

from __future__ import annotations

import copy
import json
import re
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

import kvxfer.cli.plan_cmd  # noqa: F401  (imported here, not inside the timed runs)
from kvxfer.cli.main import main
from kvxfer.wire.limits import MAX_REGIONS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BASE: dict[str, Any] = json.loads((EXAMPLES / "plan-split-kv-tp1-to-tp2.json").read_text())
EXPLICIT: dict[str, Any] = json.loads((EXAMPLES / "plan-explicit-records.json").read_text())


def with_value(doc: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[int(last) if last.isdigit() else last] = value
    return doc


def run_bad(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> str:
    """Run ``kvxfer plan`` on ``text``: exit 2, one stderr line, < 1 s, < 64 MiB traced."""
    path = tmp_path / "plan.json"
    path.write_text(text)
    t0 = time.perf_counter()
    code = main(["plan", str(path)])
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    tracemalloc.start()  # a second run, traced (tracing slows allocations down)
    try:
        assert main(["plan", str(path)]) == code
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert capsys.readouterr().err == err
    print(f"{err.strip()[:120]!r}: {elapsed * 1e3:.1f} ms, peak {peak / 2**20:.1f} MiB")
    assert code == 2, err
    assert err.startswith("kvxfer plan: error: ") and err.count("\n") == 1, err
    assert elapsed < 1.0
    assert peak < 64 << 20
    return err


SPEC_CASES = [  # (path, value, what the message must name)
    ("local.spec.num_layers", 1 << 40, r"local\.spec\.num_layers: 1099511627776 exceeds"),
    ("local.spec.num_layers", 1 << 64, r"local\.spec\.num_layers: 18446744073709551616 exceeds"),
    ("local.spec.num_layers", 10**7, r"local\.spec(\.num_layers)?: .*20000000 regions .*65536"),
    ("remote.spec.num_layers", 10**7, r"remote\.spec(\.num_layers)?: .*regions .*65536"),
    ("local.spec.block_size", 1 << 40, r"local\.spec\.block_size: 1099511627776 exceeds"),
    ("local.spec.num_blocks", 1 << 40, r"local\.spec\.num_blocks: 1099511627776 exceeds"),
    ("local.spec.head_dim", -3, r"local\.spec: head_dim must be > 0, got -3"),
    ("remote.spec.tp_size", 1 << 32, r"remote\.spec\.tp_size: 4294967296 .*4096"),
    ("local.base_addr", 1 << 64, r"local\.base_addr: 18446744073709551616 exceeds"),
    ("request.local_block_ids", [1 << 63], r"request\.local_block_ids\[0\]: 9223372036854775808"),
    ("request.remote_block_ids", [3, 1 << 70], r"request\.remote_block_ids\[1\]: .*exceeds"),
    ("request.num_cached_blocks", 1 << 63, r"request\.num_cached_blocks: .*exceeds"),
]


@pytest.mark.parametrize(("path", "value", "match"), SPEC_CASES)
def test_crafted_sizes_exit_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], path: str, value: object, match: str
) -> None:
    err = run_bad(tmp_path, capsys, json.dumps(with_value(BASE, path, value)))
    assert re.search(match, err), err


def test_huge_spec_within_field_bounds_is_refused_by_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # every field fits 2**32, but the region bytes would not fit a 64-bit address space
    doc = with_value(BASE, "local.spec.block_size", 1 << 31)
    doc = with_value(doc, "local.spec.num_blocks", 1 << 31)
    err = run_bad(tmp_path, capsys, json.dumps(doc))
    assert "local.spec" in err


def test_block_size_ratio_rows_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # local kernel blocks of 2**24 tokens over remote ones of 1 token: 2**24 rows per view
    doc = with_value(BASE, "local.spec.block_size", 1 << 24)
    doc = with_value(doc, "local.spec.num_kv_heads", 1)
    doc = with_value(doc, "local.spec.head_dim", 1)
    doc = with_value(doc, "local.spec.tp_size", 1)
    doc = with_value(doc, "local.spec.tp_rank", 0)
    doc = with_value(doc, "remote.spec.block_size", 1)
    doc = with_value(doc, "remote.spec.num_kv_heads", 1)
    doc = with_value(doc, "remote.spec.head_dim", 1)
    doc["request"] = None
    err = run_bad(tmp_path, capsys, json.dumps(doc))
    assert "block size ratio 16777216" in err


def test_explicit_record_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = with_value(EXPLICIT, "local.views.0.count", 1 << 40)
    err = run_bad(tmp_path, capsys, json.dumps(doc))
    assert "local.views[0].count: 1099511627776 exceeds" in err
    tiny = {"base_addr": 1, "num_bytes": 1}
    doc = with_value(EXPLICIT, "local.regions", [tiny] * (MAX_REGIONS + 1))
    err = run_bad(tmp_path, capsys, json.dumps(doc))
    assert f"local.regions: {MAX_REGIONS + 1} regions exceed the limit of {MAX_REGIONS}" in err


def test_explicit_descriptor_total_and_rank_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    view = dict(EXPLICIT["local"]["views"][0], count=1 << 32, stride=1, length=1, offset=0)
    doc = with_value(EXPLICIT, "local.views", [view, view])
    err = run_bad(tmp_path, capsys, json.dumps(doc))
    assert "local.views: 8589934592 descriptors in all exceed the limit of 4294967296" in err
    doc = with_value(EXPLICIT, "remote", [{"spec": {}}] * 4097)
    err = run_bad(tmp_path, capsys, json.dumps(doc))
    assert "remote: 4097 records exceed the limit of 4096 ranks" in err


def test_deeply_nested_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = json.dumps(BASE)[:-1] + ', "description": ' + "[" * 100_000 + "]" * 100_000 + "}"
    err = run_bad(tmp_path, capsys, text)
    assert "nested" in err


def test_hundred_thousand_digit_integer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = json.dumps(BASE).replace('"num_layers": 2', '"num_layers": ' + "9" * 100_001, 1)
    err = run_bad(tmp_path, capsys, text)
    assert "local.spec.num_layers: integer of 100001 digits" in err


def test_huge_file_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    with path.open("wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB of zeros
    assert main(["plan", str(path)]) == 2
    assert "exceeds the limit" in capsys.readouterr().err


def test_row_bound_is_the_wire_view_bound() -> None:
    from kvxfer.planning.pairing import MAX_ROWS
    from kvxfer.wire.limits import MAX_VIEWS

    assert MAX_ROWS == MAX_VIEWS


def test_duplicate_local_ids_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = with_value(BASE, "request.local_block_ids", [3, 3, 1, 2])
    err = run_bad(tmp_path, capsys, json.dumps(doc))
    assert "request: local_block_ids: block 3 given twice" in err
