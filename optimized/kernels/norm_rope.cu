// RMSNorm and RoPE in one launch each (optimized/norm_rope.py). The reference forms them from 7-10 small
// PyTorch kernels each; in the tiny, launch-bound engine those launches were over half of a drafter forward.
// Both reproduce the reference's rounding steps on bf16 tensors:
//   rms_norm: y = bf16(x * rsqrt(mean(x^2) + eps)) in fp32, out = bf16(w * y)      (reference.target.RMSNorm)
//   rope:     c, s = bf16(cos), bf16(sin); out1 = bf16(bf16(x1 c) - bf16(x2 s)), out2 = bf16(bf16(x2 c) +
//             bf16(x1 s)) with (x1, x2) interleaved pairs or NeoX halves          (reference.target.apply_rope)
// The RMSNorm mean is a tree sum in fp32 (PyTorch's order differs: last-bit differences before rounding).
#include <cuda_bf16.h>

__device__ __forceinline__ float r16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// Sum of one float per thread over the block (blockDim a multiple of 32, at most 1024), on every thread.
__device__ __forceinline__ float block_sum(float ss) {
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    __shared__ float part[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    if (warps > 1) {
        if (lane == 0) part[warp] = ss;
        __syncthreads();
        ss = lane < warps ? part[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    }
    return ss;
}

// Row r of x (one block each) at x + (r / per) * x_stride + (r % per) * x_stride1: rows of a [a, per, d] view with
// two strides (a head split of a fused projection's output), or of a [rows, d] one with per = 1.
__device__ __forceinline__ long long row_offset(long long x_stride, long long x_stride1, int per) {
    return (long long)(blockIdx.x / per) * x_stride + (long long)(blockIdx.x % per) * x_stride1;
}

// Generic path, any layout: one block per row (strides in elements), out contiguous [rows, d].
extern "C" __global__ void rms_norm_bf16(const __nv_bfloat16* __restrict__ x, long long x_stride, long long x_stride1,
                                        int per, const __nv_bfloat16* __restrict__ w, float eps, int d,
                                        __nv_bfloat16* __restrict__ out) {
    const __nv_bfloat16* xr = x + row_offset(x_stride, x_stride1, per);
    __nv_bfloat16* orow = out + (long long)blockIdx.x * d;
    float ss = 0.f;
#pragma unroll 8
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = __bfloat162float(xr[i]);
        ss += v * v;
    }
    const float r = rsqrtf(block_sum(ss) / (float)d + eps);
#pragma unroll 4
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float y = r16(__bfloat162float(xr[i]) * r);
        orow[i] = __float2bfloat16(__bfloat162float(w[i]) * y);
    }
}

// 16-byte path (x, its row stride, d, w and out all multiples of 8 elements / 16 bytes; d <= 8 * NORM_NV *
// 1024): thread i holds the row's 8-value vectors i, i + blockDim, ... (at most NORM_NV) in registers, so every
// load of the row is in flight at once and x is read once. The generic kernel's loop waits for each load in turn:
// 28 dependent global loads per thread at d = 7168, 10-13 us per call on the H200 (bench/engine_profile.py).
#define NORM_NV 4
__device__ __forceinline__ float bf_lo(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(unsigned u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ unsigned bf2(float lo, float hi) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16(lo)) |
           ((unsigned)__bfloat16_as_ushort(__float2bfloat16(hi)) << 16);
}

extern "C" __global__ void rms_norm_bf16_v8(const uint4* __restrict__ x, long long x_stride8, long long x_stride1_8,
                                           int per, const uint4* __restrict__ w, float eps, int d,
                                           uint4* __restrict__ out) {
    const int nv = d >> 3;
    const uint4* xr = x + row_offset(x_stride8, x_stride1_8, per);    // strides in 16-B vectors
    uint4* orow = out + (long long)blockIdx.x * nv;
    uint4 v[NORM_NV];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_NV; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        v[j] = i < nv ? __ldg(xr + i) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < NORM_NV; ++j) {
        const unsigned u[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float a = bf_lo(u[k]), b = bf_hi(u[k]);
            ss += a * a;
            ss += b * b;
        }
    }
    const float r = rsqrtf(block_sum(ss) / (float)d + eps);
#pragma unroll
    for (int j = 0; j < NORM_NV; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i >= nv) continue;
        const uint4 wv = __ldg(w + i);
        const unsigned u[4] = {v[j].x, v[j].y, v[j].z, v[j].w}, q[4] = {wv.x, wv.y, wv.z, wv.w};
        unsigned o[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            o[k] = bf2(bf_lo(q[k]) * r16(bf_lo(u[k]) * r), bf_hi(q[k]) * r16(bf_hi(u[k]) * r));
        orow[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// One thread per rotated pair. x rows (t, j) at x + t * t_stride + j * j_stride, j < per_t; out contiguous
// [T, per_t, R]; cos/sin float32 [T, R/2] (row t holds the angles of that row's position).
extern "C" __global__ void rope_bf16(const __nv_bfloat16* __restrict__ x, long long t_stride, long long j_stride,
                                    int per_t, int rot, int interleave, const float* __restrict__ cosv,
                                    const float* __restrict__ sinv, long long pairs,
                                    __nv_bfloat16* __restrict__ out) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= pairs) return;
    const int half = rot >> 1;
    const int i = (int)(k % half);
    const long long row = k / half;
    const long long t = row / per_t;
    const int j = (int)(row % per_t);
    const __nv_bfloat16* xr = x + t * t_stride + j * j_stride;
    __nv_bfloat16* orow = out + row * rot;
    const int i1 = interleave ? 2 * i : i, i2 = interleave ? 2 * i + 1 : i + half;
    const float x1 = __bfloat162float(xr[i1]), x2 = __bfloat162float(xr[i2]);
    const float c = r16(cosv[t * half + i]), s = r16(sinv[t * half + i]);
    orow[i1] = __float2bfloat16(r16(x1 * c) - r16(x2 * s));
    orow[i2] = __float2bfloat16(r16(x2 * c) + r16(x1 * s));
}

// The target's latent row for the cache, in one launch (optimized/norm_rope.py latent_rows): row t of kv [T, C+R]
// (stride kv_stride elements) -> latent[slots[t]] (rows of C+R) = cat(RMSNorm_w(kv[:C]), RoPE(kv[C:])), i.e.
// reference Attention.project's `torch.cat([kv_a_layernorm(ckv), k_pe], -1)` then the cache write. One warp per row.
// The norm repeats rms_norm_bf16_v8's arithmetic at one warp (C % 8 == 0, C <= 1024: lane l sums the squares of
// elements 8v..8v+7 in order for v = l, l + 32, ..., then the xor butterfly), so its bits equal rms_norm's; the
// rotation is rope_bf16's (bit-exact against the reference).
extern "C" __global__ void __launch_bounds__(32) latent_rows_bf16(
    const __nv_bfloat16* __restrict__ kv, long long kv_stride, int c, int rot, const __nv_bfloat16* __restrict__ w,
    float eps, int interleave, const float* __restrict__ cosv, const float* __restrict__ sinv,
    const long long* __restrict__ slots, __nv_bfloat16* __restrict__ latent) {
    const int t = blockIdx.x, lane = threadIdx.x;
    const __nv_bfloat16* xr = kv + (long long)t * kv_stride;
    __nv_bfloat16* orow = latent + slots[t] * (long long)(c + rot);
    float ss = 0.f;
    for (int v = lane; 8 * v < c; v += 32) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float a = __bfloat162float(xr[8 * v + e]);
            ss += a * a;
        }
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float r = rsqrtf(ss / (float)c + eps);
    for (int i = lane; i < c; i += 32)
        orow[i] = __float2bfloat16(__bfloat162float(w[i]) * r16(__bfloat162float(xr[i]) * r));
    const int half = rot >> 1;
    for (int i = lane; i < half; i += 32) {
        const int i1 = c + (interleave ? 2 * i : i), i2 = c + (interleave ? 2 * i + 1 : i + half);
        const float x1 = __bfloat162float(xr[i1]), x2 = __bfloat162float(xr[i2]);
        const float cs = r16(cosv[t * half + i]), sn = r16(sinv[t * half + i]);
        orow[i1] = __float2bfloat16(r16(x1 * cs) - r16(x2 * sn));
        orow[i2] = __float2bfloat16(r16(x2 * cs) + r16(x1 * sn));
    }
}
