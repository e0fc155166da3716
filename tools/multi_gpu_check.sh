#!/usr/bin/env bash
# The multi-GPU figures and tests in one call, on a machine of N GPUs; logs under $OUT.
#   bash tools/multi_gpu_check.sh            # from the repo root; STEPS selects parts (default all)
# STEPS: space-separated of tests dp tp moe. Ray must be importable for `dp` and the Ray tests;
# the Qwen3-8B and Qwen3-30B-A3B random checkpoints are written once under
# $XDG_CACHE_HOME/nanovllm (~/.cache/nanovllm)
# (16 GiB and 57 GiB: RANDOM_LAYERS=24 halves the MoE one on a small disk).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests dp tp moe}
STEP_TIMEOUT=${STEP_TIMEOUT:-540}
N=$(nvidia-smi -L | wc -l)
FILTER="Writing|Loading|it/s\]|Warning|_warn_once"
MOE_LAYERS=${RANDOM_LAYERS:+--random-layers $RANDOM_LAYERS}
run() {  # run <label> <command...>
  echo "== [$1] ${*:2}" | tee -a "$OUT/multi_gpu.txt"
  timeout "$STEP_TIMEOUT" "${@:2}" 2>&1 | grep -vE "$FILTER" | tee -a "$OUT/multi_gpu.txt"
}
echo "$N GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c)" \
  | tee "$OUT/multi_gpu.txt"
for step in $STEPS; do
  case $step in
    tests)  # every cuda test, the 2-GPU ones (NCCL) included
      run tests python3 -m pytest -q -rs -m cuda tests/runner tests/engine tests/models ;;
    dp)  # Ray replicas, one a GPU, against one plain engine: scaling efficiency
      run dp python3 -m benchmarks.data_parallel --data-parallel-size "$N" --runs 2 ;;
    tp)  # Qwen3-8B at each tensor-parallel size the machine holds
      for tp in 1 2 4 8; do
        if [ "$tp" -le "$N" ]; then
          run "tp=$tp" python3 bench.py --random-arch qwen3-8b --tensor-parallel-size "$tp" --runs 2
          run "tp=$tp" python3 bench.py --random-arch qwen3-8b --tensor-parallel-size "$tp" \
            --single-stream --runs 2
        fi
      done ;;
    moe)  # Qwen3-30B-A3B over all GPUs: experts sliced (TP), then whole experts a GPU (EP)
      run "moe tp=$N" python3 bench.py --random-arch qwen3-30b-a3b $MOE_LAYERS \
        --tensor-parallel-size "$N" --runs 2
      run "moe ep=$N" python3 bench.py --random-arch qwen3-30b-a3b $MOE_LAYERS \
        --tensor-parallel-size "$N" --expert-parallel --runs 2 ;;
  esac
done
