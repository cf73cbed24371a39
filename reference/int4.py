"""INT4 weights exactly as compressed-tensors `pack-quantized` stores them (Kimi K2-Thinking/K2.5/K2.6).

Legend: N = output features (rows), K = input features (columns), G = group size (32 for Kimi).

  weight_packed  int32 [N, K/8]   eight 4-bit values per word; column k sits in word k // 8 at bits
                                  4*(k % 8) .. 4*(k % 8)+3 (lowest column in the least significant nibble)
  weight_scale   bf16  [N, K/G]   one scale per row and group of G columns
  weight_shape   int   [2]        (N, K); int64 from compressed-tensors, int32 accepted
Each nibble holds u = q + 8 for the signed value q in [-8, 7] (symmetric, no zero point), and
    w[n, k] = q[n, k] * scale[n, k // G]
computed in the scale's dtype (bf16 for Kimi: `bf16(q * s)`, what Marlin-style kernels produce).
"""
from __future__ import annotations

import torch

__all__ = ["pack_int4", "unpack_int4", "dequantize", "quantize"]

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)          # [8]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 values [N, K] (any int dtype, each in [-8, 7], K % 8 == 0) -> int32 [N, K/8]."""
    if q.dim() != 2 or q.shape[1] % 8:
        raise ValueError(f"pack_int4: need a 2-D tensor with columns divisible by 8, got {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("pack_int4: values must lie in [-8, 7]")
    u = (q.to(torch.int64) + 8).reshape(q.shape[0], -1, 8)     # [N, K/8, 8] nibbles 0..15
    words = (u << _SHIFTS.to(q.device, torch.int64)).sum(-1)   # [N, K/8] in 0 .. 2^32-1
    return (words - ((words >> 31) << 32)).to(torch.int32)     # unsigned 32-bit -> signed int32 view


def unpack_int4(packed: torch.Tensor, shape) -> torch.Tensor:
    """int32 [N, K/8] -> signed int8 [N, K] (K = shape[1], trailing padding nibbles dropped)."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"unpack_int4: need int32 [N, K/8], got {packed.dtype} {tuple(packed.shape)}")
    n, k = int(shape[0]), int(shape[1])
    if packed.shape[0] != n or packed.shape[1] * 8 < k:
        raise ValueError(f"unpack_int4: packed {tuple(packed.shape)} cannot hold weight_shape {(n, k)}")
    u = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF   # [N, K/8, 8]; & 0xF undoes the sign
    return (u.reshape(n, -1)[:, :k] - 8).to(torch.int8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape, group_size: int = 32,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """`(u - 8) * scale` -> [N, K] in `dtype` (default: the scale's dtype, so bf16 for real checkpoints).

    The product is formed in the scale's dtype first, then cast: bf16(q * s) for bf16 scales.
    """
    n, k = int(shape[0]), int(shape[1])
    if scale.shape != (n, -(-k // group_size)):
        raise ValueError(f"dequantize: weight_scale {tuple(scale.shape)} does not match weight_shape {(n, k)} "
                         f"with group_size {group_size}")
    q = unpack_int4(packed, shape)                                        # [N, K] int8
    w = q.to(scale.dtype) * scale.repeat_interleave(group_size, dim=1)[:, :k]
    return w if dtype is None else w.to(dtype)


def quantize(w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16):
    """Symmetric round-to-nearest INT4 with per-group absmax scales, as compressed-tensors' minmax observer
    and `quantize` do it (bit-exact with the library; see conformance/test_int4.py).

    Returns (weight_packed int32 [N, K/8], weight_scale [N, K/G] in `scale_dtype`, weight_shape int64 [2]).
    scale = absmax / 7.5 (float32, then rounded to `scale_dtype`; an all-zero group gets the dtype's eps),
    q = clamp(round(w / scale), -8, 7) with the division done in the promoted dtype of w and the scale.
    """
    n, k = w.shape
    if k % group_size or k % 8:
        raise ValueError(f"quantize: K={k} must be divisible by group_size={group_size} and by 8")
    g = w.reshape(n, k // group_size, group_size)                            # [N, K/G, G]
    scale = (g.float().abs().amax(-1, keepdim=True) / 7.5).to(scale_dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale_dtype).eps, dtype=scale_dtype), scale)
    div = torch.promote_types(w.dtype, scale_dtype)
    q = torch.clamp(torch.round(g.to(div) / scale.to(div)), -8, 7).to(torch.int8).reshape(n, k)
    return pack_int4(q), scale.squeeze(-1), torch.tensor([n, k], dtype=torch.int64)
