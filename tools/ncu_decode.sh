#!/usr/bin/env bash
# Nsight Compute's view of the Triton decode kernel at a few shapes (throughput, occupancy, stalls).
#   bash tools/ncu_decode.sh     # from the repo root: reports under $OUT/ncu_decode_*.txt
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats"
SECTIONS+=" --section MemoryWorkloadAnalysis --section SchedulerStats"
METRICS="Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy"
METRICS+="|Theoretical Occupancy|Block Limit|Registers Per|Shared Memory Config"
METRICS+="|Warp Cycles Per Issued|Issued Ipc|No Eligible|Stall|L2 Hit|Mem Busy|Max Bandwidth"
for shape in "fp8 256 100 1124" "bf16 256 100 1124" "fp8 8 2048 2048" "fp8 256 1024 1024"; do
  read -r kind batch shortest longest <<< "$shape"
  name="ncu_decode_${kind}_${batch}x${shortest}-${longest}.txt"
  echo "== $kind batch $batch contexts $shortest-$longest"
  # the first launch compiles: profile the second, clocks left alone
  timeout 120 ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 1 \
    --launch-count 1 $SECTIONS python3 -m tools.decode_once --kv-cache-dtype "$kind" \
    --batch "$batch" --shortest "$shortest" --longest "$longest" > "$OUT/$name" 2>&1
  grep -E "$METRICS" "$OUT/$name" | head -40
done
