#!/usr/bin/env bash
# Lint, type-check and test. `scripts/test.sh --full` also runs the full e2e matrix.
# the tests cover the optional torch constructor too: install the CPU torch extra
export KVXFER_WITH_TORCH="${KVXFER_WITH_TORCH:-1}"
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
args=()
for a in "$@"; do
  if [ "$a" = "--full" ]; then args+=(-m ""); else args+=("$a"); fi
done
ruff check src tests
ruff format --check src tests
mypy
exec python -m pytest -q -p no:cacheprovider "${args[@]}"
