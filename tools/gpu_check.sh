#!/usr/bin/env bash
# The GPU tests, then benchmarks, in one device call; logs under $OUT.
#   bash tools/gpu_check.sh      # from the repo root
#   TESTS="" BENCHES="-m benchmarks.serve --clients 256;-m benchmarks.structured" \
#       bash tools/gpu_check.sh  # two benches only
# TESTS: ';'-separated pytest argument sets ("" skips the tests). BENCHES: ';'-separated bench.py
# argument sets ("" skips them); an entry starting with "-m " runs that module instead
# (e.g. "-m benchmarks.attention --only decode"). BASELINE: the directory of another checkout, where
# the benches also in BASELINE_BENCHES (default: all) run right after ours. Each item runs under
# `timeout $STEP_TIMEOUT` (tests: $TEST_TIMEOUT). The cpu_suite tests skip themselves under CUDA.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# Wheels carried along (the machine reaches no index): flash-attn from .device/, and the optional
# extras' (the server's, xgrammar, gguf) from .whl/, installed under /tmp/site.
if compgen -G ".device/flash_attn-*.whl" > /dev/null; then
  python3 -m pip install -q --no-deps --no-index .device/flash_attn-*.whl
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  SITE=/tmp/site
  export PYTHONPATH=$PYTHONPATH:$SITE
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
FILTER="Writing|Loading|it/s\]|Warning|_warn_once|recompile|W1130|_dynamo"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, flash_attn; print('torch', torch.__version__, 'triton', \
triton.__version__, 'flash_attn', flash_attn.__version__)" | tee -a "$OUT/gpu.txt"
# The GPU tests (marker `cuda`) in three runs, each within the default timeout. The real-model
# tests need SmolLM2 in the nanovllm cache (nanovllm/testing/real_model.py) and skip without it.
DEFAULT_TESTS="-m cuda tests/runner;-m cuda tests/models;\
-m cuda tests/kernels tests/sampling tests/tools tests/engine"
IFS=';' read -ra tests <<< "${TESTS-$DEFAULT_TESTS}"
for args in "${tests[@]}"; do
  echo "== pytest $args" | tee -a "$OUT/gpu_tests.txt"
  timeout "${TEST_TIMEOUT:-$STEP_TIMEOUT}" python3 -m pytest -q -rs $args 2>&1 \
    | grep -vE "$FILTER" | tee -a "$OUT/gpu_tests.txt"
done
bench() {  # bench <label> <dir> <args>
  echo "== [$1] $3" | tee -a "$OUT/bench.txt"
  local command="bench.py $3"
  if [[ "$3" == "-m "* ]]; then command="$3"; fi
  (cd "$2" && PYTHONPATH=.${SITE:+:$SITE} timeout "$STEP_TIMEOUT" python3 $command 2>&1) | grep -vE "$FILTER" \
    | tee -a "$OUT/bench.txt"
}
DEFAULT_BENCHES=" ;--single-stream;--attention-backend triton;--kv-cache-dtype fp8;--profile"
IFS=';' read -ra benches <<< "${BENCHES-$DEFAULT_BENCHES}"
IFS=';' read -ra baseline_benches <<< "${BASELINE_BENCHES:-${BENCHES:-}}"
for args in "${benches[@]}"; do
  bench ours . "$args"
  for base_args in "${baseline_benches[@]}"; do
    if [ -n "${BASELINE:-}" ] && [ "$base_args" == "$args" ]; then
      bench baseline "$BASELINE" "$args"
    fi
  done
done
