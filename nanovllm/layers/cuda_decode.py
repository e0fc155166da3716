"""fp8 paged decode attention as a hand-written CUDA kernel (fp8_decode.cu, which says how it works),
compiled by NVRTC at first use for each launch configuration."""

import functools
import pathlib

import torch

from nanovllm.layers.split_softmax import SplitSoftmax
from nanovllm.layers.triton_decode import MAX_SPLITS_MERGED_BY_THE_LAST, _decode_num_splits
from nanovllm.utils.device import arrival_counts

SOURCE = pathlib.Path(__file__).with_name("fp8_decode.cu")
TILE = 128  # keys a block takes at a time (the .cu's TILE)
LOG2E = 1.4426950408889634


@functools.cache
def _kernel(group: int, num_kv_heads: int, head_dim: int, num_splits: int, last_split_merges: bool,
            min_blocks: int):
    macros = dict(G=group, NUM_KV_HEADS=num_kv_heads, D=head_dim, NUM_SPLITS=num_splits,
                  LAST_SPLIT_MERGES=int(last_split_merges), MIN_BLOCKS=min_blocks)
    return torch.cuda._compile_kernel(SOURCE.read_text(), "fp8_decode",
                                      nvcc_options=[f"-D{name}={value}" for name, value in macros.items()])


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *, k_scale, v_scale,
                           order=None, out=None, num_splits=None, min_blocks=4):
    """triton_decode.paged_decode_attention's contract, for its fp8 cache only: q [B, H, D] bf16; k_cache
    [num_blocks, block_size, KVH, D] and v_cache [num_blocks, KVH, D, block_size] float8_e4m3fn with scales
    [num_blocks, KVH, block_size]; block_size a multiple of 128, D = 128, H / KVH <= 8."""
    B, H, D = q.shape
    _, page, kvh, _ = k_cache.shape
    G = H // kvh
    if D != 128 or page % TILE or G > 8 or q.dtype != torch.bfloat16 or k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"the CUDA decode kernel takes D=128 (got {D}), block_size % {TILE} == 0 (got {page}), "
                         f"H/KVH <= 8 (got {G}), bf16 q (got {q.dtype}) and an fp8 cache (got {k_cache.dtype})")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous along their last axis")
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    num_splits = num_splits or _decode_num_splits(B, kvh, block_tables.shape[1] * page, q.device)
    merges = num_splits <= MAX_SPLITS_MERGED_BY_THE_LAST
    part_acc = torch.empty(B, H, num_splits, D, device=q.device, dtype=torch.float32) if num_splits > 1 else out
    part_m = torch.empty(B, H, num_splits, device=q.device, dtype=torch.float32) if num_splits > 1 else out
    part_l = torch.empty_like(part_m)
    counts = arrival_counts("cuda decode splits", B * kvh, q.device) if num_splits > 1 and merges else out
    kernel = _kernel(G, kvh, D, num_splits, merges, min_blocks)
    kernel(grid=(num_splits, kvh, B), block=(128, 1, 1), args=[
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
        context_lens if order is None else order, out, part_acc, part_m, part_l, counts, float(scale * LOG2E),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_scale.stride(0),
        k_scale.stride(1), block_tables.stride(0), page, int(order is not None)])
    if num_splits > 1 and not merges:
        return SplitSoftmax(part_acc, part_m, part_l, out.dtype).merge(out)
    return out
