"""Which Triton kernels compile during bench.py's first timed run, after the engine's CUDA graphs and bench.py's
warm-up: each is a compilation a user's first generate() pays for.

    python scripts/first_run_compiles.py --kv-cache-dtype fp8

Runs bench.py's workload once on the random Qwen3-0.6B checkpoint with a fresh Triton cache, and lists the
kernels (name, then the specialization Triton keys its cache on) compiled during that run; report under $OUT.
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")  # before Triton is imported

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from gpu_timing import emit, save_report  # noqa: E402

from bench import resolve_model, upstream_workload  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402


def compiled() -> dict[str, dict]:
    """The Triton cache's kernels: metadata file path -> its JSON."""
    return {str(p): json.loads(p.read_text()) for p in pathlib.Path(os.environ["TRITON_CACHE_DIR"]).glob("*/*.json")
            if not p.name.startswith("__grp__")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--attention-backend", default="auto")
    args = parser.parse_args()
    with LLM(resolve_model(None, "qwen3-0.6b"), max_model_len=4096, kv_cache_dtype=args.kv_cache_dtype,
             attention_backend=args.attention_backend) as llm:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # bench.py's warm-up
        before = compiled()
        prompts, params = upstream_workload()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        emit(f"random Qwen3-0.6B, {vars(args)}: first run {time.perf_counter() - start:.2f} s, "
             f"{len(before)} kernels compiled before it")
        for path, meta in sorted(compiled().items(), key=lambda item: item[1].get("name", "")):
            if path not in before:
                emit(f"  {meta.get('name')}: {meta.get('constants', '')} {meta.get('attrs', '')}"[:400])
    save_report("first_run_compiles.txt")


if __name__ == "__main__":
    main()
