"""The host's cost of a decode step's scheduling, inputs and postprocessing, on the CPU alone.

    python -m benchmarks.host --batch 256 --steps 200
"""

import argparse
import random
import time

import torch

from nanovllm.engine.scheduler import Scheduler, scheduled_step
from nanovllm.engine.sequence import Sequence
from nanovllm.runner.sampling_metadata import build_sampling_metadata
from nanovllm.runner.step_inputs import StepInputs
from nanovllm.sampling_params import SamplingParams
from nanovllm.testing.tiny_model import QWEN3_0_6B


def prefilled_scheduler(batch: int, prompt_len: int, steps: int, rng) -> Scheduler:
    """A scheduler running `batch` random prompts, their prefill done."""
    num_blocks = batch * (prompt_len + steps + 512) // 256 + 16
    scheduler = Scheduler(max_num_seqs=512, max_num_batched_tokens=1 << 30,
                          max_model_len=1 << 20, num_blocks=num_blocks, block_size=256,
                          eos_token_ids={0})
    params = SamplingParams(temperature=0.6, max_tokens=steps + 10, ignore_eos=True)
    for _ in range(batch):
        prompt = [rng.randrange(1, 10000) for _ in range(prompt_len)]
        scheduler.add(Sequence(prompt, params, 256, {0}))
    seqs, is_prefill = scheduler.schedule()
    assert is_prefill and len(seqs) == batch
    scheduler.postprocess(scheduler.commit(seqs, is_prefill), [1] * len(seqs))
    return scheduler


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=600)
    args = parser.parse_args()

    rng = random.Random(0)
    scheduler = prefilled_scheduler(args.batch, args.prompt_len, args.steps, rng)
    inputs = StepInputs(torch.device("cpu"), 256, decode_order=True)
    vocab_size = QWEN3_0_6B["vocab_size"]
    schedule_s = postprocess_s = inputs_s = 0.0
    for _ in range(args.steps):
        start = time.perf_counter()
        seqs, is_prefill = scheduler.schedule()
        schedule_s += time.perf_counter() - start
        start = time.perf_counter()
        step = scheduled_step(seqs, is_prefill)
        inputs.prepare_decode(step)
        build_sampling_metadata(step.sampling, vocab_size, inputs.to_device)
        inputs_s += time.perf_counter() - start
        start = time.perf_counter()
        committed = scheduler.commit(seqs, is_prefill)
        schedule_s += time.perf_counter() - start
        tokens = [rng.randrange(1, 10000) for _ in seqs]
        middle = time.perf_counter()
        scheduler.postprocess(committed, tokens)
        postprocess_s += time.perf_counter() - middle
        assert not is_prefill and len(seqs) == args.batch
    print(f"batch {args.batch}: schedule {schedule_s / args.steps * 1e3:.3f} ms/step, "
          f"inputs {inputs_s / args.steps * 1e3:.3f} ms/step, "
          f"postprocess {postprocess_s / args.steps * 1e3:.3f} ms/step")


if __name__ == "__main__":
    main()
