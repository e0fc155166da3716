"""Launch the Triton decode kernel twice at one shape (bench_attention.py's cache and inputs), for a
profiler to look at the second launch (scripts/ncu_decode.sh).

    python scripts/decode_once.py --kv-cache-dtype fp8 --batch 256 --shortest 100 --longest 1124
"""

import argparse

import torch
from bench_attention import KVH, PAGE, SCALE, Cache, decode_inputs  # scripts/bench_attention.py

from nanovllm.kernels.attention import decode as triton_decode


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", "fp8"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--shortest", type=int, default=100, help="contexts uniform in [shortest, longest]")
    parser.add_argument("--longest", type=int, default=1124)
    args = parser.parse_args()
    torch.manual_seed(0)
    cache = Cache(args.batch * -(-args.longest // PAGE) * PAGE, fp8=args.kv_cache_dtype == "fp8")
    longest = None if args.longest == args.shortest else args.longest
    q, tables, lens = decode_inputs(cache, args.batch, args.shortest, longest, longest_first=True)
    order = torch.arange(args.batch, dtype=torch.int32, device=q.device)  # sorted longest first: the engine's order
    splits = triton_decode._decode_num_splits(args.batch, KVH, tables.shape[1] * PAGE, q.device)
    for _ in range(2):
        triton_decode.paged_decode_attention(q, *cache.kv, tables, lens, SCALE, **cache.scales, order=order)
    torch.cuda.synchronize()
    print(f"batch {args.batch}, contexts {args.shortest}-{args.longest} (mean {lens.float().mean():.0f}), "
          f"{cache.kind}, {splits} split(s)")


if __name__ == "__main__":
    main()
