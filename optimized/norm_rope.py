"""RMSNorm and RoPE as one CuPy RawKernel launch each (optimized/kernels/norm_rope.cu), bf16 on CUDA.

The reference forms them from small PyTorch kernels (RMSNorm: 8, RoPE: about 10); in the engine's tiny,
launch-bound forwards those launches were over half of the drafter's and a third of the target's. The kernels
keep the reference's rounding steps (see the .cu header): RoPE is bit-exact; RMSNorm sums x^2 in a different
fp32 order, so it can differ from `reference.target.RMSNorm` by one bf16 step where the fp32 result sits on a
rounding boundary (tested against the tolerance policy).

    rms_norm(x [..., D], weight [D], eps)             -> new contiguous [..., D]
    rope(x [T, ..., R], cos [T, R/2], sin [T, R/2], interleave) -> new contiguous [T, ..., R]
    latent_rows(kv [T, C+R], weight [C], eps, cos, sin, interleave, slots [T], latent [S, C+R])
        -> latent[slots[t]] = cat(rms_norm(kv[t, :C]), rope(kv[t, C:])) in place (the target's cache rows)

Inputs may be views (a split of a projection's output) as long as the last dim is contiguous and the leading
dims are laid out with one uniform row stride, or (rms_norm) as [..., heads, D] rows with one stride between
heads and one between the groups of heads (the head split of a fused q/k/v projection); other layouts raise
(call .contiguous() first).
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import torch

from .cuda_launch import build_kernels, check_angles, check_slots, launch, ptr

_SOURCE = Path(__file__).parent / "kernels" / "norm_rope.cu"
KERNELS = ("rms_norm_bf16", "rms_norm_bf16_v8", "rope_bf16", "latent_rows_bf16")


@functools.lru_cache(maxsize=None)
def _kernels(device_index: int) -> dict:
    return build_kernels(_SOURCE, KERNELS, device_index, "optimized.norm_rope")


def _check(what: str, x: torch.Tensor):
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        raise ValueError(f"{what}: needs a CUDA tensor (CPU: use the reference module), got "
                         f"{x.device if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{what}: needs bfloat16, got {x.dtype} (the reference module serves other dtypes)")
    if x.dim() < 2 or x.stride(-1) != 1:
        raise ValueError(f"{what}: needs >= 2 dims with a contiguous last dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")


def _rows(what: str, x: torch.Tensor, shape) -> torch.Tensor:
    """x viewed as `shape` without a copy (its rows one uniform stride apart), or raise."""
    try:
        return x.view(shape)
    except RuntimeError:
        raise ValueError(f"{what}: shape {tuple(x.shape)} strides {x.stride()} cannot be viewed as rows of one "
                         "uniform stride; pass x.contiguous()") from None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.target.RMSNorm(x) with that module's weight and eps, in one launch."""
    _check("rms_norm", x)
    d = x.shape[-1]
    if weight.dtype != torch.bfloat16 or tuple(weight.shape) != (d,) or not weight.is_contiguous() \
            or weight.device != x.device:
        raise ValueError(f"rms_norm: weight must be contiguous bfloat16 [{d}] on {x.device}, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    rows = math.prod(x.shape[:-1])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    per = 1
    try:
        stride, stride1 = x.view(rows, d).stride(0), 0
    except RuntimeError:                       # a head split of a wider row: [a, per, d] with two strides (a
        per = x.shape[-2]                      #   2-D x with a unit last stride always views as [rows, d])
        x3 = _rows("rms_norm", x, (rows // per, per, d))
        stride, stride1 = x3.stride(0), x3.stride(1)
    kernels = _kernels(x.device.index)
    if norm_path(x, stride, weight, stride1) == "v8":
        threads = min(1024, max(32, -(-(d // 8) // (NORM_NV * 32)) * 32))
        launch(kernels["rms_norm_bf16_v8"], x.device, (rows,), (threads,),
               (ptr(x), np.int64(stride // 8), np.int64(stride1 // 8), np.int32(per), ptr(weight), np.float32(eps),
                np.int32(d), ptr(out)))
    else:
        launch(kernels["rms_norm_bf16"], x.device, (rows,), (32 if d <= 1024 else 256,),
               (ptr(x), np.int64(stride), np.int64(stride1), np.int32(per), ptr(weight), np.float32(eps),
                np.int32(d), ptr(out)))
    return out


NORM_NV = 4          # 16-byte vectors per thread of rms_norm_bf16_v8 (NORM_NV in the .cu)


def norm_path(x: torch.Tensor, stride: int, weight: torch.Tensor, stride1: int = 0) -> str:
    """Which rms_norm kernel a call runs: "v8" (16-byte loads, the row in registers) when x's start, its row
    strides, d and the weight are 16-byte aligned and d <= 8 * NORM_NV * 1024, else "generic" (any layout)."""
    d = x.shape[-1]
    aligned = x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0 and stride % 8 == 0 and stride1 % 8 == 0 \
        and d % 8 == 0
    return "v8" if aligned and d <= 8 * NORM_NV * 1024 else "generic"


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = True) -> torch.Tensor:
    """reference.target.apply_rope(x, cos, sin, interleave) in one launch (bit-exact)."""
    _check("rope", x)
    t, r = x.shape[0], x.shape[-1]
    if r % 2:
        raise ValueError(f"rope: the rotary dim must be even, got {r}")
    check_angles("rope", cos, sin, t, r // 2, x.device)
    per_t = math.prod(x.shape[1:-1])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    pairs = t * per_t * (r // 2)
    if pairs == 0:
        return out
    x3 = _rows("rope", x, (t, per_t, r))
    launch(_kernels(x.device.index)["rope_bf16"], x.device, (-(-pairs // 256),), (256,),
           (ptr(x), np.int64(x3.stride(0)), np.int64(x3.stride(1)), np.int32(per_t), np.int32(r),
            np.int32(int(interleave)), ptr(cos), ptr(sin), np.int64(pairs), ptr(out)))
    return out


def latent_rows(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                interleave: bool, slots: torch.Tensor, latent: torch.Tensor) -> None:
    """reference.target.Attention.project's latent rows, cat([kv_a_layernorm(kv[:, :C]), rope(kv[:, C:])]),
    written at latent[slots[t]] in one launch (the engine's four: norm, rope, cat, index_copy). kv: [T, C+R] bf16
    rows with a unit last stride (a view of the kv_a projection's output); latent: contiguous [S, C+R]. Bits:
    the norm equals rms_norm's (C % 8 == 0, C <= 1024: the 16-byte kernel's order), the rotation rope's."""
    _check("latent_rows", kv)
    if kv.dim() != 2:
        raise ValueError(f"latent_rows: kv must be [T, C+R], got shape {tuple(kv.shape)}")
    t, row = kv.shape
    c = weight.shape[0] if weight.dim() == 1 else -1
    r = row - c
    if weight.dtype != torch.bfloat16 or weight.dim() != 1 or not weight.is_contiguous() or weight.device != kv.device:
        raise ValueError(f"latent_rows: weight must be contiguous bfloat16 [C] on {kv.device}, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if c % 8 or not 0 < c <= 1024 or r <= 0 or r % 2:
        raise ValueError(f"latent_rows: needs C % 8 == 0, C <= 1024 and an even rotary part, got C = {c}, "
                         f"R = {r} (use rms_norm and rope)")
    check_angles("latent_rows", cos, sin, t, r // 2, kv.device)
    check_slots("latent_rows", slots, t, kv.device)
    if latent.dtype != torch.bfloat16 or latent.dim() != 2 or latent.shape[1] != row or not latent.is_contiguous() \
            or latent.device != kv.device:
        raise ValueError(f"latent_rows: latent must be a contiguous bfloat16 [S, {row}] cache on {kv.device}, got "
                         f"{latent.dtype} {tuple(latent.shape)} on {latent.device}")
    if t:
        launch(_kernels(kv.device.index)["latent_rows_bf16"], kv.device, (t,), (32,),
               (ptr(kv), np.int64(kv.stride(0)), np.int32(c), np.int32(r), ptr(weight), np.float32(eps),
                np.int32(int(interleave)), ptr(cos), ptr(sin), ptr(slots), ptr(latent)))
