"""``kvxfer plan``: input parsing (errors name the JSON path), --json values, tables, exit codes."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvxfer.cli.main import main
from kvxfer.cli.plan_cmd import plan_document
from kvxfer.cli.records import load_plan_input, pack_regions
from kvxfer.errors import LayoutError
from kvxfer.planning.pairing import pair_layouts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SPLIT = EXAMPLES / "plan-split-kv-tp1-to-tp2.json"
MiB = 1 << 20

# plan-split-kv-tp1-to-tp2.json: 2 layers, 8 blocks of 16 tokens, 8 heads x 128 x 2 B.
REMOTE_BASE, LOCAL_BASE = 268435456, 536870912
REMOTE_BLOCK = 16 * 8 * 128 * 2  # 32768: TP1 holds all 8 heads
LOCAL_BLOCK = 16 * 4 * 128 * 2  # 16384: TP2 holds 4 heads per rank
HEAD = REMOTE_BLOCK // 8  # 4096 bytes per head per block


def run_json(capsys: pytest.CaptureFixture[str], path: Path, *extra: str) -> dict[str, Any]:
    assert main(["plan", str(path), "--json", *extra]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def write(tmp_path: Path, doc: dict[str, Any], name: str = "plan.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_split_kv_tp1_to_tp2_rank1_rows_and_ids(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, SPLIT)
    assert doc["format"] == "kvxfer.planning.request/1"
    pair = doc["pairing"]
    assert (pair["mode"], pair["ratio"], pair["source_ranks"], pair["notify_only"]) == (
        "fan-in", 2, [0], []
    )  # fmt: skip
    assert pair["consumers_per_producer"] == 2 and pair["kernel_bsr"] == 1
    (src,) = pair["sources"]
    # local regions of 8 x 16 KiB, remote of 8 x 32 KiB: both round up to 1 MiB apart
    local_base = [LOCAL_BASE + i * MiB for i in range(4)]
    remote_base = [REMOTE_BASE + i * MiB for i in range(4)]
    assert src["local_rows"] == [[a, LOCAL_BLOCK, 0, LOCAL_BLOCK, 8] for a in local_base]
    # rank 1 of 2 takes heads 4..7: offset 4 heads, length 4 heads, full remote stride
    assert src["remote_rows"] == [[a + 4 * HEAD, 4 * HEAD, 0, REMOTE_BLOCK, 8] for a in remote_base]
    assert src["remote_rows"][0] == [268451840, 16384, 0, 32768, 8]
    assert (src["num_rows"], src["num_local_descriptors"], src["num_remote_descriptors"]) == (
        4, 32, 32
    )  # fmt: skip
    assert src["bytes_per_block"] == 4 * LOCAL_BLOCK
    req = doc["request"]
    # 4 views x 4 blocks; head-sliced remote rows never merge
    assert (req["num_descriptors"], req["num_runs"], req["num_bytes"]) == (16, 16, 16 * LOCAL_BLOCK)
    (ids,) = req["sources"]
    assert ids["local_ids"][:4] == [0, 1, 2, 5] and ids["local_ids"][4:8] == [8, 9, 10, 13]
    assert ids["remote_ids"][:4] == [3, 4, 5, 6] and ids["remote_ids"][-4:] == [27, 28, 29, 30]


def test_split_kv_rank0_takes_first_heads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    raw = json.loads(SPLIT.read_text())
    raw["local"]["spec"]["tp_rank"] = 0
    doc = run_json(capsys, write(tmp_path, raw))
    rows = doc["pairing"]["sources"][0]["remote_rows"]
    assert [r[0] for r in rows] == [REMOTE_BASE + i * MiB for i in range(4)]
    assert {r[1] for r in rows} == {4 * HEAD}


def test_explicit_records_merge_runs(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, EXAMPLES / "plan-explicit-records.json")
    req = doc["request"]
    # 2 dense views x 4 consecutive blocks on both sides: one run per view
    assert (req["num_descriptors"], req["num_runs"], req["num_bytes"]) == (8, 2, 8 * 4096)
    assert req["sources"][0]["remote_ids"] == [4, 5, 6, 7, 12, 13, 14, 15]
    assert doc["local"]["views"][0]["addr"] == 0x7F0000000000


def test_mla_fanout_reads_one_rank_and_notifies_the_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = run_json(capsys, EXAMPLES / "plan-mla-fanout.json")
    pair = doc["pairing"]
    assert (pair["mode"], pair["source_ranks"], pair["notify_only"]) == ("fan-out", [2], [3])
    assert doc["request"]["notify_only"] == [3]
    assert doc["request"]["num_descriptors"] == 3 * 3 and doc["request"]["num_runs"] == 3


def test_hybrid_state_rows(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, EXAMPLES / "plan-hybrid-mamba2.json")
    src = doc["pairing"]["sources"][0]
    assert src["row_is_state"] == [False] * 4 + [True] * 8
    # local rank 0 reads slot 0 of each remote sub-projection: conv x at remote offset 0
    state_lens = [r[1] for r in src["local_rows"][4:8]]
    assert state_lens == [3072, 384, 384, 16384]  # (1024, 128, 128)/2 x 3 x 2 B, 32 KiB/2
    assert doc["request"]["num_descriptors"] == 2 * 4 + 1 * 8


def test_request_only(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, SPLIT, "--request-only")
    assert set(doc) == {"format", "request"}
    assert main(["plan", str(SPLIT), "--request-only"]) == 0
    out = capsys.readouterr().out
    assert "request" in out and "views" not in out


def test_table_shows_sources_and_views(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(EXAMPLES / "plan-mla-fanout.json")]) == 0
    out = capsys.readouterr().out
    assert "source ranks" in out and "notify-only ranks" in out
    assert "L2.latent" in out and "fan-out (ratio 2)" in out
    row = next(line for line in out.splitlines() if "source ranks" in line)
    assert "2" in row.split("source ranks")[1]


def test_every_example_but_the_bad_one_plans(capsys: pytest.CaptureFixture[str]) -> None:
    for path in sorted(EXAMPLES.glob("plan-*.json")):
        code = main(["plan", str(path), "--json"])
        assert code == (2 if "bad" in path.name else 0), path.name
    capsys.readouterr()


def test_bad_stride_names_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(EXAMPLES / "plan-bad-stride.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvxfer plan: error: ")
    assert 'remote[1].views[3].stride: expected int, got "x"' in err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["local"]["spec"].pop("num_blocks"), "local.spec.num_blocks: missing field"),
        (lambda d: d["local"]["spec"].update(kind="paged"), "local.spec.kind: expected one of"),
        (lambda d: d["remote"]["spec"].update(tp_size=3), "remote.spec: num_kv_heads over"),
        (lambda d: d["local"]["spec"].update(token_layout="NHD"), "token_layout differs"),
        (lambda d: d["remote"]["spec"].update(tp_rank=0), "remote.spec.tp_rank: not allowed"),
        (lambda d: d["request"].update(local_block_ids=[0, "a"]), "request.local_block_ids[1]"),
        (lambda d: d["request"].update(local_block_ids=[0, 99, 1, 2]), "request: local_block_ids"),
        (lambda d: d.update(extra=1), "extra: unknown top-level field"),
        (lambda d: d.pop("remote"), "remote: missing field"),
        (
            lambda d: d["local"]["spec"].update(tp_rank=2),
            "local.spec: tp_rank 2 not in [0, tp_size",
        ),
    ],
)
def test_bad_fields_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, edit: Any, message: str
) -> None:
    raw = json.loads(SPLIT.read_text())
    edit(raw)
    assert main(["plan", str(write(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvxfer plan: error: ") and message in err, err


def test_missing_file_and_invalid_json_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["plan", str(tmp_path / "nope.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"local": ')
    assert main(["plan", str(bad)]) == 2
    assert "invalid JSON" in capsys.readouterr().err


def test_request_only_without_request_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    raw = json.loads(SPLIT.read_text())
    del raw["request"]
    assert main(["plan", str(write(tmp_path, raw)), "--request-only"]) == 2
    assert "request: missing field" in capsys.readouterr().err


def test_remote_list_of_records_equals_expanded_spec() -> None:
    raw = json.loads((EXAMPLES / "plan-mla-fanout.json").read_text())
    expanded = load_plan_input(raw).remotes
    listed = copy.deepcopy(raw)
    shorthand = listed.pop("remote")
    listed["remote"] = []
    region = 32 * 64 * 576 * 2  # 32 blocks x 64 tokens x 576 x 2 B = 2.25 MiB
    span = pack_regions([region] * 3 + [1], 0)[-1]  # 3 regions, 3 MiB apart: 9 MiB per rank
    assert span == 9 * MiB
    for r in range(4):  # rank r starts one span further
        spec = {**shorthand["spec"], "tp_rank": r}
        listed["remote"].append({"spec": spec, "base_addr": shorthand["base_addr"] + r * span})
    records = load_plan_input(listed).remotes
    assert list(expanded) == [2]  # decode rank 1 of 2 reads prefill rank 2 only
    assert records[2] == expanded[2]
    for r in range(4):  # a decode of TP 4: rank r reads prefill rank r
        raw["local"]["spec"].update(tp_size=4, tp_rank=r)
        assert load_plan_input(raw).remotes == {r: records[r]}


def test_remote_spec_expands_only_the_source_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """A shorthand remote of 4,096 MLA ranks builds the one rank the local side reads
    (it built all 4,096: 2.8 s and 143 MB); the plan names the rest notify-only."""
    raw = json.loads((EXAMPLES / "plan-mla-fanout.json").read_text())
    raw["remote"]["spec"]["tp_size"] = 4096
    raw["local"]["spec"].update(tp_size=1, tp_rank=0)
    inp = load_plan_input(raw)
    assert list(inp.remotes) == [0]
    peer = pair_layouts(inp.local, inp.remotes)
    assert peer.tp.source_ranks == (0,)
    assert len(peer.tp.notify_only) == 4095
    doc = plan_document(inp, peer, None)
    assert doc["remote"]["tp_size"] == 4096 and doc["remote"]["ranks"] == [0]


def test_remote_spec_expands_every_source_rank_of_a_fan_in() -> None:
    raw = json.loads(SPLIT.read_text())  # turned around: local TP 1 reads remote TP 2
    raw["local"]["spec"].update(tp_size=1, tp_rank=0)
    raw["remote"]["spec"]["tp_size"] = 2
    del raw["request"]
    inp = load_plan_input(raw)
    assert list(inp.remotes) == [0, 1]
    assert pair_layouts(inp.local, inp.remotes).tp.source_ranks == (0, 1)


def test_duplicate_remote_rank_names_the_entry() -> None:
    raw = json.loads((EXAMPLES / "plan-explicit-records.json").read_text())
    raw["remote"] = raw["remote"] * 2
    with pytest.raises(LayoutError, match=r"remote\[1\]\.tp_rank: rank 0 given twice"):
        load_plan_input(raw)


def test_toml_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("tomllib")
    path = tmp_path / "plan.toml"
    path.write_text(
        "[local]\nbase_addr = 536870912\n[local.spec]\nkind = 'split_kv'\nnum_layers = 1\n"
        "num_blocks = 4\nblock_size = 16\nnum_kv_heads = 8\nhead_dim = 128\n"
        "[remote.spec]\nkind = 'split_kv'\nnum_layers = 1\nnum_blocks = 4\nblock_size = 16\n"
        "num_kv_heads = 8\nhead_dim = 128\n"
    )
    doc = run_json(capsys, path)
    assert doc["pairing"]["source_ranks"] == [0] and doc["request"] is None


def test_module_entry_point_subprocess() -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ok = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli.main", "plan", str(SPLIT), "--json"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["request"]["num_descriptors"] == 16
    bad = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli.main", "plan", str(EXAMPLES / "plan-bad-stride.json")],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "remote[1].views[3].stride" in bad.stderr


@pytest.mark.parametrize("fmt", [["--json"], []])
def test_closed_pipe_exits_quietly(fmt: list[str]) -> None:
    """``kvxfer plan ... | head -1``: the reader goes away; exit 1 without a word, as rich
    does for the tables (``--json`` printed a BrokenPipeError traceback)."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxfer.cli.main", "plan", str(SPLIT), *fmt],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child writes: its first write gets EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1, err
    assert err == ""


def _explicit(tmp_path: Path, edit: Any) -> Path:
    raw = json.loads((EXAMPLES / "plan-explicit-records.json").read_text())
    edit(raw)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    return path


def test_names_are_printed_as_written_not_as_markup(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # "[/bold]" crashed the table (rich MarkupError); "[red]x" printed as "x"
    def edit(raw: dict[str, Any]) -> None:
        raw["local"]["views"][0]["name"] = "[/bold]"
        raw["local"]["views"][1]["name"] = "[red]x"

    assert main(["plan", str(_explicit(tmp_path, edit))]) == 0
    out = capsys.readouterr().out
    assert "[/bold]" in out and "[red]x" in out


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("\ud800", r"local.views\[0\].name: not valid UTF-8 text"),
        ("n" * 300, r"local.views\[0\].name: 300 characters exceeds the limit of 256"),
    ],
)
def test_names_that_cannot_be_printed_or_sent_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, value: str, match: str
) -> None:
    # a lone surrogate crashed the table's output (UnicodeEncodeError)
    def edit(raw: dict[str, Any]) -> None:
        raw["local"]["views"][0]["name"] = value

    assert main(["plan", str(_explicit(tmp_path, edit))]) == 2
    import re

    assert re.search(match, capsys.readouterr().err)


def test_a_hex_address_of_100000_digits_is_refused_by_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # formatting it in decimal for the message raised ValueError (4300-digit limit)
    def edit(raw: dict[str, Any]) -> None:
        raw["local"]["regions"][0]["base_addr"] = "0x" + "f" * 100_000

    assert main(["plan", str(_explicit(tmp_path, edit))]) == 2
    err = capsys.readouterr().err
    assert "local.regions[0].base_addr: an integer of 400000 bits exceeds the limit of" in err


def test_tables_of_a_huge_layout_list_the_first_views_only(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # 65,536 layers: the tables printed 131,072 view rows (minutes); --json lists all
    spec = {"kind": "blocks_first", "num_layers": 4096, "num_blocks": 1, "block_size": 16,
            "num_kv_heads": 1, "head_dim": 1, "dtype_bytes": 1}  # fmt: skip
    path = tmp_path / "deep.json"
    path.write_text(json.dumps({"local": {"spec": spec}, "remote": {"spec": spec}}))
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "8192 views" in out  # K and V of 4,096 layers
    assert "... 8064 more views (--json lists every view)" in out
    assert len(out.splitlines()) < 400
