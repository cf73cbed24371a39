"""Greedy choices: argmax over the vocabulary per row in one CuPy launch (kernels/greedy.cu), exactly
torch.argmax(-1) (the first index of the maximum; NaN counts as the maximum). torch's reduction took 15 us for the
engine's [17, 4096] verify logits; this is the commit stage's greedy choice on the cuda backend. A row longer than
one chunk (CHUNK_BYTES) is split over several blocks whose last one reduces the partials (one zeroed ticket per row
is the only other launch).

    argmax_rows(x [rows, V] bfloat16 or float32 CUDA, unit last stride) -> int64 [rows]
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from .cuda_launch import build_kernels, launch, ptr

_SOURCE = Path(__file__).parent / "kernels" / "greedy.cu"
KERNELS = {torch.bfloat16: "argmax_bf16", torch.float32: "argmax_f32"}
THREADS = 256                                  # AM_THREADS in the .cu
CHUNK_BYTES = THREADS * 4 * 16                 # AM_UNROLL 16-byte words per thread: one block's share of a row


@functools.lru_cache(maxsize=None)
def _kernels(device_index: int) -> dict:
    return build_kernels(_SOURCE, tuple(KERNELS.values()), device_index, "optimized.greedy")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_cuda or x.dtype not in KERNELS:
        got = f"{x.dtype} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"argmax_rows: needs a bfloat16 or float32 CUDA tensor (torch.argmax serves others), "
                         f"got {got}")
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows: needs [rows, V > 0] with a unit last stride, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    rows, v = x.shape
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    per = 16 // x.element_size()
    vec = int(x.data_ptr() % 16 == 0 and x.stride(0) % per == 0 and v % per == 0)
    chunks = -(-v * x.element_size() // CHUNK_BYTES)
    if chunks > 65535:
        raise ValueError(f"argmax_rows: V = {v} is longer than {65535 * CHUNK_BYTES // x.element_size()} values")
    part_v = part_i = ticket = None
    if chunks > 1:
        part_v = torch.empty(rows * chunks, dtype=torch.float32, device=x.device)
        part_i = torch.empty(rows * chunks, dtype=torch.long, device=x.device)
        ticket = torch.zeros(rows, dtype=torch.int32, device=x.device)
    if rows:
        launch(_kernels(x.device.index)[KERNELS[x.dtype]], x.device, (rows, chunks), (THREADS,),
               (ptr(x), np.int64(x.stride(0)), np.int32(v), np.int32(vec), ptr(part_v), ptr(part_i), ptr(ticket),
                ptr(out)))
    return out
