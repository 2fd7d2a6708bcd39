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
export PATH="$VENV/bin:$PATH"
