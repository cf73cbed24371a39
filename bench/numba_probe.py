"""Probe: two trivial Numba kernels over the [15, 163840] fp32 logits in topk_stats' grid of 210 blocks (one read
and a per-block sum; the same plus an fp64 exp per element) against torch.amax, to separate the cost of reading the
logits in that grid from the tree kernels' own work. Prints microseconds of device execution."""
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "conformance")]
from optimized import _numba_compat  # noqa: E402,F401  (first: the numpy.row_stack shim)
from numba import cuda  # noqa: E402
from test_tree_numba import event_median  # noqa: E402


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


x = torch.randn(15, 163840, device="cuda") * 3
out = torch.zeros(15, 14, device="cuda", dtype=torch.float64)
outf = torch.zeros(15, 14, device="cuda")
xa = cuda.as_cuda_array(x)
s = cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def t(fn) -> float:
    """Median microseconds of device execution (the tree bench's timer)."""
    return event_median(fn, ahead=True) * 1e6


print("torch amax      %.1f us" % t(lambda: torch.amax(x, dim=1)))
print("numba rowsum    %.1f us" % t(lambda: rowsum[(14, 15), 256, s](xa, 12288, cuda.as_cuda_array(outf))))
print("numba rowexp64  %.1f us" % t(lambda: rowexp[(14, 15), 256, s](xa, 12288, cuda.as_cuda_array(out))))
