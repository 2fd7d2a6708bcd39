"""Installing kvxfer as a library: without NIXL the planner and CLI work and engines raise
one typed error naming the install line; a built wheel installs into a bare venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import kvxfer
from kvxfer.errors import BackendUnavailableError, KvxferError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plan-split-kv-tp1-to-tp2.json"
INSTALL_LINE = "pip install --no-deps nixl-cu12"

# Runs in a child where ``import nixl_cu12`` fails (a None entry in sys.modules).
_NO_NIXL = (
    "import sys; sys.modules['nixl_cu12'] = None; sys.modules['nixl_cu12._bindings'] = None\n"
)

_ENGINE_WITHOUT_NIXL = """
import kvxfer, kvxfer.engine
from kvxfer.engine import EngineConfig, allocate_cache
spec = kvxfer.spec_for("tiny-gqa", num_blocks=4)
try:
    kvxfer.engine.Consumer(EngineConfig("c"), [(spec, allocate_cache(spec))])
except kvxfer.errors.BackendUnavailableError as exc:
    consumer_message = str(exc)
try:
    kvxfer.engine.Producer(EngineConfig("p"), [(spec, allocate_cache(spec))])
except kvxfer.errors.BackendUnavailableError as exc:
    assert str(exc) == consumer_message
    print(type(exc).__name__, isinstance(exc, ImportError), isinstance(exc, kvxfer.KvxferError))
    print(exc)
"""


def _child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_backend_unavailable_error_is_import_error() -> None:
    assert issubclass(BackendUnavailableError, ImportError)
    assert issubclass(BackendUnavailableError, KvxferError)
    assert kvxfer.BackendUnavailableError is BackendUnavailableError


def test_engine_without_nixl_names_the_install_line() -> None:
    out = _child(_NO_NIXL + _ENGINE_WITHOUT_NIXL)
    assert out.returncode == 0, out.stderr
    first, message = out.stdout.split("\n", 1)
    assert first == "BackendUnavailableError True True"
    assert INSTALL_LINE in message
    assert "torch" in message and "CUDA" in message  # says why --no-deps


def test_cli_help_plan_and_version_without_nixl() -> None:
    code = _NO_NIXL + "import sys\nfrom kvxfer.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    plan = _child(code, "plan", str(EXAMPLE))
    assert plan.returncode == 0, plan.stderr
    assert "descriptor" in plan.stdout.lower()
    version = _child(code, "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"kvxfer {kvxfer.__version__}"
    helped = _child(code, "--help")
    assert helped.returncode == 0 and "plan" in helped.stdout


def test_help_and_plan_do_not_load_nixl_or_zmq() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from kvxfer.cli.main import build_parser, main\n"
        "build_parser().format_help()\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['plan', sys.argv[1]]) == 0\n"
        "print(sorted(m for m in ('nixl_cu12', 'zmq') if m in sys.modules))\n"
    )
    out = _child(code, str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_version_comes_from_package_metadata() -> None:
    from importlib.metadata import version

    assert kvxfer.__version__ == version("kvxfer")
    if sys.version_info >= (3, 11):
        import tomllib

        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        assert kvxfer.__version__ == project["version"]


def test_library_adds_only_a_null_handler() -> None:
    import logging

    code = "import logging, kvxfer, kvxfer.engine\nprint(logging.getLogger('kvxfer').handlers, logging.getLogger().handlers)"
    out = _child(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[<NullHandler (NOTSET)>] []"
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("kvxfer").handlers)


def test_cli_configures_logging_library_does_not() -> None:
    code = (
        "import contextlib, io, logging, sys\n"
        "import kvxfer.engine\n"
        "before = list(logging.getLogger().handlers)\n"
        "from kvxfer.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--log-level', 'info', 'plan', sys.argv[1]])\n"
        "root = logging.getLogger()\n"
        "print(before, len(root.handlers), logging.getLevelName(root.level))\n"
    )
    out = _child(code, str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] 1 INFO"


def _has_setuptools_77() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 77


def _copy_tree(dst: Path) -> Path:
    """The files a wheel is built from, outside the worktree (no build/ or egg-info there)."""
    dst.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, dst / name)
    shutil.copytree(
        ROOT / "src", dst / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    return dst


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["wheel", "tree"])
def test_installs_into_a_bare_venv(tmp_path: Path, how: str) -> None:
    """Fresh venv (no system site-packages, no NIXL): install a built wheel (``wheel``) or
    the source tree (``tree``, i.e. ``pip install .``), then use it."""
    src = _copy_tree(tmp_path / "tree")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, system_site_packages=False)
    bin_dir = env_dir / "bin"
    # this interpreter's pip installs into the venv (--python): no ensurepip run there
    pip = [sys.executable, "-m", "pip", "--python", str(bin_dir / "python")]
    pip += ["--disable-pip-version-check", "-q"]

    def run(*cmd: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return subprocess.run(
            cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=180
        )

    # built with this interpreter's setuptools when it is new enough (SPDX license needs
    # >= 77): no isolated build env to download; otherwise pip builds in one
    isolation = ["--no-build-isolation"] if _has_setuptools_77() else []
    if how == "wheel":
        built = run(
            sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel",
            "--no-deps", *isolation, "-w", str(tmp_path / "dist"), str(src),
        )  # fmt: skip
        assert built.returncode == 0, built.stderr
        (wheel,) = (tmp_path / "dist").glob("kvxfer-*.whl")
        assert wheel.name.startswith(f"kvxfer-{kvxfer.__version__}-")
        installed = run(*pip, "install", str(wheel))
    else:
        installed = run(*pip, "install", str(src))  # builds in an isolated env, as users do
    assert installed.returncode == 0, installed.stderr

    version = run(str(bin_dir / "kvxfer"), "--version")
    assert version.stdout.strip() == f"kvxfer {kvxfer.__version__}", version.stderr
    helped = run(str(bin_dir / "kvxfer"), "--help")
    assert helped.returncode == 0 and "plan" in helped.stdout, helped.stderr
    plan = run(str(bin_dir / "python"), "-m", "kvxfer", "plan", str(EXAMPLE))
    assert plan.returncode == 0, plan.stderr
    assert "descriptor" in plan.stdout.lower()
    engine = run(str(bin_dir / "python"), "-c", _ENGINE_WITHOUT_NIXL)
    assert engine.returncode == 0, engine.stderr
    assert engine.stdout.startswith("BackendUnavailableError True True\n")
    assert INSTALL_LINE in engine.stdout
    no_nixl = run(
        str(bin_dir / "python"), "-c", "import importlib.util as u; print(u.find_spec('nixl_cu12'))"
    )
    assert no_nixl.stdout.strip() == "None"
    licensed = run(
        str(bin_dir / "python"),
        "-c",
        "from importlib.metadata import metadata as m; md = m('kvxfer'); print(md.get('License-Expression') or md.get('License'))",
    )
    assert licensed.stdout.strip() == "Apache-2.0"
