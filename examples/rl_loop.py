"""A toy GRPO loop on the CPU: a tiny random Qwen3 learns to say one token.

Each step the engine samples n completions per prompt (the prompt prefilled once), a toy reward
scores them (1 if the target token appears, else 0), each sample's advantage is its reward minus
its group's mean, divided by the group's std (GRPO), a REINFORCE step on the transformers policy
raises the log-probability of the better samples, and `update_weights` hands the new weights to
the engine, in place, before the next rollouts.

    python examples/rl_loop.py [--steps 30]
"""

import argparse
import random
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.testing.tiny_model import write_tiny_qwen3

TARGET = 42  # the token the reward asks for


def rewards(completions: list[list[int]]) -> torch.Tensor:
    return torch.tensor([float(TARGET in tokens) for tokens in completions])


def grpo_advantages(reward: torch.Tensor, n: int) -> torch.Tensor:
    """[prompts * n] rewards -> advantages normalized within each prompt's group of n."""
    groups = reward.view(-1, n)
    centered = groups - groups.mean(dim=1, keepdim=True)
    return (centered / (groups.std(dim=1, keepdim=True) + 1e-4)).flatten()


def policy_loss(policy, prompts: list[list[int]], completions: list[list[int]],
                advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE: -advantage x log p(completion | prompt), averaged over completion tokens."""
    ids = torch.tensor([p + c for p, c in zip(prompts, completions)])  # equal lengths: no padding
    logits = policy(ids).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)
    completion_logprobs = logprobs[:, len(prompts[0]) - 1:]  # [samples, completion length]
    return -(advantages[:, None] * completion_logprobs).mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-2)
    args = parser.parse_args()
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="rl-loop-")
    write_tiny_qwen3(path, seed=0)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    rng = random.Random(0)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=256) as llm:
        for step in range(args.steps):
            start = time.perf_counter()
            prompts = [[rng.randrange(100, 300) for _ in range(8)] for _ in range(args.prompts)]
            prefilled = llm.llm_engine.num_prefilled_tokens
            outputs = llm.generate(prompts, params, use_tqdm=False)  # per prompt, n samples
            completions = [sample.token_ids for out in outputs for sample in out.outputs]
            reward = rewards(completions)
            loss = policy_loss(policy, [p for p in prompts for _ in range(args.n)], completions,
                               grpo_advantages(reward, args.n))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            llm.update_weights(policy.state_dict())  # the engine samples the new policy next
            print(f"step {step:3d}  mean reward {reward.mean():.3f}  prefilled "
                  f"{llm.llm_engine.num_prefilled_tokens - prefilled} tokens for "
                  f"{len(completions)} samples"
                  f"  {time.perf_counter() - start:.2f} s")
        # The engine runs the trained policy: its greedy tokens are the policy's own.
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        ours = llm.generate(prompts[0], greedy, use_tqdm=False)[0]["token_ids"]
        print(f"engine greedy {ours} == policy greedy: {ours == policy_greedy(policy, prompts[0])}")


@torch.no_grad()
def policy_greedy(policy, prompt: list[int], num_tokens: int = 8) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(num_tokens):
        ids = torch.cat([ids, policy(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


if __name__ == "__main__":
    main()
