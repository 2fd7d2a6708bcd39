#!/usr/bin/env bash
# Run every benchmark at full size: JSON + PNG into docs/bench/, regenerate docs/benchmarks.md.
# `scripts/bench.sh --quick` runs the small sizes (about a minute).
source "$(dirname "$0")/_venv.sh"
cd "$ROOT"
exec kvxfer bench all --out-dir docs/bench --md docs/benchmarks.md "$@"
