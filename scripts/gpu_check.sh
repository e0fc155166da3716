#!/usr/bin/env bash
# One device call: the GPU tests, then benchmarks, logs under $OUT. From the repo root on the H200:
#   python3 -m pip install -q --no-deps --no-index .device/*.whl && bash scripts/gpu_check.sh
# BENCHES overrides the list of bench.py argument sets (separated by ';').
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, flash_attn; print('torch', torch.__version__, 'triton', triton.__version__, 'flash_attn', flash_attn.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -rs tests/test_cuda.py tests/test_attention.py tests/test_triton_attention.py tests/test_sampler.py \
  -s 2>&1 | grep -vE "Loading|Writing|recompile|W1130|_dynamo" | tail -30 | tee "$OUT/gpu_tests.txt"
IFS=';' read -ra benches <<< "${BENCHES:- ;--single-stream;--attention-backend triton;--profile}"
for args in "${benches[@]}"; do
  echo "== bench.py $args" | tee -a "$OUT/bench.txt"
  python3 bench.py $args 2>&1 | grep -vE "Writing|Loading|it/s\]|Warning|_warn_once" | tee -a "$OUT/bench.txt"
done
