// MoE routing (noaux_tc) and token -> expert grouping for the INT4 MoE path (optimized/moe.py).
//
// Both kernels are extern "C": optimized/moe.py fetches them by plain name. (The one-warp grouping for <= 32 pairs,
// moe_group_small, lives in moe_int4.cu: the gate/up kernel runs the same code in its own launch.)
//
// moe_route: one block per token (grid T, block 128, shared 4*(2E + 2*n_group + K) bytes); the scores by all 128
//   threads, the selection by warp 0.
//   logits = the sum of `parts` partial logit arrays [parts, T, E] in order (moe_router_gemm's column slices; 1 for
//   a plain [T, E] array); scores = sigmoid(logits) (fp32); choice = scores + bias (selection only); with n_group > 1 keep the
//   topk_group groups whose top-2 choice sum is highest (others -inf); K rounds of warp arg-max over choice
//   (ties -> lowest expert id) give the ids in descending order, as torch.topk(sorted=True) does; weights are
//   the unbiased scores, / (sum + 1e-20) when norm, times routed_scaling_factor.
//   Napkin: T*E*4 bytes of logits (1.5 KB/token at E=384) and ~K*E/32 compares per lane: a few us, launch-bound.
//
// moe_group: one block of 1024 threads (shared 4*(3L + 32) bytes, L = local experts <= 4096).
//   Counts pairs (t, k) per owned expert (global id -> local id through g2l, -1 = not owned), scans the counts
//   into positions (experts in ascending local id, pairs of one expert contiguous), and writes
//     pos_of_pair[t*K+k]  sorted position of the pair, -1 when its expert is not owned
//     token_of_pos[pos]   token t of each position
//     active[0|1|2][a]    local id, first position and count of the a-th used expert; n_active[0] = how many
//   The order of pairs inside one expert follows shared-memory atomics (not fixed); every pair is computed
//   independently downstream, so results do not depend on it.
//   Napkin: P = T*K <= 8192 pairs, two passes: ~5 us, launch-bound.

typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000)
#define ROUTE_SLOTS 4       // moe_route: experts per thread per step (128 threads: E <= 512 in one step)
#define ROUTE_PARTS 8       // and logit parts loaded up front (moe_router_gemm writes 8)

// Warp arg-max over (value, index): larger value wins, ties go to the smaller index.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
}

extern "C" __global__ void __launch_bounds__(128) moe_route(
    const float* __restrict__ logits,   // [parts, T, E]: the router logits are the sum of the parts, in order
    int parts,
    const float* __restrict__ bias,     // [E]
    int E, int K, int n_group, int topk_group, int norm, float scale,
    long long* __restrict__ idx_out,    // [T, K]
    float* __restrict__ w_out) {        // [T, K]
  extern __shared__ float sm[];
  float* score = sm;                    // [E]
  float* choice = sm + E;               // [E]
  float* gscore = sm + 2 * E;           // [n_group]
  float* gkeep = gscore + n_group;      // [n_group]
  int* chosen = reinterpret_cast<int*>(gkeep + n_group);   // [K]
  const int tok = blockIdx.x, lane = threadIdx.x & 31;
  const float* lg = logits + (size_t)tok * E;
  const size_t part_stride = (size_t)gridDim.x * E;
  // every thread of the block: the logits (parts added in order), sigmoid, biased choice -> shared memory. All
  // of a thread's loads (ROUTE_SLOTS experts x up to ROUTE_PARTS parts) go out before the first add: a single
  // warp waiting on each load in turn made this ~10 us at E = 384.
  for (int e1 = 0; e1 < E; e1 += ROUTE_SLOTS * 128) {
    float lv[ROUTE_SLOTS][ROUTE_PARTS];
#pragma unroll
    for (int j = 0; j < ROUTE_SLOTS; ++j) {
      const int e = e1 + threadIdx.x + 128 * j;
#pragma unroll
      for (int p = 0; p < ROUTE_PARTS; ++p) lv[j][p] = e < E && p < parts ? __ldg(lg + p * part_stride + e) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < ROUTE_SLOTS; ++j) {
      const int e = e1 + threadIdx.x + 128 * j;
      if (e >= E) continue;
      float v = lv[j][0];
#pragma unroll
      for (int p = 1; p < ROUTE_PARTS; ++p) if (p < parts) v += lv[j][p];
      for (int p = ROUTE_PARTS; p < parts; ++p) v += __ldg(lg + p * part_stride + e);
      const float s = 1.f / (1.f + expf(-v));
      score[e] = s;
      choice[e] = s + __ldg(bias + e);
    }
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;        // the selection: one warp
  if (n_group > 1) {
    const int gsz = E / n_group;
    for (int gi = 0; gi < n_group; ++gi) {
      float m1 = NEG_INF, m2 = NEG_INF;          // top-2 of the group, duplicates counted twice
      for (int e = lane; e < gsz; e += 32) {
        const float v = choice[gi * gsz + e];
        if (v > m1) { m2 = m1; m1 = v; } else if (v > m2) { m2 = v; }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float o1 = __shfl_xor_sync(0xffffffffu, m1, off), o2 = __shfl_xor_sync(0xffffffffu, m2, off);
        const float n2 = fmaxf(fminf(m1, o1), fmaxf(m2, o2));
        m1 = fmaxf(m1, o1);
        m2 = n2;
      }
      if (lane == 0) { gscore[gi] = m1 + m2; gkeep[gi] = 0.f; }
    }
    __syncwarp();
    for (int r = 0; r < topk_group; ++r) {
      float v = NEG_INF;
      int i = 0x7fffffff;
      for (int gi = lane; gi < n_group; gi += 32)
        if (gkeep[gi] == 0.f && (gscore[gi] > v || (gscore[gi] == v && gi < i))) { v = gscore[gi]; i = gi; }
      warp_argmax(v, i);
      if (lane == 0 && i < n_group) gkeep[i] = 1.f;
      __syncwarp();
    }
    for (int e = lane; e < E; e += 32)
      if (gkeep[e / gsz] == 0.f) choice[e] = NEG_INF;
    __syncwarp();
  }
  for (int k = 0; k < K; ++k) {
    float v = NEG_INF;
    int i = 0x7fffffff;
    for (int e = lane; e < E; e += 32) {
      const float c = choice[e];
      if (c > v || (c == v && e < i)) { v = c; i = e; }
    }
    warp_argmax(v, i);
    if (lane == 0) { chosen[k] = i; choice[i] = NEG_INF; }
    __syncwarp();
  }
  if (lane == 0) {
    float sum = 0.f;
    for (int k = 0; k < K; ++k) sum += score[chosen[k]];
    for (int k = 0; k < K; ++k) {
      idx_out[(size_t)tok * K + k] = chosen[k];
      w_out[(size_t)tok * K + k] = norm ? score[chosen[k]] / (sum + 1e-20f) * scale : score[chosen[k]] * scale;
    }
  }
}

// Exclusive block scan of one int per thread (1024 threads); returns the exclusive prefix, total in *total.
__device__ __forceinline__ int block_scan(int v, int* wsum, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) wsum[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = wsum[lane];
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, off);
      if (lane >= off) s += y;
    }
    wsum[lane] = s;                      // inclusive prefix of warp sums
  }
  __syncthreads();
  const int before = (warp > 0 ? wsum[warp - 1] : 0) + x - v;
  *total = wsum[31];
  __syncthreads();                       // wsum is reused by the next scan
  return before;
}

extern "C" __global__ void __launch_bounds__(1024) moe_group(
    const long long* __restrict__ idx,  // [P] global expert id of pair p = t*K + k
    int P, int K,
    const int* __restrict__ g2l,        // [E] local id or -1
    int E, int L,
    int* __restrict__ pos_of_pair,      // [P]
    int* __restrict__ token_of_pos,     // [P]
    int* __restrict__ active,           // [3, max_active]
    int max_active,
    int* __restrict__ n_active,         // [1]
    int* __restrict__ sync) {           // [max_active + 1]: zeroed for moe_int4_fused (done counts, item queue)
  extern __shared__ int smi[];
  int* cnt = smi;                       // [L]
  int* off = smi + L;                   // [L]
  int* rnk = smi + 2 * L;               // [L]
  int* wsum = smi + 3 * L;              // [32]
  const int tid = threadIdx.x;
  for (int e = tid; e < L; e += blockDim.x) cnt[e] = 0;
  for (int i = tid; i <= max_active; i += blockDim.x) sync[i] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += blockDim.x) {
    const long long ge = idx[p];
    const int le = (ge >= 0 && ge < E) ? g2l[ge] : -1;
    pos_of_pair[p] = le >= 0 ? atomicAdd(&cnt[le], 1) : -1;     // slot inside the expert, for now
  }
  __syncthreads();
  const int per = (L + blockDim.x - 1) / blockDim.x;
  const int lo = min(tid * per, L), hi = min(lo + per, L);
  int sc = 0, sf = 0;
  for (int e = lo; e < hi; ++e) { sc += cnt[e]; sf += cnt[e] > 0; }
  int total_c, total_f;
  int run_c = block_scan(sc, wsum, &total_c);
  int run_f = block_scan(sf, wsum, &total_f);
  for (int e = lo; e < hi; ++e) {
    off[e] = run_c; rnk[e] = run_f;
    run_c += cnt[e]; run_f += cnt[e] > 0;
  }
  if (tid == 0) n_active[0] = total_f;
  __syncthreads();
  for (int e = tid; e < L; e += blockDim.x) {
    if (cnt[e] > 0) {
      const int a = rnk[e];
      active[a] = e;
      active[max_active + a] = off[e];
      active[2 * max_active + a] = cnt[e];
    }
  }
  for (int p = tid; p < P; p += blockDim.x) {
    const int slot = pos_of_pair[p];
    if (slot < 0) continue;
    const int pos = off[g2l[idx[p]]] + slot;
    pos_of_pair[p] = pos;
    token_of_pos[pos] = p / K;
  }
}

// moe_router_gemm: the reference router's x.float() @ W.float().T (x [T, D] bf16 -> fp32 exactly, W [E, D] fp32,
// fp32 products and sums) as RK = 8 partial sums over column slices, partial [RK, T, E] fp32, which moe_route adds
// in order 0..RK-1: a fixed summation order (the same bits every run), no atomics.
// Grid (E / 16, RK, passes) blocks of 256 threads. Block (g, k, z): experts 16g .. 16g+15 (2 per warp), the k-th
// D/RK columns (D % 32 == 0, D / RK <= 4 * 32 * ROUTER_CMAX), tokens in passes of 16: passes z, z + gridDim.z, ...
// (the launcher gives every pass its own block: at the trained pair's D = 256 a 16-token pass takes ~6 us, its
// tokens' butterflies one after another, so side by side T = 17..257 all take ~6 us; router_ab.md). Thread
// (warp, lane): float4 columns lane + 32c of the slice, c < ROUTER_CMAX, for its 2 experts: loaded once, all at
// once, and kept in registers for the block's tokens. A pass stages its x slice in shared memory (every load in
// flight together), then each thread adds its columns' products per (expert, token) in column order, and a
// butterfly adds the lanes. Every output is the same sum in the same order whatever the grid.
// Memory: W 11 MB once (2.6 us at 4.24 TB/s), x's slices cross L2 E/16 times (T = 65: 22 MB). FMAs: T x E x D
// (T = 65: ~6 us of the GPU's fp32 rate). cuBLAS took 7.5 / 20.7 / 22 us at T = 1 / 17 / 65
// (bench/results/engine_run11); a first version of this kernel that waited for its W loads column step by column
// step took 12.8 / 24.6 / 62 us.
#define ROUTER_RK 8
#define ROUTER_EG 16
#define ROUTER_TT 16
#define ROUTER_CMAX 8       // float4 column steps per lane: D / RK <= 1024 columns (K2.6: 896)
extern "C" __global__ void __launch_bounds__(256, 2) moe_router_gemm(
    const unsigned short* __restrict__ x, const float* __restrict__ W, int T, int E, int D,
    float* __restrict__ partial) {
  constexpr int EPW = ROUTER_EG / 8;                          // experts per warp
  __shared__ uint2 xs[ROUTER_TT][32 * ROUTER_CMAX];           // x's slice for one pass, 4 bf16 per entry
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e0 = blockIdx.x * ROUTER_EG + warp * EPW;
  const int slice4 = D / (4 * ROUTER_RK), q0 = blockIdx.y * slice4;   // float4 columns of this block
  float* out = partial + (size_t)blockIdx.y * T * E;
  float4 w[EPW][ROUTER_CMAX];
#pragma unroll
  for (int e = 0; e < EPW; ++e)
#pragma unroll
    for (int c = 0; c < ROUTER_CMAX; ++c) {
      const int col = lane + 32 * c;
      w[e][c] = e0 + e < E && col < slice4
                    ? __ldg(reinterpret_cast<const float4*>(W + (size_t)(e0 + e) * D) + q0 + col)
                    : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  for (int t0 = blockIdx.z * ROUTER_TT; t0 < T; t0 += gridDim.z * ROUTER_TT) {
    const int nt = min(ROUTER_TT, T - t0);
    __syncthreads();                                          // the previous pass no longer reads xs
    for (int i = threadIdx.x; i < nt * slice4; i += blockDim.x) {
      const int t = i / slice4, col = i - t * slice4;
      xs[t][col] = __ldg(reinterpret_cast<const uint2*>(x + (size_t)(t0 + t) * D) + q0 + col);
    }
    __syncthreads();
    for (int t = 0; t < nt; ++t) {
      float acc[EPW];
#pragma unroll
      for (int e = 0; e < EPW; ++e) acc[e] = 0.f;
#pragma unroll
      for (int c = 0; c < ROUTER_CMAX; ++c) {
        const int col = lane + 32 * c;
        if (col >= slice4) break;
        const uint2 xv = xs[t][col];
        const float x0 = __uint_as_float(xv.x << 16), x1 = __uint_as_float(xv.x & 0xffff0000u);
        const float x2 = __uint_as_float(xv.y << 16), x3 = __uint_as_float(xv.y & 0xffff0000u);
#pragma unroll
        for (int e = 0; e < EPW; ++e) {
          float a = acc[e];
          a = fmaf(x0, w[e][c].x, a);
          a = fmaf(x1, w[e][c].y, a);
          a = fmaf(x2, w[e][c].z, a);
          acc[e] = fmaf(x3, w[e][c].w, a);
        }
      }
#pragma unroll
      for (int e = 0; e < EPW; ++e) {
        float v = acc[e];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0 && e0 + e < E) out[(size_t)(t0 + t) * E + e0 + e] = v;
      }
    }
  }
}
