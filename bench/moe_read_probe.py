"""Read-only probe for the routed experts' gate/up: is its bandwidth the weight access pattern or the math? Streams
the gate/up bytes of A random experts (default 8, T = 1's count; `--experts 152` is the K2.6 engine's count at 65
rows; K2.6: 256 tiles x 112 chunks x (512 B words + 64 B scales) per expert, the layout of optimized/moe.py) three
ways and reports TB/s (median over fresh expert sets):
  tile   one warp per 16-row tile, chunks in order, U chunks per register stage double-buffered (gemm_item's
         loads without the dequant and mma)
  tile2  the same with two warps per tile (each half of K)
  flat   the same bytes as 8 contiguous regions, grid-stride 16-byte loads, 4 in flight per thread
    python bench/moe_read_probe.py [--experts A]
"""
import argparse
import os
import sys

import cupy
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "conformance")]
from optimized.cuda_launch import launch, ptr as p  # noqa: E402
from test_moe_kernels import event_times, median  # noqa: E402

SRC = r"""
typedef unsigned int u32;
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 ld_stream32(const u32* p) {
  u32 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
template <int U, int S>
__global__ void __launch_bounds__(256) tile_read(const uint4* wq, const u32* ws, const int* experts, int R, int C,
                                                 int n_items, u32* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int per_block = 8 / S, part = warp % S;
  u32 acc = 0;
  for (int item = blockIdx.x * per_block + warp / S; item < n_items; item += gridDim.x * per_block) {
    const int a = item / R, r = item - a * R;
    const size_t tile = (size_t)experts[a] * R + r;
    const int cb = part * C / S, ce = (part + 1) * C / S, Cn = ce - cb;
    const uint4* wt = wq + (tile * C + cb) * 32 + lane;
    const u32* st = ws + (tile * C + cb) * 16 + (g * 2 + (t >> 1));
    uint4 cw[U]; u32 cs[U];
#pragma unroll
    for (int u = 0; u < U; ++u) if (u < Cn) { cw[u] = ld_stream(wt + (size_t)u * 32); cs[u] = ld_stream32(st + (size_t)u * 16); }
    for (int c0 = 0; c0 < Cn; c0 += U) {
      uint4 nw[U]; u32 ns[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + U + u;
        if (c < Cn) { nw[u] = ld_stream(wt + (size_t)c * 32); ns[u] = ld_stream32(st + (size_t)c * 16); }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) if (c0 + u < Cn) acc ^= cw[u].x ^ cw[u].y ^ cw[u].z ^ cw[u].w ^ cs[u];
#pragma unroll
      for (int u = 0; u < U; ++u) { cw[u] = nw[u]; cs[u] = ns[u]; }
    }
  }
  if (acc == 0x12345678u) out[0] = acc;
}
__global__ void __launch_bounds__(256) flat_read(const uint4* wq, const u32* ws, const int* experts, long long words,
                                                 long long swords, int n_exp, u32* out) {
  u32 acc = 0;
  const long long n = (long long)n_exp * words, stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long k = i + j * stride;
      if (k < n) v[j] = ld_stream(wq + (size_t)experts[k / words] * words + k % words);
      else v[j] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  const long long ns = (long long)n_exp * swords;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < ns; i += stride)
    acc ^= ld_stream32(ws + (size_t)experts[i / swords] * swords + i % swords);
  if (acc == 0x12345678u) out[0] = acc;
}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8, help="distinct experts per call (1..384)")
    E, R, C, A = 384, 256, 112, ap.parse_args().experts
    if not 1 <= A <= E:
        ap.error(f"--experts must be in 1..{E}, got {A}")
    wq = torch.randint(-2**31, 2**31 - 1, (E, R, C, 32, 4), dtype=torch.int32, device="cuda")
    ws = torch.randint(-2**31, 2**31 - 1, (E, R, C, 16), dtype=torch.int32, device="cuda")
    nbytes = A * R * C * (512 + 64)
    names = ["tile_read<4,1>", "tile_read<2,1>", "tile_read<8,1>", "tile_read<2,2>", "tile_read<4,2>"]
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names + ["flat_read"])
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(0)
    sets = [torch.randperm(E, generator=gen)[:A].to(torch.int32).cuda() for _ in range(20)]
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for name in names:
        f = mod.get_function(name)
        s = int(name.split(",")[1][0])
        for bps in (2, 3, 4):
            grid = min(sm * bps, -(-A * R // (8 // s)))
            fns = [(lambda e=e: launch(f, dev, (grid,), (256,), (p(wq), p(ws), p(e), np.int32(R), np.int32(C),
                                                              np.int32(A * R), p(out)))) for e in sets]
            fns[0]()
            us = median(event_times(fns)) * 1e6
            rows.append((f"{name} {bps} blocks/SM", us))
            print(f"{rows[-1][0]:28s} {us:7.1f} us  {nbytes / us / 1e6:5.2f} TB/s", flush=True)
    f = mod.get_function("flat_read")
    for bps in (4, 8):
        fns = [(lambda e=e: launch(f, dev, (sm * bps,), (256,), (p(wq), p(ws), p(e), np.int64(R * C * 32),
                                                                np.int64(R * C * 16), np.int32(A), p(out)))) for e in sets]
        fns[0]()
        us = median(event_times(fns)) * 1e6
        rows.append((f"flat_read {bps} blocks/SM", us))
        print(f"{rows[-1][0]:28s} {us:7.1f} us  {nbytes / us / 1e6:5.2f} TB/s", flush=True)
    print(f"{nbytes / 1e6:.0f} MB per call ({A} experts' gate/up words + scales)")


if __name__ == "__main__":
    main()
