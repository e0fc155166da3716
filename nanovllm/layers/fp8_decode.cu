// fp8 paged decode attention in CUDA (compiled at run time by NVRTC: cuda_decode.py).
//
// One block of 4 warps per (split, kv head, sequence); its G query heads (GQA) over 128-key tiles of the
// split's context. Both products are m16n8k16 tensor-core MMAs with the keys (K q^T) or head_dim (P V) on the
// 16-row side and the heads on the 8-wide side, as in the Triton kernel (triton_decode._keys_major_step). What
// differs is where the operands come from: each thread loads the fp8 bytes its A fragments hold straight from
// global memory into registers and converts them there, so no K or V byte passes through shared memory. That
// works because a dot product does not care in which order its terms are summed: along the reduced axis a
// thread's A and B fragments may hold any elements, as long as both hold the same ones. Here thread (g, t)
// of a warp (g = lane / 4, t = lane % 4) holds, in k-step s, elements 32t + 4s + {0, 1} in fragment slots
// 2t, 2t + 1 and 32t + 4s + {2, 3} in slots 2t + 8, 2t + 9: per row, 32 contiguous bytes (two 16-byte loads).
//
// Per tile: warp w computes the logits of keys 32w..32w+31; their maxima (and the tile's largest V scale) are
// exchanged through shared memory (barrier 1); the softmax weights go to shared memory as fp16 (barrier 2); warp
// w then accumulates head_dim rows 32w..32w+31 of the output over all 128 keys. The next tile's K is loaded
// during P V, its V during the next K q^T. The fp8 scheme is triton_attention.py's: logits times the key's
// scale, weights p * v_scale / max v_scale in fp16, the product times max v_scale.
//
// Defined by the compiler options: G (query heads per kv head, <= 8), NUM_KV_HEADS, D (128), NUM_SPLITS (a
// power of two), LAST_SPLIT_MERGES (0/1), MIN_BLOCKS (blocks an SM must fit: caps the registers a thread).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

struct alignas(16) Words4 {
  u32 x[4];
};

#define TILE 128
#define NEG_INF (-1.0e30f)  // the running max before any key: exp2(m_old - m_new) stays finite

__device__ __forceinline__ void load16(u32 w[4], const void* p) {
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
}

__device__ __forceinline__ float load_past_l1(const float* p) {  // from L2 (.cg): other blocks stored it
  float x;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(x) : "l"(p));
  return x;
}

__device__ __forceinline__ u32 fp8x2_to_half2(u32 x) {  // the low 16 bits' two e4m3 values
  u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((u16)x));
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {  // as Triton's tl.exp2
  float r;
  asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ u32 half2_of(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u32 bf16x2_to_half2(u32 x) {
  return half2_of(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
}

__device__ __forceinline__ u16 to_bf16(float x) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ u16 to_half(float x) {
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

// c += A B, A [16 x 16] in a0..a3, B [16 x 8] in b0, b1 (fp16), c [16 x 8] float32.
__device__ __forceinline__ void mma(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// C [16 x 8] = A B, A the fp8 rows of w (rows g and g + 8, 8 words each: 32 bytes of the reduced axis).
__device__ __forceinline__ void mma_fp8_rows(float c[4], const u32 row_g[8], const u32 row_g8[8], const u32 b[8][2]) {
  c[0] = c[1] = c[2] = c[3] = 0.f;
#pragma unroll
  for (int s = 0; s < 8; ++s)
    mma(c, fp8x2_to_half2(row_g[s]), fp8x2_to_half2(row_g8[s]), fp8x2_to_half2(row_g[s] >> 16),
        fp8x2_to_half2(row_g8[s] >> 16), b[s][0], b[s][1]);
}

__device__ __forceinline__ float warp_max_over_rows(float x) {  // over the 8 lanes of one t (lane bits 2..4)
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

__device__ __forceinline__ float warp_sum_over_rows(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

struct Cache {
  const u8* k;
  const u8* v;
  const float* k_scale;
  const float* v_scale;
  const int* table;
  long long stride_kb, stride_vb, stride_sb;
  int stride_kt, stride_kh, stride_vh, stride_vd, stride_sh, page, kv_head;
};

// This thread's K rows of the tile at `start` (keys 32w + 16mb + g + 8r, bytes 32t..32t+31) and their scales.
__device__ __forceinline__ void load_k(const Cache& c, int block, int start, int warp, int g, int t, u32 k[2][2][8],
                                       float ks[2][2], float vs[2][2]) {
  const int offset = start % c.page;
  const u8* base = c.k + block * c.stride_kb + c.kv_head * c.stride_kh + 32 * t;
  const long long scales = block * c.stride_sb + c.kv_head * c.stride_sh + offset;
#pragma unroll
  for (int mb = 0; mb < 2; ++mb)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = 32 * warp + 16 * mb + g + 8 * r;
      const u8* p = base + (long long)(offset + key) * c.stride_kt;
      load16(k[mb][r], p);
      load16(k[mb][r] + 4, p + 16);
      ks[mb][r] = c.k_scale[scales + key];
      vs[mb][r] = c.v_scale[scales + key];
    }
}

// Zero the V bytes of keys at or past `end` (stale or never-written cache bytes may be fp8 NaNs, and a zero
// weight times NaN is NaN). Word w of a row holds the keys tile + 32t + 4w + {0..3}.
__device__ __forceinline__ void mask_v(u32 v[2][2][8], int tile, int end, int t) {
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    const int n = end - (tile + 32 * t + 4 * w);  // valid keys in the word, if below 4
    const u32 keep = n >= 4 ? 0xffffffffu : n <= 0 ? 0u : (1u << (8 * n)) - 1u;
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int r = 0; r < 2; ++r) v[mb][r][w] &= keep;
  }
}

// This thread's V rows of the tile (head_dim rows 32w + 16mb + g + 8r, the tile's keys 32t..32t+31).
__device__ __forceinline__ void load_v(const Cache& c, int block, int start, int warp, int g, int t, u32 v[2][2][8]) {
  const u8* base = c.v + block * c.stride_vb + c.kv_head * c.stride_vh + start % c.page + 32 * t;
#pragma unroll
  for (int mb = 0; mb < 2; ++mb)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const u8* p = base + (long long)(32 * warp + 16 * mb + g + 8 * r) * c.stride_vd;
      load16(v[mb][r], p);
      load16(v[mb][r] + 4, p + 16);
    }
}

extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS) fp8_decode(
    const u16* __restrict__ q, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, const int* __restrict__ order, u16* __restrict__ out,
    float* __restrict__ part_acc, float* __restrict__ part_m, float* __restrict__ part_l, int* __restrict__ counts,
    double sm_scale_log2_arg, int stride_qb, int stride_qh, int stride_ob, int stride_oh, int stride_kb,
    int stride_kt, int stride_kh, int stride_vb, int stride_vh, int stride_vd, int stride_sb, int stride_sh,
    int stride_bt, int page, int ordered) {
  const int split = blockIdx.x, kv_head = blockIdx.y;
  const int seq = ordered ? order[blockIdx.z] : blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
  const float sm_scale_log2 = (float)sm_scale_log2_arg;
  const int ctx = context_lens[seq];
  const int per_split = ((ctx + NUM_SPLITS - 1) / NUM_SPLITS + TILE - 1) / TILE * TILE;  // whole tiles
  const int start = split * per_split, end = min(start + per_split, ctx);

  __shared__ float s_max[4][8], s_vmax[4], s_l[4][8];
  __shared__ alignas(16) u16 s_w[G][TILE + 8];  // the weights of head h, keys of the tile (padded rows)
  __shared__ int s_last;

  const Cache c = {k_cache, v_cache, k_scale, v_scale, block_tables + (long long)seq * stride_bt, stride_kb,
                   stride_vb, stride_sb, stride_kt, stride_kh, stride_vh, stride_vd, stride_sh, page, kv_head};
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // heads 2t, 2t + 1: running max (log2 units), sum
  float acc[2][4] = {};  // head_dim rows 32w + 16mb + g (+ 8), heads 2t, 2t + 1

  if (start < end) {
    u32 qb[8][2];  // q of head g as the K q^T product's B operand, in fp16 (zero past the G heads)
    if (g < G) {
      const u16* row = q + (long long)seq * stride_qb + (kv_head * G + g) * stride_qh + 32 * t;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        u32 w[4];
        load16(w, row + 8 * i);
        qb[2 * i][0] = bf16x2_to_half2(w[0]);
        qb[2 * i][1] = bf16x2_to_half2(w[1]);
        qb[2 * i + 1][0] = bf16x2_to_half2(w[2]);
        qb[2 * i + 1][1] = bf16x2_to_half2(w[3]);
      }
    } else {
#pragma unroll
      for (int s = 0; s < 8; ++s) qb[s][0] = qb[s][1] = 0u;
    }
    u32 k[2][2][8], v[2][2][8];
    float ks[2][2], vs[2][2];
    int block = c.table[start / page];
    load_k(c, block, start, warp, g, t, k, ks, vs);
    load_v(c, block, start, warp, g, t, v);
    for (int tile = start; tile < end; tile += TILE) {
      const int next = tile + TILE;
      const int next_block = next < end ? c.table[next / page] : 0;
      float x[2][4];  // logits (times the key's scale) of keys 32w + 16mb + g (+ 8), heads 2t, 2t + 1
      float tile_max[2] = {-__int_as_float(0x7f800000), -__int_as_float(0x7f800000)}, v_max = 0.f;
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
        mma_fp8_rows(x[mb], k[mb][0], k[mb][1], qb);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int r = j >> 1;
          const bool valid = tile + 32 * warp + 16 * mb + g + 8 * r < end;
          x[mb][j] = valid ? x[mb][j] * ks[mb][r] : -__int_as_float(0x7f800000);
          tile_max[j & 1] = fmaxf(tile_max[j & 1], x[mb][j]);
          if (valid) v_max = fmaxf(v_max, vs[mb][r]);
        }
      }
      tile_max[0] = warp_max_over_rows(tile_max[0]) * sm_scale_log2;
      tile_max[1] = warp_max_over_rows(tile_max[1]) * sm_scale_log2;
      v_max = warp_max_over_rows(v_max);
      if (g == 0) {
        s_max[warp][2 * t] = tile_max[0];
        s_max[warp][2 * t + 1] = tile_max[1];
      }
      if ((tid & 31) == 0) s_vmax[warp] = v_max;
      __syncthreads();
      float alpha[2];
      v_max = fmaxf(fmaxf(s_vmax[0], s_vmax[1]), fmaxf(s_vmax[2], s_vmax[3]));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* col = &s_max[0][2 * t + h];
        const float m_new = fmaxf(m[h], fmaxf(fmaxf(col[0], col[8]), fmaxf(col[16], col[24])));
        alpha[h] = fast_exp2(m[h] - m_new);
        m[h] = m_new;
        l[h] *= alpha[h];
      }
#pragma unroll
      for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int h = j & 1, r = j >> 1, key = 32 * warp + 16 * mb + g + 8 * r;
          const float p = fast_exp2(x[mb][j] * sm_scale_log2 - m[h]);  // 0 past the context (logit -inf)
          l[h] += p;
          if (2 * t + h < G) s_w[2 * t + h][key] = to_half(tile + key < end ? p * (vs[mb][r] / v_max) : 0.f);
        }
      if (next < end) load_k(c, next_block, next, warp, g, t, k, ks, vs);
      __syncthreads();
      u32 pb[8][2];  // the weights of head g as the P V product's B operand (keys 32t + 4s + ...)
      if (g < G) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const Words4 w = *reinterpret_cast<const Words4*>(&s_w[g][32 * t + 8 * i]);
          pb[2 * i][0] = w.x[0];
          pb[2 * i][1] = w.x[1];
          pb[2 * i + 1][0] = w.x[2];
          pb[2 * i + 1][1] = w.x[3];
        }
      } else {
#pragma unroll
        for (int s = 0; s < 8; ++s) pb[s][0] = pb[s][1] = 0u;
      }
      if (next > end) mask_v(v, tile, end, t);
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
        float pv[4];
        mma_fp8_rows(pv, v[mb][0], v[mb][1], pb);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[mb][j] = acc[mb][j] * alpha[j & 1] + pv[j] * v_max;
      }
      if (next < end) load_v(c, next_block, next, warp, g, t, v);
    }
  }

  l[0] = warp_sum_over_rows(l[0]);
  l[1] = warp_sum_over_rows(l[1]);
  if (g == 0) {
    s_l[warp][2 * t] = l[0];
    s_l[warp][2 * t + 1] = l[1];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) l[h] = s_l[0][2 * t + h] + s_l[1][2 * t + h] + s_l[2][2 * t + h] + s_l[3][2 * t + h];

  const int H = G * NUM_KV_HEADS;
#pragma unroll
  for (int mb = 0; mb < 2; ++mb)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int h = 2 * t + (j & 1), d = 32 * warp + 16 * mb + g + 8 * (j >> 1);
      if (h >= G) continue;
      const int head = kv_head * G + h;
      if (NUM_SPLITS == 1) {
        const float sum = l[j & 1];
        out[(long long)seq * stride_ob + head * stride_oh + d] = to_bf16(acc[mb][j] / (sum == 0.f ? 1.f : sum));
      } else {
        const long long row = ((long long)seq * H + head) * NUM_SPLITS + split;
        part_acc[row * D + d] = acc[mb][j];
        if (warp == 0 && mb == 0 && j < 2 && g == 0) {
          part_m[row] = m[j & 1];
          part_l[row] = l[j & 1];
        }
      }
    }
  if (NUM_SPLITS == 1 || !LAST_SPLIT_MERGES) return;

  // The last split to finish merges the NUM_SPLITS partials (as split_softmax.merge_splits does).
  __threadfence();
  __syncthreads();
  int* count = counts + seq * NUM_KV_HEADS + kv_head;
  if (tid == 0) s_last = atomicAdd(count, 1) == NUM_SPLITS - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  for (int i = tid; i < G * D; i += blockDim.x) {
    const int head = kv_head * G + i / D, d = i % D;
    const long long row = ((long long)seq * H + head) * NUM_SPLITS;
    float m_max = load_past_l1(part_m + row);
#pragma unroll
    for (int s = 1; s < NUM_SPLITS; ++s) m_max = fmaxf(m_max, load_past_l1(part_m + row + s));
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int s = 0; s < NUM_SPLITS; ++s) {
      const float w = fast_exp2(load_past_l1(part_m + row + s) - m_max);
      den += w * load_past_l1(part_l + row + s);
      num += w * load_past_l1(part_acc + (row + s) * D + d);
    }
    out[(long long)seq * stride_ob + head * stride_oh + d] = to_bf16(num / (den == 0.f ? 1.f : den));
  }
  if (tid == 0) *count = 0;
}
