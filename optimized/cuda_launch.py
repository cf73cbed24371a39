"""Launching CuPy RawKernels on torch's current stream with raw device pointers (shared by the MoE and the
norm/RoPE kernels): building CuPy array views per call would cost microseconds per tensor."""
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
