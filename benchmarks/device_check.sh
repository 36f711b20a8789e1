#!/usr/bin/env bash
# Accelerator check in one command: compiled kernels vs references, then the
# kernel benchmark, all written under the given folder (8 minutes at most).
#   benchmarks/device_check.sh "$OUT"
set -uo pipefail
out="${1:?usage: benchmarks/device_check.sh OUT_DIR}"
cd "$(dirname "$0")/.."
mkdir -p "$out"
timeout 480 python3 benchmarks/device_check.py "$out" 2>&1 | tee "$out/device_check.log"
exit "${PIPESTATUS[0]}"
