#!/usr/bin/env bash
# One batched GPU session for correctness (see ../shared/device): every `gpu` test, the demo,
# and compute-sanitizer (memcheck, racecheck, synccheck) on the Hopper smoke kernel, the prefill
# kernel (one causal GQA, one ragged and one long unmasked call) and the decode/combine GPU
# tests (partial pages, empty selections). Full logs are packed into $OUT/logs.tar.gz;
# summaries print last.
# Usage on the device machine: source .device/setup.sh && bash bench/device_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/kiln-device}; mkdir -p "$OUT"
LOGS=$(mktemp -d)
export KILN_CACHE_DIR=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
timeout 400 python3 -m pytest -q -m gpu -rs tests > "$LOGS/pytest_gpu.log" 2>&1
echo "pytest -m gpu: exit $?" | tee "$OUT/summary.txt"
tail -40 "$LOGS/pytest_gpu.log" > "$OUT/pytest_gpu_tail.txt"
timeout 120 python3 examples/demo.py > "$LOGS/demo.log" 2>&1; echo "demo: exit $?" | tee -a "$OUT/summary.txt"
timeout 300 python3 examples/attention_demo.py > "$LOGS/attention_demo.log" 2>&1
echo "attention demo: exit $?" | tee -a "$OUT/summary.txt"
run_sanitized() {  # tool, name, command...
  local tool=$1 name=$2; shift 2
  timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$@" > "$LOGS/san_${tool}_$name.log" 2>&1
  echo "compute-sanitizer $tool $name: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$LOGS/san_${tool}_$name.log") clean summaries)"
}
for tool in memcheck racecheck synccheck; do
  run_sanitized $tool smoke python3 examples/hopper_tma_wgmma_smoke.py
  run_sanitized $tool prefill python3 bench/attention.py --sanitize
  run_sanitized $tool decode_combine python3 -m pytest -q -x -m gpu tests/test_attention_decode*.py tests/test_attention_combine.py
done | tee -a "$OUT/summary.txt"
tar -C "$LOGS" -czf "$OUT/logs.tar.gz" .
