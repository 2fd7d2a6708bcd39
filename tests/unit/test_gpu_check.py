"""scripts/gpu-check.sh's module: without a GPU it says so and exits 0; its two-process
harness moves and verifies every byte (run here on DRAM, the same code as VRAM cases)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.bench.gpu_check import cuda_problem, main, pattern

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(cuda_problem() is None, reason="a GPU is present: the real check runs")
def test_without_a_gpu_it_says_so_and_exits_0() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.bench.gpu_check"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0
    assert out.stdout.startswith("gpu-check: not run: ")
    assert "VRAM cases need CUDA and a GPU" in out.stdout


def test_pattern_differs_per_seed() -> None:
    a, b = pattern(1 << 16, 1), pattern(1 << 16, 2)
    assert a.dtype.name == "uint8" and a.shape == (1 << 16,)
    assert int((a == b).sum()) == 0


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None, reason="no NIXL")
def test_two_process_harness_verifies_every_byte(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cases", "dram->dram", "--mib", "4", "--chunk-kib", "256", "--repeat", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["case", "MiB", "descriptors", "GB/s", "bytes", "verified"]
    case, mib, descs, gbs, verified = lines[1].split()
    assert (case, mib, descs, verified) == ("dram->dram", "4", "16", "all")
    assert float(gbs) > 0


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None, reason="no NIXL")
def test_engine_case_moves_a_request_between_engine_processes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The engine cases run a Producer in a spawned process and a Consumer here over
    buffers of the case's kind (VRAM given as DeviceBuffers); run here on DRAM."""
    assert main(["--cases", "engine:dram->dram", "--repeat", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    case, mib, descs, gbs, verified = lines[1].split()
    assert (case, verified) == ("engine:dram->dram", "all")
    assert int(descs) > 0 and float(mib) > 0 and float(gbs) > 0
