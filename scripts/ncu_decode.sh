#!/usr/bin/env bash
# Nsight Compute's view of the Triton decode kernel at a few shapes (memory throughput, occupancy, where
# the warps stall), on the device: what the bench_attention.py timings cannot say. From the repo root:
#   bash scripts/ncu_decode.sh            # reports under $OUT/ncu_decode_*.txt, a summary printed
# Each shape runs scripts/bench_attention.py's inputs through scripts/decode_once.py; ncu profiles the
# second launch (the first compiles), clocks left alone (METHOD.md).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats"
for shape in "fp8 256 100 1124" "bf16 256 100 1124" "fp8 8 2048 2048" "fp8 256 1024 1024"; do
  read -r kind batch shortest longest <<< "$shape"
  name="ncu_decode_${kind}_${batch}x${shortest}-${longest}.txt"
  echo "== $kind batch $batch contexts $shortest-$longest"
  timeout 120 ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 1 --launch-count 1 $SECTIONS \
    python3 scripts/decode_once.py --kv-cache-dtype "$kind" --batch "$batch" --shortest "$shortest" \
    --longest "$longest" > "$OUT/$name" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Block Limit|Registers Per|Shared Memory Config|Warp Cycles Per Issued|Issued Ipc|No Eligible|Stall|L2 Hit|Mem Busy|Max Bandwidth" "$OUT/$name" | head -40
done
