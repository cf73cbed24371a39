// INT4 (W4A16) grouped expert GEMMs for Kimi K2.6-class MoE layers, tensor cores through mma.sync.
//
// Kernels
//   moe_int4_gemm<NT, U, XB, S, EPI>  one warp = one work item = (active expert, 16-row weight tile), full K; with
//       S > 1 (split K, NT = 1) S warps of a block share an item and add their partial sums through shared memory.
//       EPI 0 (gate+up): the tile holds 8 gate rows and the 8 up rows of the same intermediate channels, so
//             SwiGLU happens in registers: h[pos, 8*tile + g] = bf16(silu(gate) * up).
//       EPI 1 (down):    y[pos, 16*tile + row] = fp32 result (combined later, deterministically).
//       NT n-tiles of 8 tokens per pass; U weight chunks per register stage (double-buffered); XB chunks of
//       activations loaded together.
//   moe_int4_fused<NT, U, XB>      gate/up then down in one launch (per-expert completion counts, an atomic item
//       queue; see its comment).
//   moe_int4_gate_up_grouped<NT, U, XB, S>  the token grouping of <= 32 pairs and gate/up in one launch.
//   moe_group_small        the grouping alone (one warp).
//   moe_combine<OUT_BF16>  out[t, :] = sum_k w[t,k] * y[pos(t,k), :] (+ add[t, :]), fp32 sums, k ascending.
//
// Weight layout (made once at load by optimized/moe.py `repack`; see its docstring for the full story):
//   words  uint4 [L, R, C, 32 lanes]   R = rows/16 tiles, C = Kp/64 chunks, one 16-byte load per lane
//   scales u32   [L, R, C, 16]         bf16 pairs (row g, row g+8) of group 2c + h at index 2g + h: one 8-byte load
//   Word s of lane (g = lane/4, t = lane%4) holds the A fragment of k-step s of mma m16n8k16 with the k axis
//   permuted inside each 64-chunk (physical k = 32*(s/2) + 8t + 4*(s%2) + j for fragment slot j): k-steps 0-1 are
//   the chunk's first scale group, 2-3 its second, and the lane's B fragment is two runs of 8 activations.
//   Nibble p of a word: row g + 8*(p&1), slot j = 2*((p>>1)&1) + (p>>2); value u = q + 8.
//   Dequant: (w >> 4i) & 0x000F000F | 0x43004300 = bf16 pair (128+u), minus 136 = q exactly; the mma sums q*x
//   over a group's two k-steps in fp32, one FFMA adds scale * sum to the accumulator (no bf16 rounding of q*s,
//   unlike the reference's dequantize: 16 HMUL2 per chunk become 8 FFMA).
//
// Launch geometry: 256 threads (8 warps) per block, grid = SMs x resident blocks (capped by the work); each
//   warp walks items w, w + warps, ...; items = n_active * R read from device memory (no host sync).  For T=1
//   (8 experts) gate+up has 8*256 = 2048 items and down 8*448 = 3584 items: every SM gets ~15-27 warps, and a
//   warp's own dependency chain (activation latency, HMMA chains) bounds T=1, hence XB, the two per-group HMMA
//   chains and, for <= 32 pairs, the split-K variant (S = 2: 32 warps per SM at 64 registers).  An expert with
//   more than 8*NT tokens re-streams its tile per further 8*NT tokens: in turn in the two-launch kernels, as
//   separate items that run together (sharing the tile's HBM reads through L2) in the fused one.
//
// Napkin math (K2.6: D 7168, F 2048, group 32): per expert gate+up 14.68 MB nibbles + 1.84 MB scales, down
//   7.34 + 0.92 MB: 24.77 MB.  T=1 touches 8 experts = 198 MB -> 46.7 us at 4.24 TB/s; T=64 ~284 experts =
//   7.0 GB -> 1.66 ms.  Flops 2*3*7168*2048 = 88 MFLOP per token-expert pair: 45 GFLOP at T=64 (~0.1 ms of
//   mma.sync), so T <= ~1000 stays bandwidth-bound.  Per 512-byte chunk a warp issues ~44 ALU (LOP3, SHF,
//   HSUB2) + 4*NT HMMA + 8*NT FFMA: ~22 us of issue at T=1 spread over 132 SMs, under the 47 us byte floor.
//   Expected bound: HBM bandwidth.  Measured (H200, commit 3803171): T=1 77 us = 61% of 4.24 TB/s, T=8..128
//   81-84%, T=256 73% (bench/results/moe_int4.md). Reading the T=1 gate/up bytes alone in this access pattern
//   takes 36 us (bench/moe_read_probe.py) against the kernel's 44: T=1 is bound by per-warp chains, the math
//   and four launch boundaries.

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {       // weights: read once, keep out of L1
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 ld_stream64(const u32* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 ld_act(const void* p) {           // activations: reused by the block's warps
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 ld_weak(const void* p) {          // data written earlier in the same launch:
  uint4 v;                                                          // a plain (coherent, L1-cached) load, ordered
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"              // after this thread's ld.acquire of the count
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// (w >> 4i) nibble pair -> bf16x2 q = u - 8 (exact: bf16 128 + u by LOP3, minus 136). The scale is applied to
// the fp32 mma result of the group (mma_chunk), not here.
__device__ __forceinline__ u32 dequant2(u32 w) {
  u32 v, q;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(v) : "r"(w), "r"(0x000F000Fu), "r"(0x43004300u));
  asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(q) : "r"(v), "r"(0x43084308u));
  return q;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u16 f2bf(float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }

// A token row's activations: a pointer (nullptr: no token), or for the split-K variant an int element offset into
// act (-1: no token), one register instead of two (the variant has 64).
template <bool B, class T, class F> struct Pick { typedef T type; };
template <class T, class F> struct Pick<false, T, F> { typedef F type; };
__device__ __forceinline__ const u16* row_at(const u16*, const u16* x) { return x; }
__device__ __forceinline__ const u16* row_at(const u16* act, int x) { return x >= 0 ? act + x : nullptr; }
__device__ __forceinline__ const u16* no_row(const u16*) { return nullptr; }
__device__ __forceinline__ int no_row(int) { return -1; }
__device__ __forceinline__ void set_row(const u16*& x, const u16* act, size_t off) { x = act + off; }
__device__ __forceinline__ void set_row(int& x, const u16*, size_t off) { x = (int)off; }

// Activations of XB consecutive chunks for NT n-tiles: lane (g, t) reads two runs of 8 values of its token row
// per chunk, 32 columns apart (two 16-byte loads: one per scale group). Issued together before the chunks' math so the L1/L2 latency is paid once
// per XB chunks, not once per chunk (the per-warp dependency chain is what bounds T=1, where each warp owns one
// 16-row tile).
template <int NT, int XB, bool WEAK = false, class XRow>
__device__ __forceinline__ void load_act(uint4 (&xa)[XB][NT], uint4 (&xb)[XB][NT], const u16* act, const XRow (&xrow)[NT],
                                         int c0, int C) {
#pragma unroll
  for (int u = 0; u < XB; ++u) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const u16* row = row_at(act, xrow[j]);
      if (row != nullptr && c0 + u < C) {
        const uint4* p = reinterpret_cast<const uint4*>(row + (c0 + u) * 64);
        xa[u][j] = WEAK ? ld_weak(p) : ld_act(p);
        xb[u][j] = WEAK ? ld_weak(p + 4) : ld_act(p + 4);     // 32 columns on: the chunk's second group
      } else {
        xa[u][j] = make_uint4(0u, 0u, 0u, 0u);
        xb[u][j] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
}

// acc += scale * part for one scale group: pair = bf16 (scale of row g | scale of row g+8).
template <int NT>
__device__ __forceinline__ void scale_add(float (&acc)[NT][4], u32 pair, const float (&part)[NT][4]) {
  const float s_lo = __uint_as_float(pair << 16), s_hi = __uint_as_float(pair & 0xFFFF0000u);
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    acc[j][0] = fmaf(s_lo, part[j][0], acc[j][0]);
    acc[j][1] = fmaf(s_lo, part[j][1], acc[j][1]);
    acc[j][2] = fmaf(s_hi, part[j][2], acc[j][2]);
    acc[j][3] = fmaf(s_hi, part[j][3], acc[j][3]);
  }
}

// One 64-wide k chunk of one 16-row tile against NT n-tiles of 8 token columns. k-steps 0-1 hold the chunk's first
// scale group (32 columns), k-steps 2-3 the second: each group's two HMMAs sum q * x exactly-rounded in fp32 from
// zero (two independent chains), then one FFMA per accumulator adds scale * sum (rows g and g+8 have their own
// scale; sc = (group 0: rows g, g+8 | group 1: rows g, g+8) as bf16 pairs), group 0 first.
// LOW_REG (the split-K variant, 64 registers): one partial-sum set, group 0 scaled before group 1 starts (same
// arithmetic, one chain at a time).
template <int NT, bool LOW_REG = false>
__device__ __forceinline__ void mma_chunk(float (&acc)[NT][4], uint4 w, uint2 sc, const uint4 (&xa)[NT],
                                          const uint4 (&xb)[NT]) {
  const u32 wv[4] = {w.x, w.y, w.z, w.w};
  constexpr int NP = LOW_REG ? 1 : 2;
  float part[NP][NT][4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    if (LOW_REG && s == 2) scale_add<NT>(acc, sc.x, part[0]);
    const u32 q = wv[s];
    const u32 a0 = dequant2(q);          // row g,   k slots 0,1
    const u32 a1 = dequant2(q >> 4);     // row g+8, k slots 0,1
    const u32 a2 = dequant2(q >> 8);     // row g,   k slots 2,3
    const u32 a3 = dequant2(q >> 12);    // row g+8, k slots 2,3
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const u32 b0 = s == 0 ? xa[j].x : s == 1 ? xa[j].z : s == 2 ? xb[j].x : xb[j].z;
      const u32 b1 = s == 0 ? xa[j].y : s == 1 ? xa[j].w : s == 2 ? xb[j].y : xb[j].w;
      float (&pj)[4] = part[(s >> 1) % NP][j];
      if ((s & 1) == 0) pj[0] = pj[1] = pj[2] = pj[3] = 0.f;
      mma_bf16(pj, a0, a1, a2, a3, b0, b1);
    }
  }
  if (!LOW_REG) scale_add<NT>(acc, sc.x, part[0]);
  scale_add<NT>(acc, sc.y, part[NP - 1]);
}

// Expert a's gate/up tiles done (fused kernel): `done` counts finished items per active expert; a down item reads
// h only once its expert's count reaches the gate/up tile count. Release: every lane fences its own h stores,
// then lane 0 counts the item; acquire: every lane reads the count with ld.acquire before its first h load.
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// One work item: (active expert a, 16-row tile r) and its 8*NT-token passes: every pass (the two-launch kernels,
// p0 = 0) or pass p0 alone (FUSED). NT n-tiles of 8 tokens per pass, U weight
// chunks per register stage (the next stage is in flight while this one is multiplied), XB chunks per activation
// batch (U % XB == 0). FUSED (one launch for both GEMMs, see moe_int4_fused): EPI 1 waits for its expert's h, and
// reads h with plain loads (it was written during this launch: not through the read-only path); EPI 0 signals
// `done`.
// (An L2 prefetch 8-16 chunks ahead, including the warp's next item, was measured 5-25% slower on the H200 at
// every T and removed; so was a cp.async shared-memory ring of 3-8 stages: bench/results/moe_notes.md.)
//
// S > 1 (split K, NT = 1): the S warps of a group (warps S*i .. S*i+S-1 of the block) share one item; part p takes
// chunks [p*C/S, (p+1)*C/S) and parts 1..S-1 hand their sums to part 0 through shared memory `red` (named
// barrier 1 + group), which adds them in part order and runs the epilogue: deterministic, but the fp32 sums are
// grouped differently from S = 1 (not bitwise equal to it).
template <int NT, int U, int XB, int EPI, bool FUSED, int S = 1>
__device__ __forceinline__ void gemm_item(
    int a, int r, int p0, const uint4* __restrict__ wq, const u32* __restrict__ ws,
    const u16* __restrict__ act, int ld_act, const int* __restrict__ row_of_pos, const int* __restrict__ active,
    int max_active, void* __restrict__ out, int ld_out, int R, int C, int* __restrict__ done, int need) {
  static_assert(U % XB == 0, "XB must divide U");
  static_assert(S == 1 || (NT == 1 && !FUSED), "split K: NT = 1, two-launch kernels only");
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int warp = threadIdx.x >> 5, part = warp % S;
  const int e = active[a], base = active[max_active + a], cnt = active[2 * max_active + a];
  const size_t tile = (size_t)e * R + r;
  const int cb = part * C / S, ce = (part + 1) * C / S;          // this part's chunks [cb, ce)
  const uint4* wt = wq + (tile * C + cb) * 32 + lane;
  const u32* st = ws + (tile * C + cb) * 16 + g * 2;
  const int x_off = cb * 64;                                    // activation columns before this part's chunks
  for (int n0 = p0 * NT * 8; n0 < cnt; n0 += FUSED ? cnt : NT * 8) {   // fused: the one pass p0
    typename Pick<(S > 1), int, const u16*>::type xrow[NT];    // the token's row (split K: an int offset)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int n = n0 + j * 8 + g;
      xrow[j] = no_row(xrow[j]);
      if (n < cnt) {
        const int row = EPI == 0 ? row_of_pos[base + n] : base + n;
        set_row(xrow[j], act, (size_t)row * ld_act + x_off + 8 * t);
      }
    }
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

    const int Cn = ce - cb;
    uint4 cw[U];
    uint2 cs[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u < Cn) { cw[u] = ld_stream(wt + (size_t)u * 32); cs[u] = ld_stream64(st + (size_t)u * 16); }
      else { cw[u] = make_uint4(0u, 0u, 0u, 0u); cs[u] = make_uint2(0u, 0u); }
    }
    if (FUSED && EPI == 1 && n0 == p0 * NT * 8)      // the first weights are in flight; now wait for h
      while (ld_acquire(done + a) < need) __nanosleep(32);
    for (int c0 = 0; c0 < Cn; c0 += U) {
      uint4 nw[U];
      uint2 ns[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + U + u;
        if (c < Cn) { nw[u] = ld_stream(wt + (size_t)c * 32); ns[u] = ld_stream64(st + (size_t)c * 16); }
        else { nw[u] = make_uint4(0u, 0u, 0u, 0u); ns[u] = make_uint2(0u, 0u); }
      }
#pragma unroll
      for (int u0 = 0; u0 < U; u0 += XB) {
        uint4 xa[XB][NT], xb[XB][NT];
        load_act<NT, XB, FUSED && EPI == 1>(xa, xb, act, xrow, c0 + u0, Cn);
#pragma unroll
        for (int u = 0; u < XB; ++u)
          if (c0 + u0 + u < Cn) mma_chunk<NT, (S > 1)>(acc, cw[u0 + u], cs[u0 + u], xa[u], xb[u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) { cw[u] = nw[u]; cs[u] = ns[u]; }
    }

    // C fragment: v[j][0..1] = row g, columns 2t, 2t+1; v[j][2..3] = row g+8, same columns.
    float (&v)[NT][4] = acc;
    if constexpr (S > 1) {                           // parts 1..S-1 -> part 0, added in part order
      __shared__ float red[8][32][4];
      const int bar = 1 + warp / S;
      if (part > 0)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][lane][i] = v[0][i];
      asm volatile("bar.sync %0, %1;" :: "r"(bar), "r"(32 * S) : "memory");
      if (part == 0)
#pragma unroll
        for (int p = 1; p < S; ++p)
#pragma unroll
          for (int i = 0; i < 4; ++i) v[0][i] += red[warp + p][lane][i];
      asm volatile("bar.sync %0, %1;" :: "r"(bar), "r"(32 * S) : "memory");   // red free for the next pass
      if (part > 0) continue;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int n = n0 + j * 8 + 2 * t + half;
        if (n >= cnt) continue;
        const float lo = v[j][half], hi = v[j][2 + half];
        if (EPI == 0) {
          const float h = lo / (1.f + __expf(-lo)) * hi;            // silu(gate) * up
          static_cast<u16*>(out)[(size_t)(base + n) * ld_out + r * 8 + g] = f2bf(h);
        } else {
          float* y = static_cast<float*>(out) + (size_t)(base + n) * ld_out + r * 16;
          y[g] = lo;
          y[g + 8] = hi;
        }
      }
    }
  }
  if (FUSED && EPI == 0) {                           // this tile of h is complete
    __threadfence();
    __syncwarp();
    if (lane == 0) atomicAdd(done + a, 1);
  }
}

// Split-K variants: 64 registers for 4 blocks (32 warps) per SM. On sm_120 that spills 4-12 bytes (nvcc 13.0), so
// there they keep 3 blocks (80 registers); moe.py sizes the grid from the registers the kernel got.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define SPLIT_MIN_BLOCKS 3
#else
#define SPLIT_MIN_BLOCKS 4
#endif
// Resident blocks of 256 threads each GEMM kernel asks registers for.
#define GEMM_MIN_BLOCKS(NT, U, S) ((S) > 1 ? SPLIT_MIN_BLOCKS : ((NT) == 1 && (U) <= 2) ? 3 : 2)

// Each warp (each group of S warps) of the grid walks items w, w + groups, ... of n_items.
template <int NT, int U, int XB, int EPI, int S>
__device__ __forceinline__ void walk_items(
    int n_items, const uint4* __restrict__ wq, const u32* __restrict__ ws, const u16* __restrict__ act, int ld_act,
    const int* __restrict__ row_of_pos, const int* __restrict__ active, int max_active, void* __restrict__ out,
    int ld_out, int R, int C) {
  const int per_block = (blockDim.x >> 5) / S;
  const int groups = gridDim.x * per_block;
  for (int item = blockIdx.x * per_block + (threadIdx.x >> 5) / S; item < n_items; item += groups) {
    const int a = item / R;
    gemm_item<NT, U, XB, EPI, false, S>(a, item - a * R, 0, wq, ws, act, ld_act, row_of_pos, active, max_active,
                                        out, ld_out, R, C, nullptr, 0);
  }
}

// ---- token -> expert grouping for <= 32 token-expert pairs -------------------------------------------------------
// One warp, lane p = pair p; every count is a loop over the other lanes' local experts by shuffle. The same table as
// moe_group (moe_route.cu): active experts in ascending local id with their first sorted position and count; inside
// an expert, pairs keep their index order. pos_of_pair and sync may be null (the gate/up kernel's shared copy).
__device__ __forceinline__ void group_small_warp(
    const long long* __restrict__ idx, int P, int K, const int* __restrict__ g2l, int E, int* pos_of_pair,
    int* token_of_pos, int* active, int max_active, int* n_active, int* sync) {
  const int p = threadIdx.x & 31;
  if (sync != nullptr)
    for (int i = p; i <= max_active; i += 32) sync[i] = 0;
  int le = -1;
  if (p < P) {
    const long long ge = idx[p];
    le = (ge >= 0 && ge < E) ? g2l[ge] : -1;
  }
  int less = 0, before = 0, same = 0;          // pairs on a lower expert / on mine with a lower index / on mine
  for (int q = 0; q < P; ++q) {
    const int eq = __shfl_sync(0xffffffffu, le, q);
    less += eq >= 0 && eq < le;
    before += eq == le && q < p;
    same += eq == le;
  }
  const bool first = le >= 0 && before == 0;
  const unsigned firsts = __ballot_sync(0xffffffffu, first);
  int rank = 0;                                // distinct experts below mine
  for (int q = 0; q < P; ++q) {
    const int eq = __shfl_sync(0xffffffffu, le, q);
    rank += ((firsts >> q) & 1u) && eq < le;
  }
  if (p == 0) n_active[0] = __popc(firsts);
  if (p < P) {
    if (pos_of_pair != nullptr) pos_of_pair[p] = le >= 0 ? less + before : -1;
    if (le >= 0) token_of_pos[less + before] = p / K;
    if (first) {
      active[rank] = le;
      active[max_active + rank] = less;
      active[2 * max_active + rank] = same;
    }
  }
}

// The grouping alone (P <= 32: T <= 4 at K = 8); block of 32 threads.
extern "C" __global__ void __launch_bounds__(32) moe_group_small(
    const long long* __restrict__ idx, int P, int K, const int* __restrict__ g2l, int E,
    int* __restrict__ pos_of_pair, int* __restrict__ token_of_pos, int* __restrict__ active, int max_active,
    int* __restrict__ n_active, int* __restrict__ sync) {
  group_small_warp(idx, P, K, g2l, E, pos_of_pair, token_of_pos, active, max_active, n_active, sync);
}

// One GEMM over n_active * R items (walk_items).
template <int NT, int U, int XB, int S, int EPI>
__global__ void __launch_bounds__(256, GEMM_MIN_BLOCKS(NT, U, S)) moe_int4_gemm(
    const uint4* __restrict__ wq,        // [L, R, C, 32]
    const u32* __restrict__ ws,          // [L, R, C, 16]
    const u16* __restrict__ act,         // bf16 input rows, row stride ld_act (= C*64) elements
    int ld_act,
    const int* __restrict__ row_of_pos,  // EPI 0: token of each sorted pair position; EPI 1: unused (row = pos)
    const int* __restrict__ active,      // [3, max_active]: local expert, first position, count
    int max_active,
    const int* __restrict__ n_active,    // [1]
    void* __restrict__ out, int ld_out,  // EPI 0: bf16 h [P, ld_out]; EPI 1: fp32 y [P, ld_out]
    int R, int C) {
  walk_items<NT, U, XB, EPI, S>(n_active[0] * R, wq, ws, act, ld_act, row_of_pos, active, max_active, out, ld_out,
                                R, C);
}

// The grouping (P <= 32 pairs) and gate/up in one launch, saving the grouping's kernel boundary: warp 0 of every block
// groups the pairs into shared memory (block 0 also writes the global tables that down and combine read), then the
// block's warps run moe_int4_gemm<..., EPI 0>'s items off the shared table: h is bitwise that of the two launches.
template <int NT, int U, int XB, int S>
__global__ void __launch_bounds__(256, GEMM_MIN_BLOCKS(NT, U, S)) moe_int4_gate_up_grouped(
    const uint4* __restrict__ wq, const u32* __restrict__ ws, const u16* __restrict__ act, int ld_act,
    const long long* __restrict__ idx, int P, int K, const int* __restrict__ g2l, int E,
    int* __restrict__ pos_of_pair, int* __restrict__ token_of_pos, int* __restrict__ active, int max_active,
    int* __restrict__ n_active, int* __restrict__ sync, u16* __restrict__ out, int ld_out, int R, int C) {
  __shared__ int tab[3 * 32 + 32 + 1];           // active [3][32], token_of_pos [32], n_active
  if (threadIdx.x < 32) {
    group_small_warp(idx, P, K, g2l, E, nullptr, tab + 96, tab, 32, tab + 128, nullptr);
    if (blockIdx.x == 0)
      group_small_warp(idx, P, K, g2l, E, pos_of_pair, token_of_pos, active, max_active, n_active, sync);
  }
  __syncthreads();
  walk_items<NT, U, XB, 0, S>(tab[128] * R, wq, ws, act, ld_act, tab + 96, tab, 32, out, ld_out, R, C);
}

// Both GEMMs in one launch: gate/up items first, then down items, handed out in that order from an atomic queue
// (`sync[max_active]`, zeroed by the grouping kernel with the per-expert `done` counts `sync[0..max_active)`).
// An item is one 8*NT-token pass over one tile, (a, r, p): an expert with more tokens than one pass holds has its
// passes as separate items, adjacent in the queue (p fastest), so they run at the same time on neighbouring warps
// and read the tile's weights from HBM about once (the rest through L2) instead of once per pass, one after another
// (skewed routings: a verify tree's rows share tokens, so a few experts take tens of tokens). Every block rebuilds
// the pass prefix pre[a] = sum of passes of experts before a in shared memory (one scan, no extra launch).
// A down item waits until all of its expert's gate/up items (R13 tiles x passes) are done, with its first weights
// already in flight, so the down stream starts while the last gate/up tiles finish instead of after a kernel
// boundary. No deadlock whatever the residency: a warp takes a down item only after every gate/up item has been
// taken by a running warp, and gate/up items never wait. The math is gemm_item's: bitwise equal to the two
// separate launches.
#define MOE_FUSED_MAX_ACTIVE 512   // pass-prefix table in shared memory (moe.py refuses more local experts)

// (a, r, p) of item i of a GEMM with R tiles per expert: pre[a] * R <= i < pre[a + 1] * R, passes pre[a+1] - pre[a]
__device__ __forceinline__ void pass_item(int i, const int* pre, int na, int R, int& a, int& r, int& p, int& np) {
  int lo = 0, hi = na - 1;                 // the last a with pre[a] * R <= i
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (pre[mid] * R <= i) lo = mid; else hi = mid - 1;
  }
  a = lo;
  np = pre[a + 1] - pre[a];
  const int local = i - pre[a] * R;
  r = local / np;
  p = local - r * np;
}

template <int NT, int U, int XB>
__global__ void __launch_bounds__(256, GEMM_MIN_BLOCKS(NT, U, 1)) moe_int4_fused(
    const uint4* __restrict__ w13, const u32* __restrict__ s13, const uint4* __restrict__ w2,
    const u32* __restrict__ s2, const u16* __restrict__ x, int ld_x, const int* __restrict__ row_of_pos,
    const int* __restrict__ active, int max_active, const int* __restrict__ n_active, u16* __restrict__ h, int ld_h,
    float* __restrict__ y, int ld_y, int R13, int C13, int R2, int C2, int* __restrict__ sync) {
  __shared__ int pre[MOE_FUSED_MAX_ACTIVE + 1];
  __shared__ int warp_sum[8], first_item[8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int* queue = sync + max_active;
  const int na = n_active[0];
  {                                        // pre[0..512] by a block scan, two experts a thread (256 threads)
    const int i0 = 2 * threadIdx.x, i1 = i0 + 1;   // counts loaded with na, not after it (masked below)
    const int c0 = i0 < max_active ? active[2 * max_active + i0] : 0;
    const int c1 = i1 < max_active ? active[2 * max_active + i1] : 0;
    if (lane == 0) first_item[warp] = atomicAdd(queue, 1);   // the warp's first item, taken during the loads
    const int v0 = i0 < na ? (c0 + 8 * NT - 1) / (8 * NT) : 0;
    const int v1 = i1 < na ? (c1 + 8 * NT - 1) / (8 * NT) : 0;
    int s = v0 + v1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += n;
    }
    if (lane == 31) warp_sum[warp] = s;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; ++w) before += warp_sum[w];
    const int excl = before + s - v0 - v1;
    pre[i0] = excl;
    pre[i1] = excl + v0;
    if (threadIdx.x == 255) pre[MOE_FUSED_MAX_ACTIVE] = before + s;
    __syncthreads();
  }
  const int passes = pre[na];
  const int n13 = passes * R13, n_items = n13 + passes * R2;
  int item = first_item[warp];
  while (item < n_items) {
    int next = 0;
    if (lane == 0) next = atomicAdd(queue, 1);      // taken now, used after this item
    next = __shfl_sync(0xffffffffu, next, 0);
    int a, r, p, np;
    if (item < n13) {
      pass_item(item, pre, na, R13, a, r, p, np);
      gemm_item<NT, U, XB, 0, true>(a, r, p, w13, s13, x, ld_x, row_of_pos, active, max_active, h, ld_h, R13,
                                    C13, sync, 0);
    } else {
      pass_item(item - n13, pre, na, R2, a, r, p, np);
      gemm_item<NT, U, XB, 1, true>(a, r, p, w2, s2, h, ld_h, nullptr, active, max_active, y, ld_y, R2, C2,
                                    sync, R13 * np);
    }
    item = next;
  }
}

// out[t, d:d+4] = sum_k w[t,k] * y[pos[t,k], d:d+4] (+ add[t, d:d+4]); pos < 0 (expert not owned) skipped.
template <int OUT_BF16>
__global__ void __launch_bounds__(256) moe_combine(
    const float* __restrict__ y, const int* __restrict__ pos_of_pair, const float* __restrict__ w,
    const u16* __restrict__ add, int K, int D, void* __restrict__ out) {
  const int tok = blockIdx.y;
  const int d = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (d >= D) return;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  constexpr int KB = 8;                 // loads of KB experts issued together (one latency, not KB), k ascending
  for (int k0 = 0; k0 < K; k0 += KB) {
    int p[KB];
    float wk[KB];
    float4 v[KB];
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      p[j] = k0 + j < K ? pos_of_pair[tok * K + k0 + j] : -1;
      wk[j] = k0 + j < K ? w[tok * K + k0 + j] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < KB; ++j)
      v[j] = p[j] >= 0 ? *reinterpret_cast<const float4*>(y + (size_t)p[j] * D + d) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < KB; ++j) {
      if (p[j] < 0) continue;
      acc.x += wk[j] * v[j].x; acc.y += wk[j] * v[j].y; acc.z += wk[j] * v[j].z; acc.w += wk[j] * v[j].w;
    }
  }
  if (add != nullptr) {
    const uint2 a = *reinterpret_cast<const uint2*>(add + (size_t)tok * D + d);
    acc.x += bf2f((u16)(a.x & 0xFFFFu)); acc.y += bf2f((u16)(a.x >> 16));
    acc.z += bf2f((u16)(a.y & 0xFFFFu)); acc.w += bf2f((u16)(a.y >> 16));
  }
  if (OUT_BF16) {
    uint2 o;
    o.x = (u32)f2bf(acc.x) | ((u32)f2bf(acc.y) << 16);
    o.y = (u32)f2bf(acc.z) | ((u32)f2bf(acc.w) << 16);
    *reinterpret_cast<uint2*>(static_cast<u16*>(out) + (size_t)tok * D + d) = o;
  } else {
    *reinterpret_cast<float4*>(static_cast<float*>(out) + (size_t)tok * D + d) = acc;
  }
}

#ifdef MOE_NVCC_CHECK   // nvcc -cubin syntax/resource check of the variants optimized/moe.py instantiates
#define GEMM(NT, U, XB, S, EPI) template __global__ void moe_int4_gemm<NT, U, XB, S, EPI>(const uint4*, \
    const u32*, const u16*, int, const int*, const int*, int, const int*, void*, int, int, int);
#define FUSED(NT, U, XB) template __global__ void moe_int4_fused<NT, U, XB>(const uint4*, const u32*, const uint4*, \
    const u32*, const u16*, int, const int*, const int*, int, const int*, u16*, int, float*, int, int, int, int, int, int*);
#define BOTH(NT, U, XB) GEMM(NT, U, XB, 1, 0) GEMM(NT, U, XB, 1, 1) FUSED(NT, U, XB) GROUPED(NT, U, XB, 1)
#define GROUPED(NT, U, XB, S) template __global__ void moe_int4_gate_up_grouped<NT, U, XB, S>(const uint4*, \
    const u32*, const u16*, int, const long long*, int, int, const int*, int, int*, int*, int*, int, int*, int*, \
    u16*, int, int, int);
#define SPLIT(NT, U, XB, S) GEMM(NT, U, XB, S, 0) GEMM(NT, U, XB, S, 1) GROUPED(NT, U, XB, S)
BOTH(1, 4, 4) BOTH(1, 4, 1) BOTH(1, 2, 2) BOTH(4, 1, 1)
SPLIT(1, 1, 1, 2)
template __global__ void moe_combine<0>(const float*, const int*, const float*, const u16*, int, int, void*);
template __global__ void moe_combine<1>(const float*, const int*, const float*, const u16*, int, int, void*);
#endif
