"""Reproduces tests/test_cuda.py's killed-worker test (2 GPUs, NCCL) under variants, to find what hangs.

Each variant runs in a fresh process: an LLM with tensor_parallel_size=2 on a tiny bf16 Qwen3, one step,
rank 1 killed, steps until WorkerDiedError; then a new single-GPU LLM in the same process generates a
token (the process group can be made again), unless LLMEngine.exit gave up on NCCL's abort, which
refuses a new LLM in the process. Prints the seconds each phase took, or the stacks of a
variant stuck for 30 s (faulthandler). Usage: python scripts/killed_worker_check.py [variant ...]

On the H200 image of 2026-11-30 (torch 2.11+cu130) every variant hung: in the NCCL abort of
LLMEngine.exit, or with enforce_eager in a kernel launch of a later step (BENCHMARKS.md, eleventh
session, calls 4-5). Since exit waits only NCCL_ABORT_SECONDS for the abort, `default` raises
WorkerDiedError after ~5 s (twelfth session, call 1).
"""

import os
import subprocess
import sys
import tempfile
import time

VARIANTS = {  # name -> (environment, LLM options)
    "default": ({}, {}),
    "eager": ({}, {"enforce_eager": True}),
    "no_pdl": ({"NANOVLLM_PDL": "0"}, {}),
    "no_async_error_handling": ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, {}),
    "backend_abort_first": ({}, {}),  # the NCCL backend aborted alone before torch's group-wide abort
    "patient": ({}, {}),  # the default, given 80 s: does the abort end at all?
}


def timed_abort(name: str):
    """torch's _abort_process_group, timed, after the NCCL backend's own abort for backend_abort_first."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    abort_all = distributed_c10d._abort_process_group

    def abort(group=None):
        start = time.monotonic()
        if name == "backend_abort_first":
            dist.group.WORLD._get_backend(torch.device("cuda")).abort()
            print(f"  backend abort returned after {time.monotonic() - start:.1f} s", flush=True)
        abort_all(group)
        print(f"  _abort_process_group returned after {time.monotonic() - start:.1f} s", flush=True)

    distributed_c10d._abort_process_group = abort


def run_variant(model: str, name: str):
    import faulthandler

    from nanovllm import LLM, SamplingParams
    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.runner.shm_channel import WorkerDiedError

    timed_abort(name)
    options = VARIANTS[name][1]
    llm = LLM(model, tensor_parallel_size=2, max_model_len=1024, **options)
    for prompt in ([1, 2, 3], [4, 5]):
        llm.add_request(prompt, SamplingParams(max_tokens=500, ignore_eos=True))
    llm.step()
    llm.processes[0].kill()
    faulthandler.dump_traceback_later(80 if name == "patient" else 30, exit=True)
    start = time.monotonic()
    try:
        while True:
            llm.step()
    except WorkerDiedError as error:
        print(f"  WorkerDiedError after {time.monotonic() - start:.1f} s: {error}", flush=True)
    if LLMEngine.nccl_abort is not None and LLMEngine.nccl_abort.is_alive():
        print("  NCCL's abort is still running: exit gave up on it, and refuses a new LLM here", flush=True)
        return
    faulthandler.dump_traceback_later(60, exit=True)
    start = time.monotonic()
    with LLM(model, max_model_len=1024, **options) as again:
        again.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)
    print(f"  a new LLM generated after {time.monotonic() - start:.1f} s", flush=True)


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        run_variant(sys.argv[2], sys.argv[3])
        return
    from nanovllm.utils.tiny_model import write_tiny_qwen3

    model = tempfile.mkdtemp()
    write_tiny_qwen3(model, dtype="bfloat16", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=128, intermediate_size=512)
    for name in sys.argv[1:] or VARIANTS:
        print(f"== {name}", flush=True)
        env = {**os.environ, **VARIANTS[name][0]}
        process = subprocess.Popen([sys.executable, __file__, "--child", model, name], env=env,
                                   start_new_session=True)
        try:
            print(f"  exit code {process.wait(timeout=150)}", flush=True)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            print("  killed after 150 s", flush=True)


if __name__ == "__main__":
    main()
