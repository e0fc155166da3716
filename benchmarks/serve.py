"""HTTP serving against offline `generate`, in one run: upstream nano-vllm's bench.py workload (256
requests, 100-1,024 random tokens in and out, temperature 0.6, ignore_eos) sent by N concurrent
streaming clients (in 8 processes) to the OpenAI-compatible server, laid out as `nanovllm serve`
lays it out (the HTTP server here, its engine in a process of its own); then, with that engine
gone, run by LLM.generate here (one engine's KV pool on the device at a time).

    python -m benchmarks.serve                      # 256 requests, 64 clients (a GPU)
    python -m benchmarks.serve --num-requests 8 --clients 4 --max-input-len 128 \\
        --max-output-len 32                         # a CPU: a random SmolLM2-shaped checkpoint
    python -m benchmarks.serve --tiny --num-requests 64 --clients 64 --client-processes 1 \\
        --max-input-len 128 --max-output-len 64     # a CPU: the server's own cost per token

Reports each side's output throughput and their ratio, the server's time to first token and
inter-token latency (p50, p99), measured by the clients, each side's engine steps (their count,
time and tokens: a gap is smaller batches or slower steps), and the CPU time the engine's process
and the server's took while serving. On a GPU the engine's process spins while it waits for a
step's tokens, so its CPU share is near a whole core whether its host work is the limit or not.
"""

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time

import openai
import torch

from bench import resolve_model, upstream_workload
from nanovllm import LLM
from nanovllm.serve.server import ServerThread
from nanovllm.testing.real_model import cache_dir
from nanovllm.testing.tiny_model import TINY_VOCAB_SIZE, write_tiny_qwen3

MODEL_NAME = "bench"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def one_request(aclient, prompt, params, ttfts: list, itls: list) -> int:
    """Stream one completion; records its time to first token and each token's interval."""
    start = last = time.perf_counter()
    num_tokens = 0
    chunks = await aclient.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=params.max_tokens,
        temperature=params.temperature, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in chunks:
        new = len(chunk.choices[0].token_ids or []) if chunk.choices else 0
        if not new:
            continue
        now = time.perf_counter()
        if num_tokens == 0:
            ttfts.append(now - start)
        else:
            itls.extend([(now - last) / new] * new)
        num_tokens += new
        last = now
    return num_tokens


async def run_clients(url: str, work: list, num_clients: int):
    """N clients, each sending the next request of `work` when its last one completes."""
    ttfts, itls = [], []
    queue = work[::-1]
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0,
                                  timeout=3600) as aclient:

        async def client() -> int:
            tokens = 0
            while queue:
                prompt, sp = queue.pop()
                tokens += await one_request(aclient, prompt, sp, ttfts, itls)
            return tokens

        tokens = sum(await asyncio.gather(*(client() for _ in range(num_clients))))
        return tokens, ttfts, itls


def client_process(args) -> tuple[int, list, list]:
    """One client process: its share of the requests by its share of the clients."""
    url, work, num_clients, start_at = args
    time.sleep(max(0.0, start_at - time.time()))  # every process starts sending at once
    return asyncio.run(run_clients(url, work, num_clients))


def workload(num_requests: int, max_input_len: int, max_output_len: int,
             vocab_size: int | None = None):
    """Upstream's draws, then cut to the given lengths (a CPU's smaller run; none at 1,024), the
    ids taken modulo a vocabulary smaller than upstream's 10,001 draws (the tiny model's)."""
    prompts, params = upstream_workload(num_requests)
    for sp in params:
        sp.max_tokens = min(sp.max_tokens, max_output_len)
    prompts = [p[:max_input_len] for p in prompts]
    if vocab_size is not None:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return prompts, params


def offline(model: str, engine_options: dict, prompts, params) -> tuple[int, float, int]:
    """(tokens, seconds, engine steps) of LLM.generate over the workload."""
    with LLM(model, **engine_options) as llm:
        llm.generate([prompts[0][:8]], params[0], use_tqdm=False)  # warm-up
        steps = count_calls(llm.llm_engine, "step")
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return sum(p.max_tokens for p in params), time.perf_counter() - start, steps[0]


def count_calls(owner, name: str) -> list[int]:
    """[calls of owner.<name> from now on]: the engine's steps, offline (LLMEngine.step) or
    served (EngineClient._dispatch: the engine sends one message a step)."""
    calls, method = [0], getattr(owner, name)

    def counted(*args):
        calls[0] += 1
        return method(*args)

    setattr(owner, name, counted)
    return calls


def cpu_seconds(pid: int | None = None) -> float:
    """User and system CPU seconds of a process (this one by default), all its threads (Linux)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served(model: str, engine_options: dict, prompts, params, num_clients: int,
           num_processes: int):
    """The workload through the server, its clients spread over processes (round robin) so that
    parsing the streams does not take the server's interpreter lock. Returns (tokens, seconds,
    time-to-first-token list, inter-token list, {process: CPU seconds while serving})."""
    work = list(zip(prompts, params))
    num_processes = min(num_processes, num_clients)
    with ServerThread(model, MODEL_NAME, engine_options) as server:
        asyncio.run(run_clients(server.url, [(prompts[0][:8], params[0])], 1))  # warm-up
        context = multiprocessing.get_context("spawn")
        engine_pid = server.engine.process.pid
        with context.Pool(num_processes) as pool:
            start_at = time.time() + 5.0  # the processes import openai meanwhile
            shares = [(server.url, work[i::num_processes],
                       num_clients // num_processes + (i < num_clients % num_processes), start_at)
                      for i in range(num_processes)]
            time.sleep(max(0.0, start_at - time.time()))
            steps = count_calls(server.engine, "_dispatch")
            cpu_before = cpu_seconds(engine_pid), cpu_seconds()
            results = pool.map(client_process, shares)
            seconds = time.time() - start_at
            cpu_after = cpu_seconds(engine_pid), cpu_seconds()
    tokens = sum(r[0] for r in results)
    cpu = {"engine": cpu_after[0] - cpu_before[0], "server": cpu_after[1] - cpu_before[1]}
    return (tokens, seconds, [t for r in results for t in r[1]], [t for r in results for t in r[2]],
            cpu, steps[0])


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default=None, help="checkpoint (default: bench.py's, or on a CPU a random "
                                      "SmolLM2-135M-shaped one)")
    add("--num-requests", type=int, default=256)
    add("--clients", type=int, default=64, help="concurrent HTTP clients")
    add("--client-processes", type=int, default=8, help="processes the clients are spread over")
    add("--max-input-len", type=int, default=1024, help="prompts cut to this many tokens")
    add("--max-output-len", type=int, default=1024, help="outputs cut to this many tokens")
    add("--max-model-len", type=int, default=4096)
    add("--enforce-eager", action="store_true")
    add("--tiny", action="store_true", help="the tests' tiny random Qwen3 (2 layers, 320 tokens): "
                                            "a step costs next to nothing, the server's work shows")
    return parser.parse_args()


def tiny_model() -> str:
    """The tests' tiny Qwen3, written once under the cache directory."""
    path = os.path.join(cache_dir(), "tiny-qwen3")
    if not os.path.exists(os.path.join(path, "config.json")):
        write_tiny_qwen3(path)
    return path


def default_model() -> str:
    if torch.cuda.is_available():
        return resolve_model(None, "qwen3-0.6b")
    from benchmarks.cpu import checkpoint

    return checkpoint()


def main():
    args = parse_args()
    prompts, params = workload(args.num_requests, args.max_input_len, args.max_output_len,
                               TINY_VOCAB_SIZE if args.tiny else None)
    model = tiny_model() if args.tiny else args.model or default_model()
    options = dict(max_model_len=args.max_model_len, enforce_eager=args.enforce_eager)
    tokens, seconds, ttfts, itls, cpu, steps = served(model, options, prompts, params,
                                                      args.clients, args.client_processes)
    offline_tokens, offline_seconds, offline_steps = offline(model, options, prompts, params)
    assert tokens == offline_tokens, (tokens, offline_tokens)
    offline_rate, served_rate = offline_tokens / offline_seconds, tokens / seconds
    print(f"{args.num_requests} requests, {tokens} output tokens, {args.clients} clients")
    print(f"offline generate: {offline_seconds:.2f} s, {offline_rate:,.1f} tok/s")
    print(f"HTTP server:      {seconds:.2f} s, {served_rate:,.1f} tok/s "
          f"({served_rate / offline_rate:.2f}x offline)")
    print(f"time to first token: p50 {percentile(ttfts, 50) * 1e3:.1f} ms, "
          f"p99 {percentile(ttfts, 99) * 1e3:.1f} ms (mean {statistics.mean(ttfts) * 1e3:.1f})")
    print(f"inter-token latency: p50 {percentile(itls, 50) * 1e3:.2f} ms, "
          f"p99 {percentile(itls, 99) * 1e3:.2f} ms")
    # More steps: the batches were smaller (requests arrive over time); longer steps: the
    # engine's step loop did more per step than the GPU's step took.
    print(f"engine steps: served {steps} ({seconds / steps * 1e3:.2f} ms, {tokens / steps:.1f} "
          f"tokens a step), offline {offline_steps} ({offline_seconds / offline_steps * 1e3:.2f} "
          f"ms, {offline_tokens / offline_steps:.1f} tokens a step)")
    print("CPU while serving: " + ", ".join(
        f"{name} process {s:.1f} s ({s / seconds:.0%} of a core, {s / tokens * 1e6:.0f} us a token)"
        for name, s in cpu.items()))


if __name__ == "__main__":
    main()
