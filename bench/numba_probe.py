"""Probe: a trivial Numba kernel over the [15, 163840] fp32 logits (one read, a per-block sum) against
torch.amax, to separate Numba's code generation from the tree kernels' algorithms. Prints microseconds."""
import sys
import os
sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]
import numpy as np
import torch
from optimized import _numba_compat  # noqa: F401
from numba import cuda

EPT = 16


@cuda.jit
def rowsum(x, chunk, out):
    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    T = cuda.blockDim.x
    lo = p * chunk
    hi = min(x.shape[1], lo + chunk)
    s = np.float32(0)
    for i in range(lo + tid, hi, T):
        s += x[row, i]
    sh = cuda.shared.array(1024, np.float32)
    sh[tid] = s
    cuda.syncthreads()
    if tid == 0:
        t = np.float32(0)
        for j in range(T):
            t += sh[j]
        out[row, p] = t


@cuda.jit
def rowexp(x, chunk, out):
    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    T = cuda.blockDim.x
    lo = p * chunk
    hi = min(x.shape[1], lo + chunk)
    s = 0.0
    for i in range(lo + tid, hi, T):
        s += math.exp(np.float64(x[row, i]))
    out[row, p] = s


import math  # noqa: E402

x = torch.randn(15, 163840, device="cuda") * 3
out = torch.zeros(15, 14, device="cuda", dtype=torch.float64)
outf = torch.zeros(15, 14, device="cuda")
xa = cuda.as_cuda_array(x)
s = cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def t(fn, n=50):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        torch.cuda._sleep(4_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[len(ts) // 2]


print("torch amax      %.1f us" % t(lambda: torch.amax(x, dim=1)))
print("numba rowsum    %.1f us" % t(lambda: rowsum[(14, 15), 256, s](xa, 12288, cuda.as_cuda_array(outf))))
print("numba rowexp64  %.1f us" % t(lambda: rowexp[(14, 15), 256, s](xa, 12288, cuda.as_cuda_array(out))))
