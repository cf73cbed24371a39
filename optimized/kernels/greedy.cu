// Greedy choice per row, torch.argmax(-1) semantics exactly: the first index of the maximum, NaN counting as the
// maximum (the first NaN wins). One block per row; 16-byte loads when the row is 16-byte aligned. torch's reduce
// kernel took 15 us for [17, 4096] bf16 logits in the engine's verify (bench/results/engine_run12/).
#include <cuda_bf16.h>

#define AM_THREADS 256

__device__ __forceinline__ bool better(float a, long long ia, float b, long long ib) {
    const bool na = a != a, nb = b != b;
    if (na || nb) return na && (!nb || ia < ib);
    return a > b || (a == b && ia < ib);
}

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ void argmax_body(const T* __restrict__ x, long long row_stride, int V, int vec,
                                            long long* __restrict__ out) {
    const T* row = x + (long long)blockIdx.x * row_stride;
    float best = __int_as_float(0xff800000);
    long long bi = 0x7fffffffffffffffll;
    constexpr int PER = 16 / sizeof(T);
    if (vec) {                                     // row start 16-byte aligned, V % PER == 0
        const uint4* r4 = reinterpret_cast<const uint4*>(row);
        for (int i = threadIdx.x; i < V / PER; i += AM_THREADS) {
            const uint4 u = __ldg(r4 + i);
            const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
            for (int k = 0; k < PER; ++k) {
                const float v = to_f<T>(e[k]);
                if (better(v, (long long)i * PER + k, best, bi)) { best = v; bi = (long long)i * PER + k; }
            }
        }
    } else {
        for (int i = threadIdx.x; i < V; i += AM_THREADS) {
            const float v = to_f<T>(row[i]);
            if (better(v, i, best, bi)) { best = v; bi = i; }
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float b2 = __shfl_xor_sync(0xffffffffu, best, o);
        const long long i2 = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(b2, i2, best, bi)) { best = b2; bi = i2; }
    }
    __shared__ float sb[AM_THREADS / 32];
    __shared__ long long si[AM_THREADS / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { sb[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < AM_THREADS / 32; ++w)
            if (better(sb[w], si[w], best, bi)) { best = sb[w]; bi = si[w]; }
        out[blockIdx.x] = bi;
    }
}

extern "C" __global__ void __launch_bounds__(AM_THREADS) argmax_bf16(const __nv_bfloat16* __restrict__ x,
                                                                     long long row_stride, int V, int vec,
                                                                     long long* __restrict__ out) {
    argmax_body(x, row_stride, V, vec, out);
}
extern "C" __global__ void __launch_bounds__(AM_THREADS) argmax_f32(const float* __restrict__ x, long long row_stride,
                                                                    int V, int vec, long long* __restrict__ out) {
    argmax_body(x, row_stride, V, vec, out);
}
