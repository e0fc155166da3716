#!/usr/bin/env bash
# One device call: the GPU tests, then benchmarks, logs under $OUT. From the repo root on the H200:
#   python3 -m pip install -q --no-deps --no-index .device/*.whl && bash scripts/gpu_check.sh
# TESTS: ';'-separated pytest argument sets ("" skips the tests). BENCHES: ';'-separated bench.py
# argument sets ("" skips them); an entry starting with scripts/ runs that script instead. BASELINE
# names a directory holding another checkout (e.g. `git archive <commit>` unpacked under the ignored .device/): the
# benches also listed in BASELINE_BENCHES (default: all) run there too, right after ours, for a
# same-run baseline. Every item runs under `timeout $STEP_TIMEOUT` (tests: $TEST_TIMEOUT) and logs as it goes.
# (The CPU suite, marked cpu_suite, skips itself where CUDA is visible: see tests/conftest.py.)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
FILTER="Writing|Loading|it/s\]|Warning|_warn_once|recompile|W1130|_dynamo"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, flash_attn; print('torch', torch.__version__, 'triton', triton.__version__, 'flash_attn', flash_attn.__version__)" | tee -a "$OUT/gpu.txt"
# The default set in two runs, each within the default timeout (the whole set took over 300 s on the H200).
IFS=';' read -ra tests <<< "${TESTS-tests/test_cuda.py tests/test_attention.py tests/test_triton_attention.py tests/test_sampler.py tests/test_sampler_controls.py;tests/test_kv_cache_fp8.py tests/test_skinny_gemm.py tests/test_tiled_gemm.py tests/test_qk_norm_rope.py tests/test_norm_activation_kernels.py tests/test_kernels_compile_for_gpu.py tests/test_host_to_device.py tests/test_bench.py}"
for args in "${tests[@]}"; do
  echo "== pytest $args" | tee -a "$OUT/gpu_tests.txt"
  timeout "${TEST_TIMEOUT:-$STEP_TIMEOUT}" python3 -m pytest -q -rs $args 2>&1 | grep -vE "$FILTER" | tee -a "$OUT/gpu_tests.txt"
done
bench() {  # bench <label> <dir> <args>
  echo "== [$1] $3" | tee -a "$OUT/bench.txt"
  local command="bench.py $3"
  if [[ "$3" == scripts/* ]]; then command="$3"; fi
  (cd "$2" && PYTHONPATH=. timeout "$STEP_TIMEOUT" python3 $command 2>&1) | grep -vE "$FILTER" | tee -a "$OUT/bench.txt"
}
IFS=';' read -ra benches <<< "${BENCHES- ;--single-stream;--attention-backend triton;--kv-cache-dtype fp8;--profile}"
IFS=';' read -ra baseline_benches <<< "${BASELINE_BENCHES:-${BENCHES:-}}"
for args in "${benches[@]}"; do
  bench ours . "$args"
  for base_args in "${baseline_benches[@]}"; do
    if [ -n "${BASELINE:-}" ] && [ "$base_args" == "$args" ]; then bench baseline "$BASELINE" "$args"; fi
  done
done
