#!/usr/bin/env bash
# One batched GPU session (see ../shared/device): GPU tests, the demo, the Hopper smoke kernel,
# the launch-overhead benchmark, and compute-sanitizer on the smoke kernel. Logs go to $OUT.
# Usage on the device machine: source .device/setup.sh && bash bench/device_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/kiln-device}; mkdir -p "$OUT"
export KILN_CACHE_DIR=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -m pytest -q -m gpu -rs tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
python3 examples/demo.py 2>&1 | tee "$OUT/demo.log" | tail -4
python3 examples/hopper_tma_wgmma_smoke.py 2>&1 | tee "$OUT/smoke.log" | tail -3
python3 bench/launch_overhead.py --json "$OUT/launch_overhead.json" 2>&1 | tee "$OUT/launch_overhead.log"
for tool in memcheck racecheck synccheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 python3 examples/hopper_tma_wgmma_smoke.py \
    > "$OUT/sanitizer_$tool.log" 2>&1; echo "compute-sanitizer $tool: exit $?"
done | tee "$OUT/sanitizer_summary.txt"
