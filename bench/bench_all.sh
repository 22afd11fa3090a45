#!/usr/bin/env bash
# One batched GPU session for speed: every benchmark in bench/, each writing its results JSON
# (bench/results_io.py: device, driver, date, commit, command, rows) and the attention PNG under
# $OUT, their printed tables appended to $OUT/bench.log (8 files in all).
# Usage on the device: source .device/setup.sh && bash bench/bench_all.sh
# Then here: python bench/results_page.py --add <fetched $OUT>/*.json [--commit HASH] files them
# under bench/results/ and regenerates bench/RESULTS.md (see bench/LEDGER.md).
set -uo pipefail
OUT=${OUT:-/tmp/kiln-bench}; mkdir -p "$OUT"
export KILN_CACHE_DIR=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/bench.log"
for bench in launch_overhead gemm decode combine attention; do
  extra=(); [ $bench = attention ] && extra=(--plot "$OUT/attention.png")
  echo "=== $bench" >> "$OUT/bench.log"
  timeout 400 python3 bench/$bench.py --json "$OUT/$bench.json" "${extra[@]}" >> "$OUT/bench.log" 2>&1
  echo "=== $bench: exit $?" | tee -a "$OUT/bench.log"
done
