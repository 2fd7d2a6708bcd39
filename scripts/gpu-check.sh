#!/usr/bin/env bash
# NIXL moves VRAM->VRAM, DRAM->VRAM and VRAM->DRAM between two processes; every byte is
# verified and GB/s printed. Without a CUDA driver or a GPU it says so and exits 0.
# Options: --mib N (default 256) --chunk-kib N --repeat R --devices SRC DST --cases ...
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
exec python -m kvxfer.bench.gpu_check "$@"
