// Tree-masked MLA attention over the latent cache (absorbed form, the verify-attention core).
//
//   o_lat[t, h, :] = softmax_s( scale * (q_lat[t,h,:] . kv[s,:] + q_pe[t,h,:] . k_pe[s,:]) | visible ) @ kv[s, :]
//
// Shapes (row-major, contiguous, bf16 unless said):
//   q_lat [T, H, C]   q_pe [T, H, R]   latent [S, C+R] with S = P + T (the T tree rows are slots P..S-1)
//   tree_mask int32 [T, W], W = ceil(T/32): key slot P+j is visible to row t iff bit j%32 of word [t, j/32];
//   every prefix slot (< P) is visible to every row.   out [T, H, C] bf16.
// Query rows are flattened: m = t*H + h, M = T*H. All heads share one latent row, so the kernel is a GEMM
// with M = T*H query rows against one shared K (576 wide) / V (the first 512 of the same rows).
//
// Kernels
//   mla_mma_<cfg>   tensor cores (mma.sync m16n8k16 bf16 -> fp32; sm_80+, so sm_90 and sm_120), C=512, R=64.
//   mla_wgmma_pair  wgmma (sm_90a, H100/H200), key tiles in pairs across the two warpgroups: the default on 9.0.
//   mla_wgmma_m64_n64  wgmma, one key tile at a time (kept as a config, for A/B).
//   mla_combine     log-sum-exp merge of the split-KV partials.
//   mla_generic_c*  fp32 SIMT, any C <= 1024, R <= 256 (tiny fixtures): a block per query row, a lane per key.
//
// mla_mma launch geometry (config w8_m64_n64_s2, the H100/H200 one; w4_m32_n32_s1 fits 99 KB parts):
//   grid (ceil(M/BM), splits), block NW*32 threads, 1 block/SM. blockIdx.x (row tile) varies fastest so
//   the blocks resident together read the same key chunk (L2 reuse across row tiles).
//   Block (rt, sp): rows [rt*BM, +BM), keys [sp*chunk, min(S, (sp+1)*chunk)), chunk a multiple of BN.
//   smem: Q tile BM x 576 (resident), K/V tiles STAGES x BN x 576 (cp.async, one tile in flight), P BM x BN.
//   Rows of 1152 B are XOR-swizzled in 16-B chunks so ldmatrix rows hit distinct banks.
//   Per key tile:
//     S = Q K^T    warp (rg, kh): rows rg*16..+16, keys kh*KW..+KW, 36 k-steps over 576 channels
//     online softmax in the exp2 domain; the KH warps of a row group exchange row maxima (named barrier)
//     P (bf16) -> smem; alpha (rescale) -> smem
//     O += P V     warp w: all BM rows x output columns w*CW..+CW (V = first 512 channels of the K tile,
//                  ldmatrix.trans), accumulators in registers (BM*512/NW/32 = 128 fp32 per thread)
//   splits == 1: out = O / l in bf16.  splits > 1: fp32 O/l and lse = m + log2 l per split -> mla_combine.
//
// Napkin math (K2.6: H=64, C=512, R=64; per visible (query row, key) pair: 2*576 + 2*512 = 2176 flop):
//   bytes = S*1152 (latent, read once) + T*H*(576+512)*2 (q, out) + T*W*4 (mask)
//   flops = 2176 * H * sum_t (P + visible tree rows of t)
//   FLOP/byte at T=1: 2176*64/1152 = 121 < ridge 787/4.24 = 186 -> decode is bandwidth-bound on paper
//   (floor at P=128k: 151 MB / 4.24 TB/s = 36 us); T >= 2 is compute-bound (T=65, P=32k: 0.29 TFLOP,
//   floor 0.37 ms at 787 TFLOP/s).
//   Expected bound of this kernel: shared-memory bandwidth and mma.sync issue. Per 64x64 tile the block
//   reads ~573 KB through ldmatrix (Q is re-read for every key tile: the O accumulator takes the
//   registers that would hold it) against 8.9 MFLOP: at 128 B/clk/SM that caps it near 520 TFLOP/s, and
//   mma.sync on Hopper issues at roughly 60-65% of the wgmma rate, so expect ~250-350 TFLOP/s at
//   T >= 9; reaching the 787 ceiling needs a wgmma (sm_90a) variant.
//   Measured (H200, bench/results/mla_attention.md): 245-253 TFLOP/s at T >= 33 and prefix >= 32k
//   (3.1-3.2x the compute floor); T=1 P=128k 118 us (3.3x the bandwidth floor); notes in mla_notes.md.

typedef unsigned short bf16_t;   // raw bf16 bits; no cuda_bf16.h needed (NVRTC and nvcc alike)

// Variants (-D from the launcher's `defines`; the defaults are the measured best, see bench/results/mla_notes.md)
#ifndef MLA_SKIP_RESCALE
#define MLA_SKIP_RESCALE 1       // skip O *= alpha when every alpha of the warp is 1 (row maxima unchanged)
#endif
#ifndef MLA_FAST_EXP2
#define MLA_FAST_EXP2 1          // ex2.approx.ftz instead of exp2f in the online softmax
#endif
#ifndef MLA_QK_UNROLL
#define MLA_QK_UNROLL 9          // 128-B channel groups of the QK loop unrolled (9 = all 36 k-steps)
#endif

#define MLA_C 512
#define MLA_R 64
#define MLA_L 576
#define MLA_ROW_CHUNKS 72        // 16-byte chunks per 576-value row
#define MLA_ROW_BYTES 1152

// ---- small PTX helpers ------------------------------------------------------------------------------

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float softmax_exp2(float x) {
#if MLA_FAST_EXP2
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));   // ex2(-inf) = +0
    return y;
#else
    return exp2f(x);
#endif
}

// Online-softmax step of one row: the running max takes the tile max; returns alpha (the rescale of the running
// sums, applied to l_run here) and sets mu, the exponent offset (0 for a row that has seen no key yet).
__device__ __forceinline__ float online_step(float& m_run, float& l_run, float tile_max, float& mu) {
    const float mn = fmaxf(m_run, tile_max);
    mu = mn == neg_inf() ? 0.f : mn;
    const float alpha = softmax_exp2(m_run - mu);
    m_run = mn;
    l_run *= alpha;
    return alpha;
}

// Row max / row sum over the quad of lanes (lane & 3) that holds one accumulator row of an MMA fragment.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Graph mode (seq_len given): S = P + T read on the device, the key range re-split over gridDim.y tiles of BN.
template <int BN>
__device__ __forceinline__ void graph_shape(const int* __restrict__ seq_len, int T, int& S, int& P, int& chunk_keys) {
    if (seq_len == nullptr) return;
    S = __ldg(seq_len);
    P = S - T;
    chunk_keys = ((S + BN - 1) / BN + (int)gridDim.y - 1) / (int)gridDim.y * BN;
}

__device__ __forceinline__ float bf16_to_float(bf16_t v) { return __uint_as_float(((unsigned)v) << 16); }

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));   // a -> upper half, b -> lower
    return r;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    // src_bytes = 0 fills the 16 bytes with zeros (rows past the end: keeps NaN garbage out of P*V)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// D (+)= A (16x16 bf16, row) * B (16x8 bf16, col), fp32 accumulate
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// Byte offset of 16-B chunk c of row r in a tile of 576-value rows (1152 B = 9 x 128 B, so every row starts
// on bank 0): XOR the low 3 chunk bits with the row, so 8 consecutive rows at one logical chunk land in 8
// distinct 16-B bank groups.
__device__ __forceinline__ unsigned row_off(int r, int c) {
    return (unsigned)(r * MLA_ROW_BYTES + ((((c & ~7) | ((c ^ r) & 7))) << 4));
}

// cp.async of a Q tile (`rows` query rows from row0: 16-B chunks 0..63 from q_lat, 64..71 from q_pe; rows past M
// zero-filled) and of a K tile (`rows` latent rows from key k0; rows past key_end zero-filled, which keeps NaN
// garbage out of P*V), threads t_begin, t_begin + t_step, ...; OFF places chunk c of row r in the smem tile.
template <unsigned (*OFF)(int, int)>
__device__ __forceinline__ void load_q_rows(unsigned dst, const bf16_t* __restrict__ q_lat,
                                            const bf16_t* __restrict__ q_pe, int rows, int row0, int M, int t_begin,
                                            int t_step) {
    for (int i = t_begin; i < rows * MLA_ROW_CHUNKS; i += t_step) {
        const int r = i / MLA_ROW_CHUNKS, c = i - r * MLA_ROW_CHUNKS, m = row0 + r;
        const bool ok = m < M;
        const bf16_t* src = !ok ? q_lat : (c < 64 ? q_lat + (long long)m * MLA_C + c * 8
                                                   : q_pe + (long long)m * MLA_R + (c - 64) * 8);
        cp_async16(dst + OFF(r, c), src, ok ? 16 : 0);
    }
}
template <unsigned (*OFF)(int, int)>
__device__ __forceinline__ void load_key_rows(unsigned dst, const bf16_t* __restrict__ latent, int rows, int k0,
                                              int key_end, int t_begin, int t_step) {
    for (int i = t_begin; i < rows * MLA_ROW_CHUNKS; i += t_step) {
        const int r = i / MLA_ROW_CHUNKS, c = i - r * MLA_ROW_CHUNKS, key = k0 + r;
        const bool ok = key < key_end;
        cp_async16(dst + OFF(r, c), ok ? latent + (long long)key * MLA_L + c * 8 : latent, ok ? 16 : 0);
    }
}

// Visibility of key slot `key` to tree row t: whole prefix, then the packed ancestor bits.
__device__ __forceinline__ bool key_visible(const unsigned* __restrict__ mask, int words, int t, int key, int P,
                                            int key_end) {
    if (key >= key_end) return false;
    if (key < P) return true;
    const int j = key - P;
    return (__ldg(mask + t * words + (j >> 5)) >> (j & 31)) & 1u;
}

// key_visible for the 64 keys key0 .. key0+63 of query row t at once, bit k for key0 + k: three word loads and
// shifts, no branch per key (a branch per key costs ~2.7k cycles a tile in the wgmma kernels, mostly
// instruction-fetch stalls at the reconvergence points: ncu, bench/results/mla_notes.md run 7)
__device__ __forceinline__ unsigned long long visible64(const unsigned* __restrict__ mask, int words, int t,
                                                        int key0, int P, int key_end) {
    const int lo = key0 - P;               // tree index of bit 0; negative: the prefix
    const int w = lo >> 5, sh = lo & 31;   // lo = 32 w + sh (floor)
    unsigned wd[3];
#pragma unroll
    for (int i = 0; i < 3; ++i) {
        const int wi = w + i;
        const unsigned x = __ldg(mask + t * words + min(max(wi, 0), words - 1));
        wd[i] = wi < 0 ? 0xffffffffu : wi >= words ? 0u : x;
    }
    const unsigned long long lo64 = (unsigned long long)wd[1] << 32 | wd[0];
    const unsigned long long v = (lo64 >> sh) | (sh ? (unsigned long long)wd[2] << (64 - sh) : 0ull);
    const int n = key_end - key0;          // keys of the window before key_end
    return v & (n >= 64 ? ~0ull : n <= 0 ? 0ull : (1ull << n) - 1);
}

// ---- tensor-core kernel ----------------------------------------------------------------------------

template <int NW, int BM, int BN, int STAGES>
struct MmaCfg {
    static constexpr int RG = BM / 16;          // QK row groups
    static constexpr int KH = NW / RG;          // QK key groups (warps sharing a row group)
    static constexpr int KW = BN / KH;          // keys per QK warp
    static constexpr int NP = KW / 16;          // n-tile pairs per QK warp
    static constexpr int CW = MLA_C / NW;       // output columns per PV warp
    static constexpr int NT = CW / 8;           // n-tiles per PV warp
    static constexpr int MT = BM / 16;          // m-tiles per PV warp
    static constexpr int PCH = BN / 8;          // 16-B chunks per P row
    static constexpr int Q_BYTES = BM * MLA_ROW_BYTES;
    static constexpr int K_BYTES = BN * MLA_ROW_BYTES;
    static constexpr int P_BYTES = BM * BN * 2;
    static constexpr int SMEM = Q_BYTES + STAGES * K_BYTES + P_BYTES + (2 * KH + 2) * BM * 4;
    static_assert(BM % 16 == 0 && NW % RG == 0, "row groups must divide the warps");
    static_assert(KW % 16 == 0 && NP >= 1, "each QK warp needs a multiple of 16 keys");
    static_assert(CW % 64 == 0, "each PV warp needs a multiple of 64 output columns (ldmatrix offsets)");
    static_assert(PCH == 4 || PCH % 8 == 0, "P swizzle handles 64-B rows or multiples of 128 B");
    static_assert(STAGES == 1 || STAGES == 2, "one or two K stages");
};

// Byte offset of 16-B chunk c of row r of the P tile (rows of BN bf16).
template <int PCH>
__device__ __forceinline__ unsigned p_off(int r, int c) {
    if (PCH % 8 == 0) return (unsigned)(r * PCH * 16 + ((((c & ~7) | ((c ^ r) & 7))) << 4));
    return (unsigned)(r * PCH * 16 + ((c ^ ((r >> 1) & 3)) << 4));    // 64-B rows: pairs of rows per bank sweep
}

template <int NW, int BM, int BN, int STAGES>
__device__ __forceinline__ void mla_mma_body(
    const bf16_t* __restrict__ q_lat, const bf16_t* __restrict__ q_pe, const bf16_t* __restrict__ latent,
    const unsigned* __restrict__ tree_mask, bf16_t* __restrict__ out, float* __restrict__ o_part,
    float* __restrict__ lse_part, int T, int H, int P, int S, int words, int chunk_keys, float scale_log2,
    const int* __restrict__ seq_len) {
    typedef MmaCfg<NW, BM, BN, STAGES> Cfg;
    graph_shape<BN>(seq_len, T, S, P, chunk_keys);
    constexpr int RG = Cfg::RG, KH = Cfg::KH, KW = Cfg::KW, NP = Cfg::NP, CW = Cfg::CW, NT = Cfg::NT,
                  MT = Cfg::MT, PCH = Cfg::PCH, NTHREADS = NW * 32;

    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* sQ = smem;
    unsigned char* sK = sQ + Cfg::Q_BYTES;
    unsigned char* sP = sK + STAGES * Cfg::K_BYTES;
    float* sMax = reinterpret_cast<float*>(sP + Cfg::P_BYTES);   // [KH][BM] tile row maxima per key group
    float* sL = sMax + KH * BM;                                  // [KH][BM] row sums per key group
    float* sAlpha = sL + KH * BM;                                // [BM] rescale of the running output
    float* sM = sAlpha + BM;                                     // [BM] final row maxima

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int M = T * H;
    const int row0 = blockIdx.x * BM;
    const int split = blockIdx.y;
    const int key_begin = split * chunk_keys;
    const int key_end = min(S, key_begin + chunk_keys);
    const int n_tiles = (key_end - key_begin + BN - 1) / BN;
    const unsigned sQa = smem_addr(sQ), sKa = smem_addr(sK), sPa = smem_addr(sP);

    load_q_rows<row_off>(sQa, q_lat, q_pe, BM, row0, M, tid, NTHREADS);
    auto load_k = [&](int tile, int buf) {
        load_key_rows<row_off>(sKa + buf * Cfg::K_BYTES, latent, BN, key_begin + tile * BN, key_end, tid, NTHREADS);
    };
    load_k(0, 0);
    cp_async_commit();

    // QK role: warp (rg, kh) owns rows rg*16 + g and rg*16 + g + 8 (g = lane/4) of the tile's score block.
    const int rg = warp % RG, kh = warp / RG;
    const int g = lane >> 2, q4 = lane & 3;
    const int qr0 = rg * 16 + g, qr1 = qr0 + 8;
    const int t0 = min((row0 + qr0) / H, T - 1), t1 = min((row0 + qr1) / H, T - 1);
    float m_run0 = neg_inf(), m_run1 = neg_inf(), l_run0 = 0.f, l_run1 = 0.f;

    // PV role: warp owns all BM rows x columns warp*CW..+CW.
    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[a][b][e] = 0.f;

    // ldmatrix lane addresses (see row_off / p_off): QK A = Q rows, QK B = K rows, PV A = P rows, PV B = V
    // rows read transposed. Index j = position of the 16-column step inside its 128-B group.
    const int mi = lane >> 3;
    unsigned qk_a_off[4], qk_b_off[4], pv_a_off[BN / 16], pv_b_off[4];
    {
        const int a_row = rg * 16 + (lane & 15), b_row = kh * KW + (mi >> 1) * 8 + (lane & 7);
        const int v_row = (mi & 1) * 8 + (lane & 7), v_chk = (warp * CW) / 8 + (mi >> 1);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            qk_a_off[j] = sQa + row_off(a_row, 2 * j + (lane >> 4));
            qk_b_off[j] = row_off(b_row, 2 * j + (mi & 1));
            pv_b_off[j] = row_off(v_row, v_chk + 2 * j);   // v_chk + 2j stays inside one 128-B group iff
        }                                                  // (v_chk & 7) + 2j < 8: true as CW % 64 == 0
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) pv_a_off[kk] = sPa + p_off<PCH>(lane & 15, 2 * kk + (lane >> 4));
    }

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = STAGES == 2 ? (it & 1) : 0;
        cp_async_wait_all();
        __syncthreads();   // tile `it` visible to all; everyone is past PV(it-1), so buf^1 and P are free
        if (STAGES == 2) {
            if (it + 1 < n_tiles) load_k(it + 1, buf ^ 1);
            cp_async_commit();
        }
        const unsigned kbase = sKa + buf * Cfg::K_BYTES;

        // ---- S = Q K^T over 576 channels
        float s[2 * NP][4];
#pragma unroll
        for (int n = 0; n < 2 * NP; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
        {
            // chunk c of row r sits at r*1152 + ((c ^ (r & 7)) << 4); with c = 2*kk + half, the XOR only
            // touches the low 3 bits, so kk = 4*kb + j gives base_j + 128*kb (immediates once unrolled).
            constexpr int QKU = MLA_QK_UNROLL;
#pragma unroll QKU
            for (int kb = 0; kb < MLA_ROW_CHUNKS / 8; ++kb) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    unsigned a[4];
                    ldsm_x4(a, qk_a_off[j] + 128 * kb);
#pragma unroll
                    for (int np = 0; np < NP; ++np) {
                        unsigned b[4];
                        ldsm_x4(b, kbase + qk_b_off[j] + np * 16 * MLA_ROW_BYTES + 128 * kb);
                        mma_bf16(s[2 * np], a, b[0], b[1]);
                        mma_bf16(s[2 * np + 1], a, b[2], b[3]);
                    }
                }
            }
        }

        // ---- scale into the exp2 domain, mask, tile row maxima
        const int wkey0 = key_begin + it * BN + kh * KW;     // first key of this warp's slice
        const bool need_mask = wkey0 + KW > P || wkey0 + KW > key_end;
        if (need_mask) {
            const unsigned long long v0 = visible64(tree_mask, words, t0, wkey0, P, key_end) >> (2 * q4),
                                     v1 = visible64(tree_mask, words, t1, wkey0, P, key_end) >> (2 * q4);
#pragma unroll
            for (int n = 0; n < 2 * NP; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[n][e] = ((e < 2 ? v0 : v1) >> (n * 8 + (e & 1))) & 1ull ? s[n][e] : neg_inf();
        }
        float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
        for (int n = 0; n < 2 * NP; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
        mx0 = quad_max(mx0);
        mx1 = quad_max(mx1);
        if (KH > 1) {
            if (q4 == 0) {
                sMax[kh * BM + qr0] = mx0;
                sMax[kh * BM + qr1] = mx1;
            }
            named_barrier(1 + rg, KH * 32);
            mx0 = sMax[qr0];
            mx1 = sMax[qr1];
#pragma unroll
            for (int k = 1; k < KH; ++k) {
                mx0 = fmaxf(mx0, sMax[k * BM + qr0]);
                mx1 = fmaxf(mx1, sMax[k * BM + qr1]);
            }
        }

        // ---- online softmax update (all KH warps of a row group compute the same m, alpha)
        float mu0, mu1;
        const float alpha0 = online_step(m_run0, l_run0, mx0, mu0), alpha1 = online_step(m_run1, l_run1, mx1, mu1);
#pragma unroll
        for (int n = 0; n < 2 * NP; ++n) {
            const float p0 = softmax_exp2(s[n][0] - mu0), p1 = softmax_exp2(s[n][1] - mu0);
            const float p2 = softmax_exp2(s[n][2] - mu1), p3 = softmax_exp2(s[n][3] - mu1);
            l_run0 += p0 + p1;
            l_run1 += p2 + p3;
            const int chunk = (kh * KW + n * 8) >> 3;
            *reinterpret_cast<unsigned*>(sP + p_off<PCH>(qr0, chunk) + 4 * q4) = pack_bf16x2(p0, p1);
            *reinterpret_cast<unsigned*>(sP + p_off<PCH>(qr1, chunk) + 4 * q4) = pack_bf16x2(p2, p3);
        }
        if (kh == 0 && q4 == 0) {
            sAlpha[qr0] = alpha0;
            sAlpha[qr1] = alpha1;
        }
        __syncthreads();   // P and alpha complete

        // ---- O = O * alpha + P V
        {
            float al[MT][2];
            bool rescale = true;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                al[mt][0] = sAlpha[mt * 16 + g];
                al[mt][1] = sAlpha[mt * 16 + g + 8];
            }
#if MLA_SKIP_RESCALE
            bool moved = false;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) moved |= (al[mt][0] != 1.f) | (al[mt][1] != 1.f);
            rescale = __any_sync(0xffffffffu, moved);
#endif
            if (rescale) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        acc[mt][n][0] *= al[mt][0];
                        acc[mt][n][1] *= al[mt][0];
                        acc[mt][n][2] *= al[mt][1];
                        acc[mt][n][3] *= al[mt][1];
                    }
            }
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], pv_a_off[kk] + mt * 16 * PCH * 16);
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned b[4];
                ldsm_x4_trans(b, kbase + pv_b_off[np & 3] + (np >> 2) * 128 + kk * 16 * MLA_ROW_BYTES);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(acc[mt][2 * np], a[mt], b[0], b[1]);
                    mma_bf16(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }
        if (STAGES == 1) {
            __syncthreads();   // everyone is done with the single K buffer
            if (it + 1 < n_tiles) load_k(it + 1, 0);
            cp_async_commit();
        }
    }

    cp_async_wait_all();   // an empty split (graph mode, key_begin >= S) still has its zero-fill copy in flight

    // ---- epilogue: total row sums, normalize, write
    l_run0 = quad_sum(l_run0);
    l_run1 = quad_sum(l_run1);
    if (q4 == 0) {
        sL[kh * BM + qr0] = l_run0;
        sL[kh * BM + qr1] = l_run1;
        if (kh == 0) {
            sM[qr0] = m_run0;
            sM[qr1] = m_run1;
        }
    }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = mt * 16 + g + 8 * h, m = row0 + r;
            float l = 0.f;
#pragma unroll
            for (int k = 0; k < KH; ++k) l += sL[k * BM + r];
            const float inv = l > 0.f ? 1.f / l : 0.f;
            if (m < M) {
                if (o_part == nullptr) {
                    bf16_t* dst = out + (long long)m * MLA_C + warp * CW + 2 * q4;
#pragma unroll
                    for (int n = 0; n < NT; ++n)
                        *reinterpret_cast<unsigned*>(dst + n * 8) =
                            pack_bf16x2(acc[mt][n][2 * h] * inv, acc[mt][n][2 * h + 1] * inv);
                } else {
                    float* dst = o_part + ((long long)split * M + m) * MLA_C + warp * CW + 2 * q4;
#pragma unroll
                    for (int n = 0; n < NT; ++n)
                        *reinterpret_cast<float2*>(dst + n * 8) =
                            make_float2(acc[mt][n][2 * h] * inv, acc[mt][n][2 * h + 1] * inv);
                    if (warp == 0 && q4 == 0)
                        lse_part[(long long)split * M + m] = l > 0.f ? sM[r] + __log2f(l) : neg_inf();
                }
            }
        }
    }
}

#define MLA_MMA_KERNEL(NAME, NW, BM, BN, STAGES)                                                            \
    extern "C" __global__ void __launch_bounds__(NW * 32, 1)                                                \
        NAME(const bf16_t* __restrict__ q_lat, const bf16_t* __restrict__ q_pe,                             \
             const bf16_t* __restrict__ latent, const unsigned* __restrict__ tree_mask,                     \
             bf16_t* __restrict__ out, float* __restrict__ o_part, float* __restrict__ lse_part, int T,     \
             int H, int P, int S, int words, int chunk_keys, float scale_log2, const int* seq_len) {        \
        mla_mma_body<NW, BM, BN, STAGES>(q_lat, q_pe, latent, tree_mask, out, o_part, lse_part, T, H, P, S,  \
                                         words, chunk_keys, scale_log2, seq_len);                           \
    }

MLA_MMA_KERNEL(mla_mma_w8_m64_n64_s2, 8, 64, 64, 2)   // 230,912 B smem: H100/H200 (227 KB opt-in)
MLA_MMA_KERNEL(mla_mma_w4_m32_n32_s1, 4, 32, 32, 1)   //  76,544 B smem: sm_120 / sm_86/89 (99 KB opt-in)

// ---- wgmma kernel (sm_90a: H100 / H200) ----------------------------------------------------------------
// mla_wgmma_m64_n64: the mma kernel's tiling (64 query rows x 64-key tiles, split-KV, the same partials and
// mla_combine) on Hopper's asynchronous warpgroup MMA, every operand straight from shared memory.
//   block 256 threads = 2 warpgroups:
//     warpgroup 0: S = Q K^T          36 x wgmma m64n64k16 (A = Q, B = K rows, both K-major), the online
//                                     softmax, P (bf16) and the rescale alpha -> smem
//     warpgroup w: O_w += P V_w       4 x wgmma m64n256k16 (A = P, B = V rows MN-major: .trans), w = 0, 1,
//                                     output columns w*256 .. +256
//   O_w is 64 x 256 fp32 = 128 registers per thread, and thread (warp k of w, lane) holds rows 16k + lane/4
//   (+8) of both S and O_w, so warpgroup 0 rescales its O in registers; warpgroup 1 reads alpha from smem.
//   Warpgroup 1's PV of tile j-1 runs on the tensor cores under warpgroup 0's QK of tile j; warpgroup 1
//   issues the K loads. Named barriers (256 threads):
//     KFREE  wg0 arrives when its PV(j-1) retired            -> wg1 loads K(j+1) into that buffer
//     PFREE  wg1 arrives when its PV(j-1) retired            -> wg0 may overwrite P and alpha
//     PREADY wg0 arrives when P(j) and alpha(j) are written -> wg1 rescales its O and issues PV(j)
//   Measured against two warpgroups with symmetric roles (each QK over 32 of the keys, m64n32k16, maxima
//   exchanged in smem): 15-20% faster at T >= 33 (Q is read from smem once per tile instead of twice; QK
//   of the symmetric split is smem-bound), bench/results/mla_notes.md.
// smem (1024-B aligned, 128-B swizzle): a 64-row tile of 576-value rows is 9 panels of 64 rows x 128 B
//   (channels 64p..64p+63), 16-B chunk c of row r of a panel at r*128 + ((c ^ r) & 7)*16 -- the canonical
//   128B-swizzle layout, K-major for Q and K (QK^T), MN-major for V (the same bytes, PV).
//   Q 72 KB + 2 K stages 144 KB + P 8 KB + row stats 1 KB + 1 KB alignment slack = 231,424 B.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace wgm {
constexpr int BM = 64, BN = 64, NTHREADS = 256;
constexpr int PANEL = 64 * 128;                      // one 64-channel panel of a 64-row tile
constexpr int TILE = 9 * PANEL;                      // 73,728 B
constexpr int OFF_K = TILE, OFF_P = 3 * TILE, OFF_STATS = 3 * TILE + BM * BN * 2;
constexpr int SMEM = OFF_STATS + 4 * BM * 4 + 1024;  // mirrored by KernelConfig.smem_bytes
static_assert(SMEM <= 232448, "must fit the 227 KB opt-in of H100/H200");

__device__ __forceinline__ unsigned panel_off(int r, int c) {   // chunk c (0..71) of row r (0..63)
    return (unsigned)((c >> 3) * PANEL + r * 128 + (((c ^ r) & 7) << 4));
}

// GMMA shared-memory descriptor, 128-B swizzle: start, leading and stride byte offsets (>> 4).
__device__ __forceinline__ unsigned long long desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// generic-proxy smem writes (cp.async, st.shared) -> visible to the async proxy (wgmma operand reads)
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// keep the compiler from moving accumulator reads/writes across the asynchronous MMA
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

#define WG_F8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), \
                 "+f"(d[b + 6]), "+f"(d[b + 7])
// D[64 x 256] += A[64 x 16] B[16 x 256], A K-major, B MN-major (.trans) in smem
__device__ __forceinline__ void mma_n256_bt(float (&d)[128], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
        "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
        "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
        "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
        "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, "
        "%128, %129, p, 1, 1, 0, 1;\n}\n"
        : WG_F8(0), WG_F8(8), WG_F8(16), WG_F8(24),
          WG_F8(32), WG_F8(40), WG_F8(48), WG_F8(56),
          WG_F8(64), WG_F8(72), WG_F8(80), WG_F8(88),
          WG_F8(96), WG_F8(104), WG_F8(112), WG_F8(120)
        : "l"(a), "l"(b), "n"(1));
}
#undef WG_F8

__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" :: "r"(id) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" :: "r"(id) : "memory"); }
enum { BAR_KFREE = 1, BAR_PFREE = 2, BAR_PREADY = 3 };

// the 32 accumulator operands of an m64n64 wgmma (also used by mla_wgmma_pair's register-A variant)
#define WG_D32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
               "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),     \
               "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),   \
               "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),   \
               "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B K-major in smem
__device__ __forceinline__ void mma_n64(float (&d)[32], unsigned long long a, unsigned long long b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_D32
        : "l"(a), "l"(b), "r"(acc));
}
// the tree mask and the key range, then scale_log2, applied to S (a 64 x 64 m64n64 accumulator: keys
// key0 + 8n + 2 q4 + (e & 1), rows r0 (e < 2) and r1) in place; returns the row maxima of rows r0, r1
__device__ __forceinline__ void mask_rowmax(float (&s)[32], float scale_log2, const unsigned* __restrict__ mask,
                                            int words, int t0, int t1, int key0, int P, int key_end, int q4,
                                            float& mx0, float& mx1) {
    if (key0 + 64 > P || key0 + 64 > key_end) {   // block-uniform: tiles reaching the tree part or the end
        const unsigned long long v0 = visible64(mask, words, t0, key0, P, key_end) >> (2 * q4),
                                 v1 = visible64(mask, words, t1, key0, P, key_end) >> (2 * q4);
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[4 * n + e] = ((e < 2 ? v0 : v1) >> (n * 8 + (e & 1))) & 1ull ? s[4 * n + e] : neg_inf();
    }
    mx0 = neg_inf();
    mx1 = neg_inf();
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[4 * n + e] *= scale_log2;
        mx0 = fmaxf(mx0, fmaxf(s[4 * n], s[4 * n + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * n + 2], s[4 * n + 3]));
    }
    mx0 = quad_max(mx0);
    mx1 = quad_max(mx1);
}

// Epilogue: O_w / l of the thread's rows r0, r1 (row sums l0, l1, maxima mx0, mx1; output columns
// w*256 + 8n + 2 q4, +1): bf16 to out, or with splits fp32 partials to o_part and lse = m + log2 l to lse_part
__device__ __forceinline__ void store_o(const float (&o)[128], float l0, float l1, float mx0, float mx1,
                                        bf16_t* __restrict__ out, float* __restrict__ o_part,
                                        float* __restrict__ lse_part, int M, int row0, int r0, int r1, int wg,
                                        int q4, int split) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int m = row0 + (h ? r1 : r0);
        const float l = h ? l1 : l0;
        const float inv = l > 0.f ? 1.f / l : 0.f;
        if (m >= M) continue;
        if (o_part == nullptr) {
            bf16_t* dst = out + (long long)m * MLA_C + wg * 256 + 2 * q4;
#pragma unroll
            for (int n = 0; n < 32; ++n)
                *reinterpret_cast<unsigned*>(dst + n * 8) =
                    pack_bf16x2(o[4 * n + 2 * h] * inv, o[4 * n + 2 * h + 1] * inv);
        } else {
            float* dst = o_part + ((long long)split * M + m) * MLA_C + wg * 256 + 2 * q4;
#pragma unroll
            for (int n = 0; n < 32; ++n)
                *reinterpret_cast<float2*>(dst + n * 8) =
                    make_float2(o[4 * n + 2 * h] * inv, o[4 * n + 2 * h + 1] * inv);
            if (wg == 0 && q4 == 0)
                lse_part[(long long)split * M + m] = l > 0.f ? (h ? mx1 : mx0) + __log2f(l) : neg_inf();
        }
    }
}

// O *= alpha row-wise (rows g and g+8 of the thread); skipped when no row of the warp moved (MLA_SKIP_RESCALE)
__device__ __forceinline__ void rescale(float (&o)[128], float alpha0, float alpha1) {
    const bool moved = (alpha0 != 1.f) | (alpha1 != 1.f);
    if (MLA_SKIP_RESCALE && !__any_sync(0xffffffffu, moved)) return;
#pragma unroll
    for (int n = 0; n < 32; ++n) {
        o[4 * n] *= alpha0;
        o[4 * n + 1] *= alpha0;
        o[4 * n + 2] *= alpha1;
        o[4 * n + 3] *= alpha1;
    }
}
}  // namespace wgm

extern "C" __global__ void __launch_bounds__(256, 1) mla_wgmma_m64_n64(
    const bf16_t* __restrict__ q_lat, const bf16_t* __restrict__ q_pe, const bf16_t* __restrict__ latent,
    const unsigned* __restrict__ tree_mask, bf16_t* __restrict__ out, float* __restrict__ o_part,
    float* __restrict__ lse_part, int T, int H, int P, int S, int words, int chunk_keys, float scale_log2,
    const int* __restrict__ seq_len) {
    using namespace wgm;
    if (seq_len != nullptr) {   // graph mode as graph_shape; inline: the call renames registers (other SASS)
        S = __ldg(seq_len);
        P = S - T;
        chunk_keys = ((S + BN - 1) / BN + (int)gridDim.y - 1) / (int)gridDim.y * BN;
    }
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned raw = smem_addr(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base - raw);
    const unsigned sQa = base, sKa = base + OFF_K, sPa = base + OFF_P;
    float* sAlpha = reinterpret_cast<float*>(smem + OFF_STATS);   // [BM]
    float* sL = sAlpha + BM;                                       // [BM]
    float* sM = sL + BM;                                           // [BM]

    const int tid = threadIdx.x, wg = tid >> 7, wq = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, q4 = lane & 3;
    const int r0 = wq * 16 + g, r1 = r0 + 8;
    const int M = T * H, row0 = blockIdx.x * BM, split = blockIdx.y;
    const int key_begin = split * chunk_keys, key_end = min(S, key_begin + chunk_keys);
    const int n_tiles = (key_end - key_begin + BN - 1) / BN;
    const int t0 = min((row0 + r0) / H, T - 1), t1 = min((row0 + r1) / H, T - 1);

    load_q_rows<panel_off>(sQa, q_lat, q_pe, BM, row0, M, tid, NTHREADS);
    auto load_k = [&](int tile, int buf, int t_begin, int t_step) {
        load_key_rows<panel_off>(sKa + buf * TILE, latent, BN, key_begin + tile * BN, key_end, t_begin, t_step);
    };
    load_k(0, 0, tid, NTHREADS);
    cp_async_commit();

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float s[32];
    float m_run0 = neg_inf(), m_run1 = neg_inf(), l_run0 = 0.f, l_run1 = 0.f;   // warpgroup 0 only

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it & 1;
        const unsigned kb = sKa + buf * TILE;
        cp_async_wait_all();
        fence_async_smem();
        __syncthreads();                 // K(it) (and Q) landed for everyone
        if (wg == 0) {
            // ---- S = Q K^T, all 64 keys. This half's PV(it-1) retires first (a wait_group 1 here, letting it
            // retire under the QK, makes ptxas serialize every wgmma); warpgroup 1's PV(it-1) runs on.
            wait<0>();
            pin(o);
            bar_arrive(BAR_KFREE);       // warpgroup 1 may refill PV(it-1)'s K buffer once its own half retired
            pin(s);
            fence();
#pragma unroll
            for (int kk = 0; kk < 36; ++kk) {
                const unsigned a = sQa + (kk >> 2) * PANEL + (kk & 3) * 32;
                const unsigned b = kb + (kk >> 2) * PANEL + (kk & 3) * 32;
                mma_n64(s, desc(a, 16, 1024), desc(b, 16, 1024), kk > 0);
            }
            commit();
            wait<0>();
            pin(s);

            float mx0, mx1;
            mask_rowmax(s, scale_log2, tree_mask, words, t0, t1, key_begin + it * BN, P, key_end, q4, mx0, mx1);
            float mu0, mu1;
            const float alpha0 = online_step(m_run0, l_run0, mx0, mu0), alpha1 = online_step(m_run1, l_run1, mx1, mu1);
            unsigned pk[16];
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                const float p0 = softmax_exp2(s[4 * n] - mu0), p1 = softmax_exp2(s[4 * n + 1] - mu0);
                const float p2 = softmax_exp2(s[4 * n + 2] - mu1), p3 = softmax_exp2(s[4 * n + 3] - mu1);
                l_run0 += p0 + p1;
                l_run1 += p2 + p3;
                pk[2 * n] = pack_bf16x2(p0, p1);
                pk[2 * n + 1] = pack_bf16x2(p2, p3);
            }
            rescale(o, alpha0, alpha1);
            bar_sync(BAR_PFREE);         // warpgroup 1's PV(it-1) no longer reads P
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                *reinterpret_cast<unsigned*>(smem + OFF_P + r0 * 128 + (((n ^ r0) & 7) << 4) + 4 * q4) = pk[2 * n];
                *reinterpret_cast<unsigned*>(smem + OFF_P + r1 * 128 + (((n ^ r1) & 7) << 4) + 4 * q4) = pk[2 * n + 1];
            }
            if (q4 == 0) {
                sAlpha[r0] = alpha0;
                sAlpha[r1] = alpha1;
            }
            fence_async_smem();
            bar_arrive(BAR_PREADY);
        } else {
            wait<0>();                   // this half's PV(it-1) retired
            pin(o);
            bar_sync(BAR_KFREE);         // and warpgroup 0's: buffer buf^1 is free
            if (it + 1 < n_tiles) load_k(it + 1, buf ^ 1, tid - 128, 128);
            cp_async_commit();
            bar_arrive(BAR_PFREE);
            bar_sync(BAR_PREADY);
            const float alpha0 = sAlpha[r0], alpha1 = sAlpha[r1];
            rescale(o, alpha0, alpha1);
        }
        // ---- O_w += P V_w (retires under the next tile's QK)
        pin(o);
        fence();
#pragma unroll
        for (int k = 0; k < 4; ++k)
            mma_n256_bt(o, desc(sPa + k * 32, 16, 1024), desc(kb + wg * 4 * PANEL + k * 16 * 128, PANEL, 1024));
        commit();
    }
    wait<0>();
    pin(o);
    cp_async_wait_all();

    if (wg == 0) {
        l_run0 = quad_sum(l_run0);
        l_run1 = quad_sum(l_run1);
        if (q4 == 0) {
            sL[r0] = l_run0;
            sL[r1] = l_run1;
            sM[r0] = m_run0;
            sM[r1] = m_run1;
        }
    }
    __syncthreads();
    store_o(o, sL[r0], sL[r1], sM[r0], sM[r1], out, o_part, lse_part, M, row0, r0, r1, wg, q4, split);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ---- seesaw wgmma kernel (sm_90a) -----------------------------------------------------------------------
// mla_wgmma_pair: the wgmma kernel's tiles and operands, with the key tiles taken in pairs so that each
// warpgroup's softmax runs under the other warpgroup's MMAs (the schedule of FlashMLA's sm90 decode kernel,
// deepseek-ai/FlashMLA docs/20250422). Warpgroup 0 owns O_L (output columns 0-255) and the QK of the even tile
// (buffer 0), warpgroup 1 owns O_R (columns 256-511) and the QK of the odd tile (buffer 1). The running row
// max m is shared through smem. Per pair, m_prev the max before it:
//   wg0: S0 = Q K0^T; m0 = max(m_prev, rowmax S0); P0 = 2^(S0 - m0); O_L = O_L * 2^(m_prev-m0) + P0 V0_L (P0 from
//        registers)                                             -> m0, scale0 to smem (BAR_SCALE0)
//   wg1: S1 = Q K1^T; m1 = max(m0, rowmax S1); P1 = 2^(S1 - m1) -> m1, scale1 = 2^(m0-m1), P1 to smem (BAR_P1);
//        O_R = O_R * scale0 * scale1 + P1 V1_R (registers)
//   wg0: P0 *= scale1 -> smem (BAR_P0); O_L = O_L * scale1 + P1 V1_L
//   wg1: O_R += P0 V0_R
// The row sums are kept per warpgroup (of the tiles whose softmax it ran) and added at the end. An odd count's last
// tile runs alone: warpgroup 1 skips its QK and P1 V1_R, warpgroup 0 its P1 V1_L (scale1 = 1).
// Loads: Q's rope panel (channels 512-575) lives in registers (16 per thread, the A operand of the 4 rope
// k-steps), which frees its 8 KB of smem for P1. K tiles are refilled in three panel groups, each as soon as the
// MMAs that read it have retired, by cp.async tracked on an mbarrier per (buffer, group) (count 128: the
// warpgroup that issues that group; no TMA, CuPy exposes no tensor-map encode):
//   panels 0-3 (V_L)   by wg0, after its PV on V_L
//   panels 4-7 (V_R)   by wg1, after its PV on V_R
//   panel 8 (rope)     by the buffer's QK warpgroup, after its QK
// and each QK reads the group refilled first first: wg0 rope, L, R; wg1 rope, R, L.
// smem: Q 72 KB (panel 8 = P1) + 2 K stages 144 KB + P0 8 KB + stats and mbarriers 1.5 KB + 1 KB slack.
// Measured (H200, bench/results/mla_notes.md run 7): 414-469 TFLOP/s at T >= 33, prefix 8k, 478-502 from 32k;
//   2.43 us per 64x64 tile per SM at T=257 P=8k, 1.72 without the K refills: the refill latency is what is left.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#ifndef MLA_TRACE
#define MLA_TRACE 0              // clock64 stamps of one block's schedule (bench/mla_trace.py), never in serving builds
#endif
#ifndef MLA_PAIR_NOLOAD
#define MLA_PAIR_NOLOAD 0        // experiment only (wrong results): K refills skipped, to time the schedule alone
#endif
#if MLA_TRACE
__device__ long long mla_trace[2][64][16];   // [warpgroup][pair][event]
#define TRACE(e) \
    if (tracing && i < 64) mla_trace[wg][i][e] = clock64();
// every block's edges (row tile 0, splits < 256): [0..3] %globaltimer ns, [4..7] clock64 at kernel entry, Q landed,
// the pair loop done, the output or partial stored (thread 0)
__device__ unsigned long long mla_edges[256][8];
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
#define EDGE(k)                                                                \
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y < 256) {             \
        mla_edges[blockIdx.y][k] = global_ns();                                \
        mla_edges[blockIdx.y][4 + k] = clock64();                              \
    }
#else
#define TRACE(e)
#define EDGE(k)
#endif
namespace wgp {
using wgm::PANEL;
using wgm::TILE;
constexpr int OFF_K = TILE, OFF_P1 = 8 * PANEL, OFF_P0 = 3 * TILE, OFF_STATS = 3 * TILE + 64 * 64 * 2;
constexpr int OFF_MBAR = OFF_STATS + 5 * 64 * 4;
constexpr int SMEM = OFF_STATS + 1536 + 1024;   // mirrored by KernelConfig.smem_bytes
static_assert(SMEM <= 232448, "must fit the 227 KB opt-in of H100/H200");
enum { G_L = 0, G_R = 1, G_ROPE = 2 };
enum { BAR_SCALE0 = 1, BAR_P1 = 2, BAR_P0 = 3 };

// a value the compiler cannot see through: keeps loop-invariant smem descriptors from being hoisted into
// (and held in) registers across the whole loop
__device__ __forceinline__ unsigned opaque(unsigned x) {
    asm volatile("mov.b32 %0, %0;\n" : "+r"(x));
    return x;
}

__device__ __forceinline__ void mbar_init(unsigned addr, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(addr), "r"(count) : "memory");
}
// arrives on the mbarrier when every cp.async this thread issued so far has landed
__device__ __forceinline__ void cp_async_arrive(unsigned addr) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(addr) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned addr, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" :: "r"(addr), "r"(parity) : "memory");
}

// 16-B chunks of panels P0 .. P0+NP-1 of a 64-key tile, thread t of 128 (one row's panels are contiguous in
// global memory, so consecutive threads read consecutive chunks); rows past key_end are zero-filled
template <int P0, int NP>
__device__ __forceinline__ void load_panels(unsigned dst, const bf16_t* __restrict__ latent, int k0, int key_end,
                                            int t) {
#pragma unroll
    for (int j = 0; j < NP * 4; ++j) {
        const int i = t + j * 128, r = i / (NP * 8), c = P0 * 8 + i % (NP * 8), key = k0 + r;
        const bool ok = key < key_end;
        cp_async16(dst + wgm::panel_off(r, c), ok ? latent + (long long)key * MLA_L + c * 8 : latent, ok ? 16 : 0);
    }
}

#define WG_F8(b) "+f"(d[b]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), \
                 "+f"(d[b + 6]), "+f"(d[b + 7])
#define WG_D128 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                               \
                "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                     \
                "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"                     \
                "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"                     \
                "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"                     \
                "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"                     \
                "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"         \
                "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
// D[64 x 256] += A[64 x 16] (registers: the m64k16 A fragment) B[16 x 256] (smem, MN-major: .trans)
__device__ __forceinline__ void mma_n256_rs(float (&d)[128], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                            unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " WG_D128 ", {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
        : WG_F8(0), WG_F8(8), WG_F8(16), WG_F8(24), WG_F8(32), WG_F8(40), WG_F8(48), WG_F8(56),
          WG_F8(64), WG_F8(72), WG_F8(80), WG_F8(88), WG_F8(96), WG_F8(104), WG_F8(112), WG_F8(120)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "n"(1));
}
#undef WG_D128
#undef WG_F8
// D[64 x 64] (+)= A[64 x 16] (registers) B[16 x 64] (smem, K-major)
__device__ __forceinline__ void mma_n64_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
        : WG_D32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}
#undef WG_D32

// S = Q K^T of one 64-key tile (buffer kb): the rope k-steps from registers first, then the 64-channel panel
// groups in the order given (each waited for on its mbarrier, then made visible to the async proxy)
template <int FIRST, int SECOND>
__device__ __forceinline__ void qk(float (&s)[32], const unsigned (&rq)[4][4], unsigned sQa, unsigned kb,
                                   unsigned mbar, unsigned parity, long long* tr) {
    using namespace wgm;
    // descriptors advance by (byte offset >> 4) in their start-address field
    const unsigned long long dq = desc(sQa, 16, 1024), dk = desc(kb, 16, 1024);
    mbar_wait(mbar + 8 * G_ROPE, parity);
    if (MLA_TRACE && tr) tr[8] = clock64();
    fence_async_smem();
    fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) mma_n64_rs(s, rq[kk], dk + ((8 * PANEL + kk * 32) >> 4), kk > 0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int grp = half ? SECOND : FIRST;
        mbar_wait(mbar + 8 * grp, parity);
        if (MLA_TRACE && tr) tr[9 + half] = clock64();
        fence_async_smem();
        fence();
#pragma unroll
        for (int kk = 0; kk < 16; ++kk) {
            const int k = grp * 16 + kk, off = ((k >> 2) * PANEL + (k & 3) * 32) >> 4;
            mma_n64(s, dq + off, dk + off, 1);
        }
    }
    commit();
}

// P = 2^(S - mu) in place (fp32), packed to bf16 pairs (the A fragment layout), row sums added to l0, l1
__device__ __forceinline__ void exp_pack(float (&s)[32], unsigned (&pk)[16], float mu0, float mu1, float& l0,
                                         float& l1) {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        s[4 * n] = softmax_exp2(s[4 * n] - mu0);
        s[4 * n + 1] = softmax_exp2(s[4 * n + 1] - mu0);
        s[4 * n + 2] = softmax_exp2(s[4 * n + 2] - mu1);
        s[4 * n + 3] = softmax_exp2(s[4 * n + 3] - mu1);
        l0 += s[4 * n] + s[4 * n + 1];
        l1 += s[4 * n + 2] + s[4 * n + 3];
        pk[2 * n] = pack_bf16x2(s[4 * n], s[4 * n + 1]);
        pk[2 * n + 1] = pack_bf16x2(s[4 * n + 2], s[4 * n + 3]);
    }
}

// P (bf16 pairs) -> a 64 x 64 K-major 128-B-swizzled smem tile, made visible to the async proxy
__device__ __forceinline__ void store_p(unsigned char* sp, const unsigned (&pk)[16], int r0, int r1, int q4) {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        *reinterpret_cast<unsigned*>(sp + r0 * 128 + (((n ^ r0) & 7) << 4) + 4 * q4) = pk[2 * n];
        *reinterpret_cast<unsigned*>(sp + r1 * 128 + (((n ^ r1) & 7) << 4) + 4 * q4) = pk[2 * n + 1];
    }
    wgm::fence_async_smem();
}

// O[64 x 256] += P V_half over one tile: P from registers (pk) or from smem (sp), V = panels 4*half.. of kb
__device__ __forceinline__ void pv_rs(float (&o)[128], const unsigned (&pk)[16], unsigned vb) {
    using namespace wgm;
    pin(o);
    fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
        mma_n256_rs(o, pk[4 * k], pk[4 * k + 1], pk[4 * k + 2], pk[4 * k + 3], desc(vb + k * 16 * 128, PANEL, 1024));
    commit();
}
__device__ __forceinline__ void pv_ss(float (&o)[128], unsigned sp, unsigned vb) {
    using namespace wgm;
    pin(o);
    fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) mma_n256_bt(o, desc(sp + k * 32, 16, 1024), desc(vb + k * 16 * 128, PANEL, 1024));
    commit();
}
}  // namespace wgp

extern "C" __global__ void __launch_bounds__(256, 1) mla_wgmma_pair(
    const bf16_t* __restrict__ q_lat, const bf16_t* __restrict__ q_pe, const bf16_t* __restrict__ latent,
    const unsigned* __restrict__ tree_mask, bf16_t* __restrict__ out, float* __restrict__ o_part,
    float* __restrict__ lse_part, int T, int H, int P, int S, int words, int chunk_keys, float scale_log2,
    const int* __restrict__ seq_len) {
    using namespace wgm;
    using namespace wgp;
    if (seq_len != nullptr) {   // graph mode as graph_shape
        S = __ldg(seq_len);
        P = S - T;
        chunk_keys = ((S + BN - 1) / BN + (int)gridDim.y - 1) / (int)gridDim.y * BN;
    }
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned raw = smem_addr(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base - raw);
    const unsigned sQa0 = base, sKa0 = base + wgp::OFF_K, sP0a0 = base + OFF_P0, sP1a0 = base + OFF_P1;
    const unsigned mbar0 = base + OFF_MBAR, mbar1 = mbar0 + 24;   // (buffer, group) at + 24 * buffer + 8 * group
    float* sM = reinterpret_cast<float*>(smem + wgp::OFF_STATS);   // [64] running max (m0, then m1)
    float* sScale0 = sM + BM;                                       // [64]
    float* sScale1 = sScale0 + BM;                                  // [64]
    float* sL = sScale1 + BM;                                       // [2][64] row sums per warpgroup

    EDGE(0)
    const int tid = threadIdx.x, wg = tid >> 7, wq = (tid >> 5) & 3, lane = tid & 31, lt = tid & 127;
    const int g = lane >> 2, q4 = lane & 3;
    const int r0 = wq * 16 + g, r1 = r0 + 8;
    const int M = T * H, row0 = blockIdx.x * BM, split = blockIdx.y;
    const int key_begin = split * chunk_keys, key_end = min(S, key_begin + chunk_keys);
    const int n_tiles = max(0, (key_end - key_begin + BN - 1) / BN), n_pairs = (n_tiles + 1) / 2;
    const int t0 = min((row0 + r0) / H, T - 1), t1 = min((row0 + r1) / H, T - 1);

    if (tid < 6) mbar_init(mbar0 + 8 * tid, 128);
    load_q_rows<panel_off>(sQa0, q_lat, q_pe, BM, row0, M, tid, NTHREADS);
    cp_async_commit();
    __syncthreads();   // mbarriers initialized
    // group `grp` of tile `tile` -> buffer `buf`, by the 128 threads of the calling warpgroup (none past the tiles)
    auto fill = [&](int buf, int grp, int tile) {
        if (tile >= n_tiles) return;
        const unsigned dst = sKa0 + buf * TILE;
        const int k0 = key_begin + tile * BN;
        if (MLA_PAIR_NOLOAD && tile > 1) {
        } else if (grp == G_L) load_panels<0, 4>(dst, latent, k0, key_end, lt);
        else if (grp == G_R) load_panels<4, 4>(dst, latent, k0, key_end, lt);
        else load_panels<8, 1>(dst, latent, k0, key_end, lt);
        cp_async_arrive((buf ? mbar1 : mbar0) + 8 * grp);
    };
    if (wg == 0) {
        fill(0, G_ROPE, 0);
        fill(0, G_L, 0);
        fill(1, G_L, 1);
    } else {
        fill(1, G_ROPE, 1);
        fill(1, G_R, 1);
        fill(0, G_R, 0);
    }
    cp_async_wait_all();   // the Q group (the K loads are not in a group: their mbarriers track them)
    fence_async_smem();
    __syncthreads();       // Q landed for everyone
    EDGE(1)
    unsigned rq[4][4];     // Q's rope panel: the A fragments of k-steps 32..35
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) ldsm_x4(rq[kk], sQa0 + panel_off(wq * 16 + (lane & 15), 64 + 2 * kk + (lane >> 4)));

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float s[32];
    unsigned pk[16];
    float m_run0 = neg_inf(), m_run1 = neg_inf(), l0 = 0.f, l1 = 0.f;
#if MLA_TRACE
    const bool tracing = lt == 0 && blockIdx.x == gridDim.x / 2 && blockIdx.y == 0;
#endif

    for (int i = 0; i < n_pairs; ++i) {
        const unsigned par = i & 1, sKa = opaque(sKa0), sQa = opaque(sQa0), sP0a = opaque(sP0a0),
                       sP1a = opaque(sP1a0);
        const bool odd = 2 * i + 1 < n_tiles;   // block-uniform; false only for an odd count's last pair
        TRACE(0)
#if MLA_TRACE
        long long* tr = tracing && i < 64 ? mla_trace[wg][i] : nullptr;
#else
        long long* tr = nullptr;
#endif
        if (wg == 0) {
            // ---- even tile: S0, softmax against the running max, O_L += P0 V0_L
            qk<G_L, G_R>(s, rq, sQa, sKa, mbar0, par, tr);
            wait<0>();   // also retires the previous pair's P1 V1_L
            TRACE(1)
            pin(s);
            pin(o);
            fill(0, G_ROPE, 2 * i + 2);
            TRACE(11)
            float mx0, mx1, mu0, mu1;
            mask_rowmax(s, scale_log2, tree_mask, words, t0, t1, key_begin + 2 * i * BN, P, key_end, q4, mx0, mx1);
            TRACE(12)
            const float sc0 = online_step(m_run0, l0, mx0, mu0), sc1 = online_step(m_run1, l1, mx1, mu1);
            exp_pack(s, pk, mu0, mu1, l0, l1);
            TRACE(13)
            if (q4 == 0) {
                sM[r0] = m_run0;
                sM[r1] = m_run1;
                sScale0[r0] = sc0;
                sScale0[r1] = sc1;
            }
            bar_arrive(BAR_SCALE0);
            TRACE(2)
            rescale(o, sc0, sc1);
            pv_rs(o, pk, sKa);
            // ---- odd tile's max from warpgroup 1: P0 rescaled to it -> smem, O_L += P1 V1_L
            bar_sync(BAR_P1);
            TRACE(3)
            const float a0 = sScale1[r0], a1 = sScale1[r1];
            m_run0 = sM[r0];
            m_run1 = sM[r1];
            l0 *= a0;
            l1 *= a1;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                s[4 * n] *= a0;
                s[4 * n + 1] *= a0;
                s[4 * n + 2] *= a1;
                s[4 * n + 3] *= a1;
            }
            wait<0>();   // P0 V0_L retired: pk and O_L are free, panels 0-3 of buffer 0 too
            TRACE(4)
            pin(o);
            fill(0, G_L, 2 * i + 2);
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                pk[2 * n] = pack_bf16x2(s[4 * n], s[4 * n + 1]);
                pk[2 * n + 1] = pack_bf16x2(s[4 * n + 2], s[4 * n + 3]);
            }
            store_p(smem + OFF_P0, pk, r0, r1, q4);
            bar_arrive(BAR_P0);
            rescale(o, a0, a1);
            if (odd) {
                mbar_wait(mbar1 + 8 * G_L, par);   // filled by this warpgroup, read by its own MMA now
                fence_async_smem();
                pv_ss(o, sP1a, sKa + TILE);
            }
            TRACE(5)
            wait<0>();
            TRACE(6)
            pin(o);
            fill(1, G_L, 2 * i + 3);
        } else {
            // ---- odd tile: S1, softmax against warpgroup 0's max, P1 -> smem, O_R += P1 V1_R. Without an odd
            // tile the row maxima stay m0 (scale1 = 1) and only O_R += P0 V0_R runs.
            float mx0 = neg_inf(), mx1 = neg_inf(), mu0, mu1;
            if (odd) {
                qk<G_R, G_L>(s, rq, sQa, sKa + TILE, mbar1, par, tr);
                wait<0>();
                TRACE(1)
                pin(s);
                pin(o);
                fill(1, G_ROPE, 2 * i + 3);
                TRACE(11)
                mask_rowmax(s, scale_log2, tree_mask, words, t0, t1, key_begin + (2 * i + 1) * BN, P, key_end, q4,
                            mx0, mx1);
                TRACE(12)
            }
            bar_sync(BAR_SCALE0);
            TRACE(2)
            const float b0 = sScale0[r0], b1 = sScale0[r1];
            m_run0 = sM[r0];
            m_run1 = sM[r1];
            l0 *= b0;
            l1 *= b1;
            const float sc0 = online_step(m_run0, l0, mx0, mu0), sc1 = online_step(m_run1, l1, mx1, mu1);
            if (odd) exp_pack(s, pk, mu0, mu1, l0, l1);
            if (q4 == 0) {
                sM[r0] = m_run0;
                sM[r1] = m_run1;
                sScale1[r0] = sc0;
                sScale1[r1] = sc1;
            }
            if (odd) store_p(smem + OFF_P1, pk, r0, r1, q4);
            bar_arrive(BAR_P1);
            TRACE(3)
            rescale(o, b0 * sc0, b1 * sc1);
            if (odd) pv_rs(o, pk, sKa + TILE + 4 * PANEL);
            // ---- O_R += P0 V0_R
            bar_sync(BAR_P0);
            TRACE(4)
            mbar_wait(mbar0 + 8 * G_R, par);
            fence_async_smem();
            pv_ss(o, sP0a, sKa + 4 * PANEL);
            wait<1>();   // P1 V1_R retired: panels 4-7 of buffer 1 are free
            TRACE(5)
            fill(1, G_R, 2 * i + 3);
            wait<0>();
            TRACE(6)
            pin(o);
            fill(0, G_R, 2 * i + 2);
        }
    }
    wait<0>();
    pin(o);
    EDGE(2)

    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    if (q4 == 0) {
        sL[wg * BM + r0] = l0;
        sL[wg * BM + r1] = l1;
    }
    __syncthreads();
    store_o(o, sL[r0] + sL[BM + r0], sL[r1] + sL[BM + r1], sM[r0], sM[r1], out, o_part, lse_part, M, row0, r0, r1,
            wg, q4, split);
    EDGE(3)
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ---- split-KV merge ----------------------------------------------------------------------------------
// Row m, columns c..c+3 of the splits s0, s0+step, ...: acc = sum 2^(lse_s - max) O_s, den = sum 2^(lse_s - max),
// with max over every split of the row (the 32 lanes of the calling warp share m; zeros when no key was seen)
__device__ __forceinline__ void merge_splits(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                                             int M, int C, int m, int c, int lane, int s0, int step, int splits,
                                             float4& acc, float& den) {
    float mx = neg_inf();
    for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, __ldg(lse_part + (long long)s * M + m));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    acc = make_float4(0.f, 0.f, 0.f, 0.f);
    den = 0.f;
    if (mx == neg_inf()) return;
#pragma unroll 4
    for (int s = s0; s < splits; s += step) {
        const float wt = exp2f(__ldg(lse_part + (long long)s * M + m) - mx);
        const float4 v = __ldg(reinterpret_cast<const float4*>(o_part + ((long long)s * M + m) * C + c));
        acc.x += wt * v.x;
        acc.y += wt * v.y;
        acc.z += wt * v.z;
        acc.w += wt * v.w;
        den += wt;
    }
}

// grid (M, C/128), block 256: out[m, c..c+3] = sum_s 2^(lse_s - max) O_s[m, c..c+3] / sum_s 2^(lse_s - max),
// c = blockIdx.y*128 + 4*lane; warp w sums the splits w, w+8, ... and the eight warps meet in smem. A decode step
// (M = 64, 65-129 splits) spreads over 256 blocks with 8 warps of loads in flight per row and column slice.
#if MLA_TRACE && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// %globaltimer at entry and exit of mla_combine's blocks (blockIdx.x * 4 + blockIdx.y < 256: decode's merge)
__device__ unsigned long long mla_merge_edges[256][2];
#define MERGE_EDGE(k)                                                                                  \
    if (threadIdx.x == 0 && blockIdx.x * gridDim.y + blockIdx.y < 256)                                 \
        mla_merge_edges[blockIdx.x * gridDim.y + blockIdx.y][k] = global_ns();
#else
#define MERGE_EDGE(k)
#endif
#define MLA_COMBINE_WARPS 8   // mirrored by COMBINE_THREADS in optimized/mla_attention.py
extern "C" __global__ void __launch_bounds__(MLA_COMBINE_WARPS * 32) mla_combine(const float* __restrict__ o_part,
                                                                                 const float* __restrict__ lse_part,
                                                                                 bf16_t* __restrict__ out, int M,
                                                                                 int C, int splits) {
    __shared__ float4 s_acc[MLA_COMBINE_WARPS][32];
    __shared__ float s_den[MLA_COMBINE_WARPS];
    const int m = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    MERGE_EDGE(0)
    const int c = blockIdx.y * 128 + lane * 4;
    float4 acc;
    float den;
    merge_splits(o_part, lse_part, M, C, m, c, lane, w, MLA_COMBINE_WARPS, splits, acc, den);
    s_acc[w][lane] = acc;
    if (lane == 0) s_den[w] = den;
    __syncthreads();
    if (w != 0) return;
    float4 t = s_acc[0][lane];
    float d = s_den[0];
#pragma unroll
    for (int k = 1; k < MLA_COMBINE_WARPS; ++k) {
        const float4 u = s_acc[k][lane];
        t.x += u.x;
        t.y += u.y;
        t.z += u.z;
        t.w += u.w;
        d += s_den[k];
    }
    const float inv = d > 0.f ? 1.f / d : 0.f;
    uint2 packed;
    packed.x = pack_bf16x2(t.x * inv, t.y * inv);
    packed.y = pack_bf16x2(t.z * inv, t.w * inv);
    *reinterpret_cast<uint2*>(out + (long long)m * C + c) = packed;
    MERGE_EDGE(1)
}

// mla_combine_rows: the same merge with one warp per row (grid (ceil(M/4), C/128), block 128: warp w takes row
// 4*blockIdx.x + w) and each lane summing every split of its 4 columns, 4 loads in flight; no smem, no barrier.
// For many rows (M >= 256, COMBINE_ROWS_MIN_M): there mla_combine's block per row and slice holds at most one
// 16-B load a thread at few splits, and the merge was mostly block launches (T=33 P=8k: 8 us, mla_notes.md run 7).
extern "C" __global__ void __launch_bounds__(128) mla_combine_rows(const float* __restrict__ o_part,
                                                                   const float* __restrict__ lse_part,
                                                                   bf16_t* __restrict__ out, int M, int C,
                                                                   int splits) {
    const int m = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (m >= M) return;
    const int c = blockIdx.y * 128 + lane * 4;
    float4 acc;
    float den;
    merge_splits(o_part, lse_part, M, C, m, c, lane, 0, 1, splits, acc, den);
    const float inv = den > 0.f ? 1.f / den : 0.f;
    uint2 packed;
    packed.x = pack_bf16x2(acc.x * inv, acc.y * inv);
    packed.y = pack_bf16x2(acc.z * inv, acc.w * inv);
    *reinterpret_cast<uint2*>(out + (long long)m * C + c) = packed;
}

// ---- generic SIMT path (any small C, R: the tiny fixtures) ----------------------------------------------
// grid (M), block GEN_WARPS warps, dynamic smem (L + GEN_WARPS * (C + 2)) fp32: one block per query row m. The
// keys are cut into chunks of 32 and warp w takes chunks w, w + GEN_WARPS, ...: lane j scores key 32 c + j
// against the row's query (fp32 in smem; 16-B loads of the key row when L % 8 == 0), the warp takes one
// online-softmax step per chunk, then adds P V with lane j owning output columns j + 32 i (i < CS). The warps'
// (max, sum, O) are merged in smem. fp32 throughout (P is not rounded to bf16). A chunk of 32 keys costs one
// dependent chain (loads, two warp reductions, one exp per lane) where the one-warp-per-row kernel this replaces
// paid one per key: on the trained pair its 6 verify layers took 127-195 us a round
// (bench/results/engine_run11/profile_trained_norm_cap.txt).
#define GEN_WARPS 8

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// q . row over L channels (q fp32 in smem, row bf16 in global memory).
__device__ __forceinline__ float gen_dot(const float* __restrict__ sq, const bf16_t* __restrict__ row, int L) {
    float dot = 0.f;
    if ((L & 7) == 0) {   // 16-B loads: latent starts 16-B aligned and a row is L * 2 bytes, a multiple of 16
        for (int c = 0; c < L; c += 8) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + c));
            const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                dot += sq[c + 2 * k] * __uint_as_float(w[k] << 16);
                dot += sq[c + 2 * k + 1] * __uint_as_float(w[k] & 0xffff0000u);
            }
        }
    } else {
        for (int c = 0; c < L; ++c) dot += sq[c] * bf16_to_float(__ldg(row + c));
    }
    return dot;
}

template <int CS>   // output columns per lane: C <= 32 * CS
__device__ __forceinline__ void mla_generic_body(
    const bf16_t* __restrict__ q_lat, const bf16_t* __restrict__ q_pe, const bf16_t* __restrict__ latent,
    const unsigned* __restrict__ tree_mask, bf16_t* __restrict__ out, int T, int H, int C, int R, int P, int S,
    int words, float scale_log2, const int* __restrict__ seq_len) {
    if (seq_len != nullptr) {   // graph mode: S read on the device
        S = __ldg(seq_len);
        P = S - T;
    }
    extern __shared__ float gsm[];
    const int L = C + R, m = blockIdx.x, t = m / H;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float* sq = gsm;                      // [L] the query row: q_lat then q_pe
    float* so = sq + L;                   // [GEN_WARPS][C] each warp's unnormalized output
    float* sm = so + GEN_WARPS * C;       // [GEN_WARPS] running maxima, then [GEN_WARPS] sums
    for (int c = tid; c < L; c += GEN_WARPS * 32)
        sq[c] = bf16_to_float(c < C ? q_lat[(long long)m * C + c] : q_pe[(long long)m * R + c - C]);
    __syncthreads();

    float m_run = neg_inf(), l_run = 0.f, o[CS];
#pragma unroll
    for (int i = 0; i < CS; ++i) o[i] = 0.f;
    for (int k0 = warp * 32; k0 < S; k0 += GEN_WARPS * 32) {
        const int s = k0 + lane;
        const bool vis = key_visible(tree_mask, words, t, s, P, S);
        const float x = vis ? gen_dot(sq, latent + (long long)min(s, S - 1) * L, L) * scale_log2 : neg_inf();
        const float cmax = warp_max(x);
        if (cmax == neg_inf()) continue;                  // warp-uniform: no visible key in the chunk
        const float mn = fmaxf(m_run, cmax);
        const float alpha = exp2f(m_run - mn);            // 0 while m_run is -inf
        const float p = vis ? exp2f(x - mn) : 0.f;
        l_run = l_run * alpha + warp_sum(p);
        m_run = mn;
#pragma unroll
        for (int i = 0; i < CS; ++i) o[i] *= alpha;
        const int n = min(32, S - k0);
#pragma unroll 4
        for (int j = 0; j < n; ++j) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            if (pj == 0.f) continue;                      // warp-uniform
            const bf16_t* row = latent + (long long)(k0 + j) * L;
#pragma unroll
            for (int i = 0; i < CS; ++i) {
                const int c = lane + 32 * i;
                if (c < C) o[i] += pj * bf16_to_float(__ldg(row + c));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < CS; ++i) {
        const int c = lane + 32 * i;
        if (c < C) so[warp * C + c] = o[i];
    }
    if (lane == 0) {
        sm[warp] = m_run;
        sm[GEN_WARPS + warp] = l_run;
    }
    __syncthreads();
    float mx = neg_inf();
#pragma unroll
    for (int w = 0; w < GEN_WARPS; ++w) mx = fmaxf(mx, sm[w]);
    float wt[GEN_WARPS], l = 0.f;
#pragma unroll
    for (int w = 0; w < GEN_WARPS; ++w) {
        wt[w] = mx == neg_inf() ? 0.f : exp2f(sm[w] - mx);
        l += sm[GEN_WARPS + w] * wt[w];
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;            // a row that sees no key gets zeros
    for (int c = tid; c < C; c += GEN_WARPS * 32) {
        float acc = 0.f;
#pragma unroll
        for (int w = 0; w < GEN_WARPS; ++w) acc += so[w * C + c] * wt[w];
        out[(long long)m * C + c] = (bf16_t)(pack_bf16x2(acc * inv, 0.f) & 0xffffu);
    }
}

#define MLA_GENERIC(NAME, CS)                                                                                     \
    extern "C" __global__ void __launch_bounds__(GEN_WARPS * 32) NAME(                                          \
        const bf16_t* __restrict__ q_lat, const bf16_t* __restrict__ q_pe, const bf16_t* __restrict__ latent,   \
        const unsigned* __restrict__ tree_mask, bf16_t* __restrict__ out, int T, int H, int C, int R, int P,    \
        int S, int words, float scale_log2, const int* __restrict__ seq_len) {                                  \
        mla_generic_body<CS>(q_lat, q_pe, latent, tree_mask, out, T, H, C, R, P, S, words, scale_log2, seq_len); \
    }
MLA_GENERIC(mla_generic_c64, 2)
MLA_GENERIC(mla_generic_c256, 8)
MLA_GENERIC(mla_generic_c1024, 32)
