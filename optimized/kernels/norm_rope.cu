// RMSNorm and RoPE in one launch each (optimized/norm_rope.py). The reference forms them from 7-10 small
// PyTorch kernels each; in the tiny, launch-bound engine those launches were over half of a drafter forward.
// Both reproduce the reference's rounding steps on bf16 tensors:
//   rms_norm: y = bf16(x * rsqrt(mean(x^2) + eps)) in fp32, out = bf16(w * y)      (reference.target.RMSNorm)
//   rope:     c, s = bf16(cos), bf16(sin); out1 = bf16(bf16(x1 c) - bf16(x2 s)), out2 = bf16(bf16(x2 c) +
//             bf16(x1 s)) with (x1, x2) interleaved pairs or NeoX halves          (reference.target.apply_rope)
// The RMSNorm mean is a tree sum in fp32 (PyTorch's order differs: last-bit differences before rounding).
#include <cuda_bf16.h>

__device__ __forceinline__ float r16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// One block per row. x rows at x + row * x_stride (elements), out contiguous [rows, d].
extern "C" __global__ void rms_norm_bf16(const __nv_bfloat16* __restrict__ x, long long x_stride,
                                        const __nv_bfloat16* __restrict__ w, float eps, int d,
                                        __nv_bfloat16* __restrict__ out) {
    const __nv_bfloat16* xr = x + (long long)blockIdx.x * x_stride;
    __nv_bfloat16* orow = out + (long long)blockIdx.x * d;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = __bfloat162float(xr[i]);
        ss += v * v;
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    __shared__ float part[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    if (warps > 1) {
        if (lane == 0) part[warp] = ss;
        __syncthreads();
        ss = lane < warps ? part[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    }
    const float r = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float y = r16(__bfloat162float(xr[i]) * r);
        orow[i] = __float2bfloat16(__bfloat162float(w[i]) * y);
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
