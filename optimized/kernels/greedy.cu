// Greedy choice per row, torch.argmax(-1) semantics exactly: the first index of the maximum, NaN counting as the
// maximum (the first NaN wins). Grid (rows, chunks): each block takes one chunk of AM_THREADS * AM_UNROLL 16-byte
// words of one row (every thread's AM_UNROLL loads issued before any compare, when the row is 16-byte aligned), and
// when a row has several chunks, the row's last block (a per-row ticket, zeroed by the caller) reduces their (value,
// index) pairs. `better` is a total order on (value, index) pairs: the result does not depend on the order.
// One block per row took 46 us for one row of K2.6's 163,840 bf16 logits (H100, bench/results/engine_run15/), one SM
// reading 320 KB; torch's reduce kernel took 15 us for [17, 4096] bf16 logits (bench/results/engine_run12/).
#include <cuda_bf16.h>

#define AM_THREADS 256
#define AM_UNROLL 4                                 // 16-byte loads per thread per chunk

__device__ __forceinline__ bool better(float a, long long ia, float b, long long ib) {
    const bool na = a != a, nb = b != b;
    if (na || nb) return na && (!nb || ia < ib);
    return a > b || (a == b && ia < ib);
}

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// Thread 0 ends with the block's best (value, index) of the threads' (best, bi).
__device__ __forceinline__ void block_best(float& best, long long& bi) {
    for (int o = 16; o > 0; o >>= 1) {
        const float b2 = __shfl_xor_sync(0xffffffffu, best, o);
        const long long i2 = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(b2, i2, best, bi)) { best = b2; bi = i2; }
    }
    __shared__ float sb[AM_THREADS / 32];
    __shared__ long long si[AM_THREADS / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();                                // sb / si free (block_best may run twice in one block)
    if (lane == 0) { sb[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < AM_THREADS / 32; ++w)
            if (better(sb[w], si[w], best, bi)) { best = sb[w]; bi = si[w]; }
}

// CHUNK values per block; part_v / part_i [rows, chunks] and ticket [rows] (zero before the call) are used only
// when there are several chunks.
template <typename T>
__device__ __forceinline__ void argmax_body(const T* __restrict__ x, long long row_stride, int V, int vec,
                                            float* __restrict__ part_v, long long* __restrict__ part_i,
                                            unsigned* __restrict__ ticket, long long* __restrict__ out) {
    constexpr int PER = 16 / sizeof(T);
    constexpr int CHUNK = AM_THREADS * AM_UNROLL * PER;
    const int row_id = blockIdx.x, nch = gridDim.y;
    const T* row = x + (long long)row_id * row_stride;
    const int lo = blockIdx.y * CHUNK, hi = min(V, lo + CHUNK);
    float best = __int_as_float(0xff800000);
    long long bi = 0x7fffffffffffffffll;
    if (vec) {                                      // row start 16-byte aligned, V % PER == 0
        const uint4* r4 = reinterpret_cast<const uint4*>(row);
        uint4 u[AM_UNROLL];
#pragma unroll
        for (int j = 0; j < AM_UNROLL; ++j) {       // every load in flight before the first compare
            const int i = lo / PER + j * AM_THREADS + threadIdx.x;
            u[j] = i < hi / PER ? __ldg(r4 + i) : make_uint4(0u, 0u, 0u, 0u);      // past the end: not compared
        }
#pragma unroll
        for (int j = 0; j < AM_UNROLL; ++j) {
            const int i = lo / PER + j * AM_THREADS + threadIdx.x;
            if (i >= hi / PER) continue;
            const T* e = reinterpret_cast<const T*>(&u[j]);
#pragma unroll
            for (int k = 0; k < PER; ++k) {
                const float v = to_f<T>(e[k]);
                if (better(v, (long long)i * PER + k, best, bi)) { best = v; bi = (long long)i * PER + k; }
            }
        }
    } else {
        for (int i = lo + threadIdx.x; i < hi; i += AM_THREADS) {
            const float v = to_f<T>(row[i]);
            if (better(v, i, best, bi)) { best = v; bi = i; }
        }
    }
    block_best(best, bi);
    if (nch == 1) {
        if (threadIdx.x == 0) out[row_id] = bi;
        return;
    }
    __shared__ int last;
    if (threadIdx.x == 0) {
        part_v[(long long)row_id * nch + blockIdx.y] = best;
        part_i[(long long)row_id * nch + blockIdx.y] = bi;
        __threadfence();                            // the partial is visible before the ticket counts it
        last = atomicAdd(ticket + row_id, 1u) == (unsigned)(nch - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    best = __int_as_float(0xff800000);
    bi = 0x7fffffffffffffffll;
    for (int c = threadIdx.x; c < nch; c += AM_THREADS) {
        const float v = __ldcg(part_v + (long long)row_id * nch + c);     // L2: written by other blocks
        const long long i = __ldcg(part_i + (long long)row_id * nch + c);
        if (better(v, i, best, bi)) { best = v; bi = i; }
    }
    block_best(best, bi);
    if (threadIdx.x == 0) out[row_id] = bi;
}

extern "C" __global__ void __launch_bounds__(AM_THREADS) argmax_bf16(const __nv_bfloat16* __restrict__ x,
        long long row_stride, int V, int vec, float* __restrict__ part_v, long long* __restrict__ part_i,
        unsigned* __restrict__ ticket, long long* __restrict__ out) {
    argmax_body(x, row_stride, V, vec, part_v, part_i, ticket, out);
}
extern "C" __global__ void __launch_bounds__(AM_THREADS) argmax_f32(const float* __restrict__ x,
        long long row_stride, int V, int vec, float* __restrict__ part_v, long long* __restrict__ part_i,
        unsigned* __restrict__ ticket, long long* __restrict__ out) {
    argmax_body(x, row_stride, V, vec, part_v, part_i, ticket, out);
}
