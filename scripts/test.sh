#!/usr/bin/env bash
# Lint, type-check and test. `scripts/test.sh --full` also runs the full e2e and vLLM matrix.
# the tests cover the optional torch constructor too: install the CPU torch extra
export KVXFER_WITH_TORCH="${KVXFER_WITH_TORCH:-1}"
source "$(dirname "$0")/_venv.sh"
# the vLLM connector's tests run real vLLM instances from their own venv (.venv-vllm);
# KVXFER_NO_VLLM=1 skips creating it (those tests then report a visible skip)
if [ "${KVXFER_NO_VLLM:-0}" != "1" ]; then
  source "$(dirname "$0")/_vllm_venv.sh" || echo "kvxfer: vLLM environment not created; vLLM tests will skip" >&2
fi
cd "$ROOT"
args=()
for a in "$@"; do
  if [ "$a" = "--full" ]; then args+=(-m ""); else args+=("$a"); fi
done
ruff check src tests
ruff format --check src tests
mypy
exec python -m pytest -q -p no:cacheprovider "${args[@]}"
