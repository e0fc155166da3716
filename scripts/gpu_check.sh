#!/usr/bin/env bash
# One device call: the GPU tests, then benchmarks, logs under $OUT. From the repo root on the H200:
#   python3 -m pip install -q --no-deps --no-index .device/*.whl && bash scripts/gpu_check.sh
# TESTS overrides the test files ("" skips the tests); BENCHES the bench.py argument sets (separated
# by ';'). BASELINE names a directory holding another checkout (e.g. `git archive <commit>` unpacked
# under the ignored .device/): the benches in BASELINE_BENCHES (default: all) then run there too,
# right after ours, for a same-run baseline.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, flash_attn; print('torch', torch.__version__, 'triton', triton.__version__, 'flash_attn', flash_attn.__version__)" | tee -a "$OUT/gpu.txt"
TESTS=${TESTS-tests/test_cuda.py tests/test_attention.py tests/test_triton_attention.py tests/test_sampler.py}
if [ -n "$TESTS" ]; then
  python3 -m pytest -q -rs $TESTS -s 2>&1 | grep -vE "Loading|Writing|recompile|W1130|_dynamo" | tail -30 | tee "$OUT/gpu_tests.txt"
fi
bench() {  # bench <label> <dir> <args>
  echo "== [$1] bench.py $3" | tee -a "$OUT/bench.txt"
  (cd "$2" && PYTHONPATH=. python3 bench.py $3 2>&1) | grep -vE "Writing|Loading|it/s\]|Warning|_warn_once" | tee -a "$OUT/bench.txt"
}
IFS=';' read -ra benches <<< "${BENCHES:- ;--single-stream;--attention-backend triton;--profile}"
IFS=';' read -ra baseline_benches <<< "${BASELINE_BENCHES:-${BENCHES:-}}"
for args in "${benches[@]}"; do
  bench ours . "$args"
  for base_args in "${baseline_benches[@]}"; do
    if [ -n "${BASELINE:-}" ] && [ "$base_args" == "$args" ]; then bench baseline "$BASELINE" "$args"; fi
  done
done
