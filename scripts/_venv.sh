# Sourced by scripts/demo.sh and scripts/test.sh: creates .venv on first use and
# re-installs when pyproject.toml changes. Never pulls a CUDA torch build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVXFER_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.kvxfer-stamp"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_venv.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "kvxfer: setting up $VENV (first use)" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  # nixl-cu12 declares torch but never imports it: install it alone, without deps.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "nixl-cu12>=1.5,<2"
  "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[dev,bench]"
  echo "$want" > "$stamp"
fi
if [ "${KVXFER_WITH_TORCH:-0}" = "1" ] && ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  # the optional extra, CPU build from this machine's wheel cache (a bare `torch` is CUDA)
  echo "kvxfer: installing the optional CPU torch==2.13.0" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
fi
export PATH="$VENV/bin:$PATH"
