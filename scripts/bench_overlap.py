"""A decode step as two half-batches whose kernels overlap on CUDA streams, against the whole batch on one
stream: CUDA-graph replays of the model's forward (the engine's modules, a random Qwen3-0.6B checkpoint) at
one decode shape. The idea: a step's kernels leave the GPU partly idle (bound by latency: the projections
under a wave of tiles, small batches' every kernel), so one half's kernels could run beside the other's.

    PYTHONPATH=. python scripts/bench_overlap.py --kv-cache-dtype fp8 --batch 8,16 --shortest 1500 --longest 1500
    PYTHONPATH=. python scripts/bench_overlap.py --kv-cache-dtype fp8 --batch 256,128,64 --staged

Schedules:
  whole          the model's forward over all rows, one stream (the engine today)
  halves         the model's forward over each half (rows alternating, longest first), one after the other
  2 streams      the same, a stream per half
With --staged also these, for halves of more than SKINNY_MAX_ROWS rows (fewer, the engine's decode kernel
computes q itself). Each half's stages in order: per layer `pre` = input norm, qkv, q/k norm + RoPE + KV
store; `attn` = decode attention; `post` = o_proj, post-attention norm, MLP.
  staged         the halves' stages, a stream per half, no other ordering
  ping-pong      the same, the halves' attention alternating (B's layer L after A's, A's L+1 after B's)
  4 streams      ping-pong, each half's attention on a low-priority stream, its other stages on a high one
The split-count buffers of the decode kernel are kept per stream here (the engine shares one). Results on the
H200: BENCHMARKS.md, thirty-third session (every schedule slower than the whole batch but 2 streams at 32 rows).
"""

import argparse
import statistics

import torch

from bench import resolve_model  # bench.py at the repository root
from nanovllm import LLM
from nanovllm.kernels.attention import decode as triton_decode
from nanovllm.layers.attention import AttentionMetadata


class Half:
    """One half-batch's inputs and its running state through the stages."""

    def __init__(self, ids, positions, meta):
        self.ids, self.positions, self.meta = ids, positions, meta
        self.keep = []  # every intermediate, alive until the capture ends (no cross-stream reuse of blocks)

    def start(self, model):
        self.h, self.residual = model.model.embed_tokens(self.ids), None
        self.keep.append(self.h)

    def pre(self, layer):
        if self.residual is None:
            self.residual, self.h = self.h, layer.input_layernorm(self.h)
        else:
            self.h, self.residual = layer.input_layernorm(self.h, self.residual)
        attn = layer.self_attn
        qkv = attn.qkv_proj(self.h, defer_sum=True)
        self.q, self.k, self.v = attn.norm_rope(self.positions, qkv, True, self.meta.slot_mapping, False)
        self.keep += [self.h, self.residual, qkv, self.q, self.k, self.v]

    def attn(self, layer):
        self.o = layer.self_attn.attn(self.q, self.k, self.v, self.meta, kv_stored=True).flatten(1, -1)
        self.keep.append(self.o)

    def post(self, layer):
        h = layer.self_attn.o_proj(self.o, defer_sum=True)
        h, self.residual = layer.post_attention_layernorm(h, self.residual)
        self.h = layer.mlp(h)
        self.keep += [h, self.residual, self.h]

    def finish(self, model):
        self.out, _ = model.model.norm(self.h, self.residual)
        self.keep.append(self.out)


def decode_batch(runner, batch: int, shortest: int, longest: int, generator):
    """Decode rows, contexts uniform in [shortest, longest] sorted longest first, over distinct random blocks
    of the pool: ids, positions, context lengths, block tables, slots (CPU tensors)."""
    page, width = runner.block_size, runner.max_blocks_per_seq
    lens, _ = torch.randint(shortest, longest + 1, (batch,), generator=generator).sort(descending=True)
    used = (lens + page - 1) // page
    if used.sum() > runner.num_kvcache_blocks:
        raise SystemExit(f"batch {batch} needs {used.sum()} blocks, the pool has {runner.num_kvcache_blocks}")
    pool = torch.randperm(runner.num_kvcache_blocks, generator=generator)
    blocks = torch.zeros(batch, width, dtype=torch.int64)
    for row, (first, n) in enumerate(zip((used.cumsum(0) - used).tolist(), used.tolist())):
        blocks[row, :n] = pool[first:first + n]
    positions = lens - 1
    slots = blocks[torch.arange(batch), positions // page] * page + positions % page
    ids = torch.randint(0, 10000, (batch,), generator=generator)
    return ids, positions, lens, blocks, slots


def make_half(runner, rows, ids, positions, lens, blocks, slots) -> "Half":
    """The rows `rows` of decode_batch's tensors on the device, taken up longest first."""
    device = runner.device
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots[rows].to(device),
                             context_lens=lens[rows].to(torch.int32).to(device),
                             block_tables=blocks[rows].to(torch.int32).to(device),
                             decode_order=torch.argsort(-lens[rows], stable=True).to(torch.int32).to(device))
    return Half(ids[rows].to(device), positions[rows].to(device), meta)


def on_streams(streams, *work):
    """Run each of `work` (callables) on its stream, forked from and joined into the current one."""
    main = torch.cuda.current_stream()
    for stream, job in zip(streams, work):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            job()
    for stream in streams[:len(work)]:
        main.wait_stream(stream)


def run_staged(model, halves, schedule, streams):
    """Issue the stages of `halves` (A, B) by `schedule` on `streams`."""
    a, b = halves
    if schedule in ("staged", "ping-pong"):
        stream_of = {(a, kind): streams[0] for kind in ("pre", "attn", "post")}
        stream_of.update({(b, kind): streams[1] for kind in ("pre", "attn", "post")})
    else:  # "4 streams": attention low priority (streams[2:]), the rest high (streams[:2])
        stream_of = {(a, "pre"): streams[0], (a, "post"): streams[0], (b, "pre"): streams[1],
                     (b, "post"): streams[1], (a, "attn"): streams[2], (b, "attn"): streams[3]}
    main = torch.cuda.current_stream()
    for s in set(stream_of.values()):
        s.wait_stream(main)
    last = {}  # half -> event after its latest stage

    def stage(half, kind, layer=None, after=None):
        s = stream_of[(half, "pre" if kind in ("start", "finish") else kind)]
        with torch.cuda.stream(s):
            for ev in (last.get(half), after):
                if ev is not None:
                    s.wait_event(ev)
            if kind == "start":
                half.start(model)
            elif kind == "finish":
                half.finish(model)
            else:
                getattr(half, kind)(layer)
            ev = torch.cuda.Event()
            ev.record(s)
            last[half] = ev
            return ev

    stage(a, "start"), stage(b, "start")
    b_attn = None
    for layer in model.model.layers:
        stage(a, "pre", layer)
        a_attn = stage(a, "attn", layer, after=b_attn if schedule != "staged" else None)
        stage(a, "post", layer)
        stage(b, "pre", layer)
        b_attn = stage(b, "attn", layer, after=a_attn if schedule != "staged" else None)
        stage(b, "post", layer)
    stage(a, "finish"), stage(b, "finish")
    for s in set(stream_of.values()):
        main.wait_stream(s)


def time_graph(graph, replays: int) -> float:
    """Median µs of a replay."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def arrival_counts_per_stream(purpose: str, n: int, device: torch.device) -> torch.Tensor:
    """utils.device.arrival_counts, one set per stream, so that the halves' kernels do not share counts."""
    return ENGINE_ARRIVAL_COUNTS(f"{purpose}, stream {torch.cuda.current_stream().stream_id}", n, device)


ENGINE_ARRIVAL_COUNTS = triton_decode.arrival_counts
triton_decode.arrival_counts = arrival_counts_per_stream


@torch.inference_mode()
def bench_batch(runner, batch: int, shortest: int, longest: int, replays: int, staged: bool):
    model = runner.model
    gen = torch.Generator().manual_seed(batch)
    ids, positions, lens, blocks, slots = decode_batch(runner, batch, shortest, longest, gen)
    whole = make_half(runner, torch.arange(batch), ids, positions, lens, blocks, slots)
    # Halves of equal total context: the longest-first ranks alternate between them.
    halves = [make_half(runner, torch.arange(batch)[i::2], ids, positions, lens, blocks, slots) for i in (0, 1)]
    streams = [torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0),
               torch.cuda.Stream(priority=0)]
    a, b = halves

    def forward(schedule):
        if schedule == "whole":
            return model(whole.ids, whole.positions, whole.meta)
        outs = [None, None]

        def half_forward(i):
            def job():
                outs[i] = model(halves[i].ids, halves[i].positions, halves[i].meta)
            return job
        if schedule == "halves":
            half_forward(0)(), half_forward(1)()
        elif schedule == "2 streams":
            on_streams(streams, half_forward(0), half_forward(1))
        else:
            a.keep, b.keep = [], []
            run_staged(model, halves, schedule, streams)
            outs = [a.out, b.out]
        return torch.cat(outs)  # rows 0, 2, 4, ... then 1, 3, 5, ...

    schedules = ["whole", "halves", "2 streams"] + (["staged", "ping-pong", "4 streams"] if staged else [])
    results, outputs = {}, {}
    for schedule in schedules:
        forward(schedule)  # warm-up (kernel choice, compilation) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward(schedule)
        for _ in range(3):
            graph.replay()
        results[schedule] = time_graph(graph, replays)
        outputs[schedule] = out.float().clone()
        del graph
        torch.cuda.synchronize()
    perm = torch.cat([torch.arange(batch)[0::2], torch.arange(batch)[1::2]])
    reference = outputs["whole"][perm]
    print(f"batch {batch}, contexts {shortest}-{longest} (mean {lens.float().mean():.0f}):")
    for schedule, us in results.items():
        diff = (outputs[schedule] - reference).abs().max().item()
        same = torch.equal(outputs[schedule], outputs["halves"])
        print(f"  {schedule:10s} {us:8.1f} µs  ({us / results['whole'] - 1:+.1%})  max |diff| vs whole {diff:.3g}"
              f"{'  bitwise = halves' if same else ''}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--batch", default="256,128,64", help="comma-separated batch sizes")
    parser.add_argument("--shortest", type=int, default=100)
    parser.add_argument("--longest", type=int, default=1124)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--staged", action="store_true", help="also the staged schedules (batches over 32 rows)")
    args = parser.parse_args()
    model = resolve_model(None, "qwen3-0.6b")
    with LLM(model, max_model_len=4096, kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
             enforce_eager=True, gpu_memory_utilization=0.8) as llm:
        runner = llm.model_runner
        cache = runner.kv_cache
        if cache.dtype == torch.float8_e4m3fn:
            cache.view(torch.uint8).random_(0, 0x70)  # finite e4m3 values up to 2^7
            runner.kv_scales.fill_(0.01)
        else:
            cache.normal_(0, 1)
        print(f"KV cache {cache.dtype}, backend {llm.config.attention_backend}")
        for batch in map(int, args.batch.split(",")):
            bench_batch(runner, batch, args.shortest, args.longest, args.replays, args.staged)


if __name__ == "__main__":
    main()
