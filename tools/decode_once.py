"""Launch the Triton decode kernel twice at one shape, for a profiler to read the second launch.

    python -m tools.decode_once --kv-cache-dtype fp8 --batch 256 --shortest 100 --longest 1124"""

import argparse

import torch

from benchmarks.attention import KVH, PAGE, SCALE, Cache, decode_inputs
from nanovllm.kernels.attention import decode as triton_decode


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", "fp8"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--shortest", type=int, default=100,
                        help="contexts uniform in [shortest, longest]")
    parser.add_argument("--longest", type=int, default=1124)
    args = parser.parse_args()
    torch.manual_seed(0)
    cache = Cache(args.batch * -(-args.longest // PAGE) * PAGE, fp8=args.kv_cache_dtype == "fp8")
    longest = None if args.longest == args.shortest else args.longest
    q, tables, lens = decode_inputs(cache, args.batch, args.shortest, longest, longest_first=True)
    longest_first_order = torch.arange(args.batch, dtype=torch.int32, device=q.device)
    splits = triton_decode._decode_num_splits(args.batch, KVH, tables.shape[1] * PAGE, q.device)
    for _ in range(2):
        triton_decode.paged_decode_attention(q, *cache.kv, tables, lens, SCALE, **cache.scales,
                                             order=longest_first_order)
    torch.cuda.synchronize()
    print(f"batch {args.batch}, contexts {args.shortest}-{args.longest} "
          f"(mean {lens.float().mean():.0f}), {cache.kind}, {splits} split(s)")


if __name__ == "__main__":
    main()
