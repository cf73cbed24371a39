// The DFlash drafter's per-layer steps in few launches (optimized/draft_ops.py). The drafter's forward is tiny and
// launch-bound in the engine: its attention alone was ~10 PyTorch launches a layer (einsum copies, fp32 cast,
// scale, mask, softmax, bf16 cast, the P.V einsum), its q/k norm + RoPE + cache writes another 6.
//
//   head_norm_rope  RMSNorm over each head's E values, then NeoX RoPE (reference.drafter.DraftAttention: q_norm
//                   / k_norm, apply_rope(interleave=False)), a warp per (row, head). With slots it writes the keys
//                   straight into the context cache rows (and copies the value heads beside them): the drafter's
//                   keys_values + the engine's cache write, for one layer or for every layer at once (commit).
//                   Rounding steps as reference.target.RMSNorm / apply_rope (the RMSNorm sum is a warp tree sum:
//                   last-bit differences before rounding, as optimized/kernels/norm_rope.cu).
//   draft_attention softmax(q k^T * scale) v over the visible keys s < start[r] + blk of the context cache (the
//                   committed rows plus the block's own rows, written there first): no mask, non-causal, as the
//                   reference's [context; block] attention. A block per (request, kv head, block row, key split)
//                   serves the `rep` query heads of that kv head (grouped-query heads share the key loads); fp32
//                   online softmax. Scores are rounded to bf16 before the scale as the reference's bf16 einsum does;
//                   P.V accumulates in fp32 (the reference rounds P to bf16 first): a tolerance, not bit equality.
//   draft_attention_merge  the log-sum-exp merge of the key splits (only when a call uses more than one).
//   silu_mul        bf16(bf16(silu(g)) * u) for the MLP's gate|up output (reference: F.silu(gate) * up).
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float r16(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ float bf_lo(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(unsigned u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#define HNR_WARPS 4
#define HNR_MAXE 256

// Warp gw < rows * layers * heads_all, heads_all = heads (+ heads when copying values): row r, layer l, head j.
// Input head j (< heads) at x + r * row_stride + l * layer_in + j * head_stride; value head j at the same place
// + v_off. Output: slots == nullptr -> out + ((r * layers + l) * heads + j) * E (contiguous [rows, heads, E] for
// one layer); else out + l * layer_out + (slots[r] * heads + j) * E, values into out_v the same way.
// w: the norm weights [layers, E]; cos/sin float32 [rows, E/2].
extern "C" __global__ void __launch_bounds__(HNR_WARPS * 32) head_norm_rope(
    const bf16* __restrict__ x, long long row_stride, long long layer_in, long long head_stride, long long v_off,
    int rows, int layers, int heads, int copy_values, int E, const bf16* __restrict__ w, float eps,
    const float* __restrict__ cosv, const float* __restrict__ sinv, const long long* __restrict__ slots,
    bf16* __restrict__ out, bf16* __restrict__ out_v, long long layer_out) {
    __shared__ float sh[HNR_WARPS][HNR_MAXE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int heads_all = heads * (copy_values ? 2 : 1);
    const long long gw = (long long)blockIdx.x * HNR_WARPS + warp;
    if (gw >= (long long)rows * layers * heads_all) return;      // warp-uniform
    const int j = (int)(gw % heads_all);
    const int l = (int)((gw / heads_all) % layers);
    const long long r = gw / ((long long)heads_all * layers);
    const bool value = j >= heads;
    const int h = value ? j - heads : j;
    const bf16* xr = x + r * row_stride + l * layer_in + (long long)h * head_stride + (value ? v_off : 0);
    long long orow;
    if (slots == nullptr) orow = ((r * layers + l) * heads + h) * E;
    else orow = l * layer_out + (__ldg(slots + r) * heads + h) * E;
    if (value) {                                                 // the value head: copied as it is
        for (int c = lane; c < E; c += 32) out_v[orow + c] = xr[c];
        return;
    }
    float v[HNR_MAXE / 32];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < HNR_MAXE / 32; ++i) {
        const int c = lane + 32 * i;
        v[i] = c < E ? __bfloat162float(xr[c]) : 0.f;
        ss += v[i] * v[i];
    }
    const float rs = rsqrtf(warp_sum(ss) / (float)E + eps);
    const bf16* wl = w + (long long)l * E;
#pragma unroll
    for (int i = 0; i < HNR_MAXE / 32; ++i) {
        const int c = lane + 32 * i;
        if (c < E) sh[warp][c] = r16(__bfloat162float(wl[c]) * r16(v[i] * rs));   // RMSNorm's output, bf16
    }
    __syncwarp();
    const int half = E >> 1;
    const float* cr = cosv + r * half;
    const float* sr = sinv + r * half;
    bf16* o = out + orow;
#pragma unroll
    for (int i = 0; i < HNR_MAXE / 32; ++i) {
        const int c = lane + 32 * i;
        if (c >= E) continue;
        const int p = c < half ? c : c - half;                   // NeoX halves: (x[p], x[p + E/2])
        const float x1 = sh[warp][p], x2 = sh[warp][p + half];
        const float cs = r16(cr[p]), sn = r16(sr[p]);
        o[c] = __float2bfloat16(c < half ? r16(x1 * cs) - r16(x2 * sn) : r16(x2 * cs) + r16(x1 * sn));
    }
}

#define DA_WARPS 4   // draft_attention's block. Its launch bounds ask for 2 blocks an SM: with the block size alone,
                     // NVRTC 13.0's ptxas capped the variants at 128 registers and spilled (r2_c2 on sm_90, r8_c4 on
                     // sm_120); with (128, 2) none spills under NVRTC 13.0 or 13.5

// grid (splits, B, n * G), DA_WARPS warps. q [n * B, G * rep, E] contiguous; the cache rows of request r at
// k + r * req_stride + s * G * E + g * E (same for v); out [n * B, G * rep, E] (splits == 1) or the split partials
// part_o [n * G * B, splits, rep, E], part_ml [n * G * B, splits, rep, 2] (unnormalized sums, max and sum in the
// log2 domain).
template <int REP, int CS>   // REP >= rep query heads per kv head; E <= 32 * CS
__device__ __forceinline__ void draft_attention_body(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, bf16* __restrict__ out,
    float* __restrict__ part_o, float* __restrict__ part_ml, const long long* __restrict__ start, int blk, int B,
    int G, int rep, int E, long long req_stride, int keys_per_split, int max_keys, float scale_log2) {
    extern __shared__ float dsm[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int split = blockIdx.x, b = blockIdx.y, r = blockIdx.z / G, g = blockIdx.z % G, splits = gridDim.x;
    const int len = (int)min((long long)max_keys, __ldg(start + r) + blk);
    const int k_lo = split * keys_per_split, k_hi = min(len, k_lo + keys_per_split);
    float* sq = dsm;                                  // [REP][E] the query heads, fp32
    float* so = sq + REP * E;                         // [DA_WARPS][REP][E] each warp's unnormalized output
    float* sml = so + DA_WARPS * REP * E;             // [DA_WARPS][REP][2] running max, sum
    const long long qrow = ((long long)(r * B + b) * G + g) * rep;           // first query head row of the group
    for (int i = threadIdx.x; i < REP * E; i += DA_WARPS * 32) {
        const int h = i / E;
        sq[i] = h < rep ? __bfloat162float(q[(qrow + h) * E + i % E]) : 0.f;
    }
    __syncthreads();
    const bf16* kb = k + r * req_stride + (long long)g * E;
    const bf16* vb = v + r * req_stride + (long long)g * E;
    const long long ks = (long long)G * E;
    const bool vec = (E & 7) == 0;
    float m_run[REP], l_run[REP], o[REP][CS];
#pragma unroll
    for (int h = 0; h < REP; ++h) {
        m_run[h] = neg_inf();
        l_run[h] = 0.f;
#pragma unroll
        for (int i = 0; i < CS; ++i) o[h][i] = 0.f;
    }
    for (int k0 = k_lo + warp * 32; k0 < k_hi; k0 += DA_WARPS * 32) {
        const int s = k0 + lane;
        const bool vis = s < k_hi;
        float x[REP];
#pragma unroll
        for (int h = 0; h < REP; ++h) x[h] = 0.f;
        const bf16* kr = kb + (long long)min(s, k_hi - 1) * ks;
        if (vec) {
            for (int c = 0; c < E; c += 8) {
                const uint4 u = __ldg(reinterpret_cast<const uint4*>(kr + c));
                const float kf[8] = {bf_lo(u.x), bf_hi(u.x), bf_lo(u.y), bf_hi(u.y),
                                     bf_lo(u.z), bf_hi(u.z), bf_lo(u.w), bf_hi(u.w)};
#pragma unroll
                for (int h = 0; h < REP; ++h) {
                    const float4 qa = *reinterpret_cast<const float4*>(sq + h * E + c);
                    const float4 qb = *reinterpret_cast<const float4*>(sq + h * E + c + 4);
                    x[h] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] +
                            qb.x * kf[4] + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                }
            }
        } else {
            for (int c = 0; c < E; ++c) {
                const float kf = __bfloat162float(kr[c]);
#pragma unroll
                for (int h = 0; h < REP; ++h) x[h] += sq[h * E + c] * kf;
            }
        }
        float p[REP];
#pragma unroll
        for (int h = 0; h < REP; ++h) {
            const float xs = vis ? r16(x[h]) * scale_log2 : neg_inf();   // the reference's bf16 score, scaled
            const float mn = fmaxf(m_run[h], warp_max(xs));                 // finite: lane 0's key is visible
            const float alpha = exp2f(m_run[h] - mn);                       // 0 while m_run is -inf
            p[h] = vis ? exp2f(xs - mn) : 0.f;
            l_run[h] = l_run[h] * alpha + warp_sum(p[h]);
            m_run[h] = mn;
#pragma unroll
            for (int i = 0; i < CS; ++i) o[h][i] *= alpha;
        }
        const int nk = min(32, k_hi - k0);
        for (int jj = 0; jj < nk; ++jj) {
            const bf16* vr = vb + (long long)(k0 + jj) * ks;
            float vv[CS];
#pragma unroll
            for (int i = 0; i < CS; ++i) {
                const int c = lane + 32 * i;
                vv[i] = c < E ? __bfloat162float(vr[c]) : 0.f;
            }
#pragma unroll
            for (int h = 0; h < REP; ++h) {
                const float pj = __shfl_sync(0xffffffffu, p[h], jj);
#pragma unroll
                for (int i = 0; i < CS; ++i) o[h][i] += pj * vv[i];
            }
        }
    }
#pragma unroll
    for (int h = 0; h < REP; ++h) {
#pragma unroll
        for (int i = 0; i < CS; ++i) {
            const int c = lane + 32 * i;
            if (c < E) so[(warp * REP + h) * E + c] = o[h][i];
        }
        if (lane == 0) {
            sml[(warp * REP + h) * 2] = m_run[h];
            sml[(warp * REP + h) * 2 + 1] = l_run[h];
        }
    }
    __syncthreads();
    const long long grp = (long long)blockIdx.z * B + b;                  // (request, kv head, block row)
    for (int i = threadIdx.x; i < rep * E; i += DA_WARPS * 32) {
        const int h = i / E, c = i % E;
        float mx = neg_inf();
#pragma unroll
        for (int w = 0; w < DA_WARPS; ++w) mx = fmaxf(mx, sml[(w * REP + h) * 2]);
        float acc = 0.f, l = 0.f;
#pragma unroll
        for (int w = 0; w < DA_WARPS; ++w) {
            const float wt = mx == neg_inf() ? 0.f : exp2f(sml[(w * REP + h) * 2] - mx);
            acc += so[(w * REP + h) * E + c] * wt;
            l += sml[(w * REP + h) * 2 + 1] * wt;
        }
        if (splits == 1) {
            out[(qrow + h) * E + c] = __float2bfloat16(l > 0.f ? acc / l : 0.f);
        } else {
            part_o[((grp * splits + split) * rep + h) * E + c] = acc;
            if (c == 0) {
                part_ml[((grp * splits + split) * rep + h) * 2] = mx;
                part_ml[((grp * splits + split) * rep + h) * 2 + 1] = l;
            }
        }
    }
}

#define DRAFT_ATTENTION(REP, CS)                                                                                 \
    extern "C" __global__ void __launch_bounds__(DA_WARPS * 32, 2) draft_attention_r##REP##_c##CS(              \
        const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, bf16* __restrict__ out, \
        float* __restrict__ part_o, float* __restrict__ part_ml, const long long* __restrict__ start, int blk,    \
        int B, int G, int rep, int E, long long req_stride, int keys_per_split, int max_keys, float scale_log2) { \
        draft_attention_body<REP, CS>(q, k, v, out, part_o, part_ml, start, blk, B, G, rep, E, req_stride,        \
                                      keys_per_split, max_keys, scale_log2);                                     \
    }
DRAFT_ATTENTION(1, 2)
DRAFT_ATTENTION(2, 2)
DRAFT_ATTENTION(4, 2)
DRAFT_ATTENTION(1, 4)
DRAFT_ATTENTION(2, 4)
DRAFT_ATTENTION(4, 4)
DRAFT_ATTENTION(8, 4)
DRAFT_ATTENTION(1, 8)
DRAFT_ATTENTION(2, 8)
DRAFT_ATTENTION(4, 8)

// grid n * G * B blocks (blockIdx.x = (r * G + g) * B + b), DA_WARPS warps: out row = the group's rep heads.
extern "C" __global__ void __launch_bounds__(DA_WARPS * 32) draft_attention_merge(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, bf16* __restrict__ out, int splits, int B,
    int G, int rep, int E) {
    const long long grp = blockIdx.x;
    const int b = (int)(grp % B), g = (int)((grp / B) % G), r = (int)(grp / ((long long)B * G));
    const long long qrow = ((long long)(r * B + b) * G + g) * rep;
    for (int i = threadIdx.x; i < rep * E; i += DA_WARPS * 32) {
        const int h = i / E, c = i % E;
        float mx = neg_inf();
        for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part_ml[((grp * splits + s) * rep + h) * 2]);
        float acc = 0.f, l = 0.f;
        for (int s = 0; s < splits; ++s) {
            const float m = part_ml[((grp * splits + s) * rep + h) * 2];
            const float wt = mx == neg_inf() || m == neg_inf() ? 0.f : exp2f(m - mx);
            acc += part_o[((grp * splits + s) * rep + h) * E + c] * wt;
            l += part_ml[((grp * splits + s) * rep + h) * 2 + 1] * wt;
        }
        out[(qrow + h) * E + c] = __float2bfloat16(l > 0.f ? acc / l : 0.f);
    }
}

// out [rows, F] = bf16(bf16(silu(gate)) * up), gate = gu[r, :F], up = gu[r, F:2F] (row stride 2F).
extern "C" __global__ void silu_mul(const bf16* __restrict__ gu, long long rows, int F, bf16* __restrict__ out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * F) return;
    const long long r = i / F;
    const int c = (int)(i % F);
    const float g = __bfloat162float(gu[r * 2 * F + c]), u = __bfloat162float(gu[r * 2 * F + F + c]);
    out[i] = __float2bfloat16(r16(g / (1.f + expf(-g))) * u);
}

// The rows start[r] .. start[r] + m - 1 of requests r < n (the drafter's block, or commit's context rows): their
// flat cache slots (pos + offs[r]) and RoPE angles, as reference.target.rope_cos_sin: cos/sin float32 [n * m, half]
// = cos/sin(float(pos) * inv_freq[k]) * amplitude (the same fp32 steps, so the same bits). A thread per (row, k).
extern "C" __global__ void rows_rope(const long long* __restrict__ start, const long long* __restrict__ offs, int n,
                                     int m, const float* __restrict__ inv_freq, int half, float amplitude,
                                     long long* __restrict__ slots, float* __restrict__ cosv,
                                     float* __restrict__ sinv) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * m * half) return;
    const long long row = i / half;
    const int k = (int)(i % half), r = (int)(row / m);
    const long long pos = __ldg(start + r) + row % m;
    if (k == 0) slots[row] = pos + __ldg(offs + r);
    const float a = (float)pos * __ldg(inv_freq + k);
    cosv[i] = cosf(a) * amplitude;
    sinv[i] = sinf(a) * amplitude;
}
