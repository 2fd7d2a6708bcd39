#!/usr/bin/env bash
# kvxfer inside vLLM: creates .venv-vllm on first use (a few minutes, ~3.6 GB), builds a
# tiny random model and runs examples/vllm/pd_offline.py: colocated vs P/D tokens.
source "$(dirname "$0")/_vllm_venv.sh"
cd "$ROOT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
run=("$KVXFER_VLLM_PYTHON" examples/vllm/pd_offline.py "$@")
# one vLLM job at a time on a shared machine (KVXFER_VLLM_LOCK; flock where present)
if command -v flock >/dev/null; then run=(flock "${KVXFER_VLLM_LOCK:-/tmp/kvxfer-vllm.lock}" "${run[@]}"); fi
exec "${run[@]}"
