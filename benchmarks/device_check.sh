#!/usr/bin/env bash
# Accelerator check in one command: compiled kernels vs references, the
# kernel benchmark at SmolLM2-135M's attention shape, then model-level TTFT
# and decode, all written under the given folder (9 minutes at most; each
# section writes its files as soon as it ends, see device_check.py).
#   benchmarks/device_check.sh "$OUT"
set -uo pipefail
out="${1:?usage: benchmarks/device_check.sh OUT_DIR}"
cd "$(dirname "$0")/.."
mkdir -p "$out"
timeout 540 python3 benchmarks/device_check.py "$out" 2>&1 | tee "$out/device_check.log"
exit "${PIPESTATUS[0]}"
