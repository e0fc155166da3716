"""The Triton kernels compiled during bench.py's first timed run: what a user's first call pays.

    python -m tools.first_run_compiles [--kv-cache-dtype fp8] [--attention-backend triton]"""

import argparse
import json
import os
import pathlib
import tempfile
import time


def cached_kernels() -> dict[str, dict]:
    cache = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
    return {str(p): json.loads(p.read_text()) for p in cache.glob("*/*.json")
            if not p.name.startswith("__grp__")}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--attention-backend", default="auto")
    args = parser.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")  # before Triton
    from bench import resolve_model, upstream_workload
    from benchmarks.gpu_timing import emit, save_report
    from nanovllm import LLM, SamplingParams

    with LLM(resolve_model(None, "qwen3-0.6b"), max_model_len=4096,
             kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend) as llm:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
        before = cached_kernels()
        prompts, params = upstream_workload()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        emit(f"random Qwen3-0.6B, {vars(args)}: first run {time.perf_counter() - start:.2f} s, "
             f"{len(before)} kernels compiled before it")
        after = sorted(cached_kernels().items(), key=lambda item: item[1].get("name", ""))
        for path, meta in after:
            if path not in before:
                line = f"  {meta.get('name')}: {meta.get('constants', '')} {meta.get('attrs', '')}"
                emit(line[:400])
    save_report("first_run_compiles.txt")


if __name__ == "__main__":
    main()
