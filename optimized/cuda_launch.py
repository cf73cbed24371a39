"""Launching CuPy RawKernels on torch's current stream with raw device pointers (shared by the MoE, norm/RoPE,
drafter and greedy kernels): building CuPy array views per call would cost microseconds per tensor. Plus the
argument checks those launchers share (RoPE angles, cache slots)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

_STREAMS: dict = {}


def launch(fn, device: torch.device, grid, block, args, shared_mem: int = 0) -> None:
    """Run CuPy function `fn` on `device`'s current torch stream (graph capture included)."""
    import cupy
    ptr = torch.cuda.current_stream(device).cuda_stream
    stream = _STREAMS.get(ptr)
    if stream is None:
        stream = _STREAMS.setdefault(ptr, cupy.cuda.ExternalStream(ptr, device.index))
    with cupy.cuda.Device(device.index), stream:
        fn(grid, block, args, shared_mem=shared_mem)


def ptr(t: Optional[torch.Tensor]):
    """A tensor's device address as a kernel argument (0 for None)."""
    return np.uint64(0 if t is None else t.data_ptr())


def build_kernels(source: Path, names: Sequence[str], device_index: int, what: str) -> dict:
    """Compile a .cu file with CuPy (NVRTC, -std=c++17; CuPy adds -arch for the device) -> {name: function}.
    Callers cache the result per device (functools.lru_cache on their own `_kernels`)."""
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError(f"{what} needs CuPy (pip install cupy-cuda13x) and a CUDA GPU") from e
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=Path(source).read_text(), options=("-std=c++17",))
        return {n: module.get_function(n) for n in names}


def check_angles(what: str, cos: torch.Tensor, sin: torch.Tensor, rows: int, half: int, device) -> None:
    """ValueError unless cos and sin are contiguous float32 [rows, half] on `device` (rope_cos_sin's output)."""
    for name, a in (("cos", cos), ("sin", sin)):
        if a.dtype != torch.float32 or tuple(a.shape) != (rows, half) or not a.is_contiguous() or a.device != device:
            raise ValueError(f"{what}: {name} must be contiguous float32 [{rows}, {half}] on {device}, got "
                             f"{a.dtype} {tuple(a.shape)} on {a.device}")


def check_slots(what: str, slots: torch.Tensor, rows: int, device) -> None:
    """ValueError unless slots is a contiguous int64 [rows] tensor on `device` (flat cache rows to write)."""
    if slots.dtype != torch.long or tuple(slots.shape) != (rows,) or not slots.is_contiguous() \
            or slots.device != device:
        raise ValueError(f"{what}: slots must be contiguous int64 [{rows}] on {device}, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {slots.device}")
