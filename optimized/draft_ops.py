"""The DFlash drafter's attention steps in few launches: the CuPy launcher of kernels/draft.cu (bf16, CUDA).

The engine's drafter forward is tiny and launch-bound (every launch ~2 us): per layer the PyTorch form of the
attention took ~10 launches and the q/k norm + RoPE + context-cache writes 6 more. Replaces, on the engine's cuda
backend (`Engine(backend="cuda")`; the torch backend keeps the reference's steps):

    head_norm_rope(x [rows, H, E] view, weight [E], eps, cos, sin)           -> [rows, H, E]
        reference.drafter.DraftAttention's q_norm then apply_rope(interleave=False), one launch
    write_keys_values(kv [rows, layers * 2 G E] view, weights [layers, E], eps, cos, sin, slots, k_cache, v_cache)
        keys_values() (k_norm, RoPE; v as projected) of one layer or of every layer at once, written into the
        context caches [layers, R * cap, G, E] at flat slots [rows], one launch
    draft_attention(q [n, B, H, E], k_cache, v_cache [R, cap, G, E], start [n], blk, max_keys, scale) -> [n*B, H*E]
        softmax(q k^T * scale) v over cache rows s < start[r] + blk of request r (the committed context and the
        block's own rows, written there first): the reference's unmasked [context; block] attention
    silu_mul(gu [rows, 2F])                                                  -> [rows, F]  silu(gate) * up
    rows_rope(start [n], offs [n], m, inv_freq, amplitude)       -> slots [n*m], cos, sin [n*m, E/2]
        the flat cache slots and RoPE angles of rows start..start+m-1 per request (the engine's _rows and
        reference.target.rope_cos_sin: ~9 launches), one launch, bit-equal

Numerics: the norm and RoPE repeat the reference's rounding steps (the RMSNorm sum is a warp tree sum, so a value
may round one bf16 step differently, as optimized.norm_rope); the attention rounds scores to bf16 as the
reference's bf16 einsum does, then keeps fp32 through an online softmax and P.V (the reference rounds P to bf16):
tested against the TOLERANCES.md kernel policy. Only the drafter uses these: they change which tokens are
proposed at worst by a rounding, never which tokens the target accepts.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from .cuda_launch import build_kernels, check_angles, check_slots, launch, ptr

_SOURCE = Path(__file__).parent / "kernels" / "draft.cu"
HNR_WARPS, HNR_MAXE = 4, 256            # head_norm_rope's block (warps) and largest head dim (the .cu's)
DA_WARPS = 4                            # draft_attention's block
ATTENTION_VARIANTS = ((1, 2), (2, 2), (4, 2), (1, 4), (2, 4), (4, 4), (8, 4), (1, 8), (2, 8), (4, 8))
KEYS_PER_SPLIT = 512                    # keys a block walks when a call splits the keys (multiple of 32 * DA_WARPS)
ONE_SPLIT_MAX = 1024                    # up to this many keys a call runs one split (no merge launch)
_LOG2E = 1.4426950408889634
KERNELS = ("head_norm_rope", "draft_attention_merge", "silu_mul", "rows_rope") + tuple(
    f"draft_attention_r{r}_c{c}" for r, c in ATTENTION_VARIANTS)


@functools.lru_cache(maxsize=None)
def _kernels(device_index: int) -> dict:
    return build_kernels(_SOURCE, KERNELS, device_index, "optimized.draft_ops")


def _bf16_cuda(what: str, **tensors):
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_cuda or t.dtype != torch.bfloat16:
            got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}: {name} must be a bfloat16 CUDA tensor (the torch backend serves others), "
                             f"got {got}")


def _head_dim(what: str, e: int):
    if e % 2 or not 0 < e <= HNR_MAXE:
        raise ValueError(f"{what}: head_dim must be even and <= {HNR_MAXE}, got {e}")


def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """x [rows, H, E] (a view of a projection's output: unit last stride) -> rope(RMSNorm(x)) [rows, H, E]."""
    _bf16_cuda("head_norm_rope", x=x, weight=weight)
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"head_norm_rope: x must be [rows, heads, head_dim] with a unit last stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    rows, h, e = x.shape
    _head_dim("head_norm_rope", e)
    if tuple(weight.shape) != (e,) or not weight.is_contiguous():
        raise ValueError(f"head_norm_rope: weight must be contiguous [{e}], got {tuple(weight.shape)}")
    check_angles("head_norm_rope", cos, sin, rows, e // 2, x.device)
    out = torch.empty(rows, h, e, dtype=x.dtype, device=x.device)
    if rows:
        warps = rows * h
        launch(_kernels(x.device.index)["head_norm_rope"], x.device, (-(-warps // HNR_WARPS),), (HNR_WARPS * 32,),
               (ptr(x), np.int64(x.stride(0)), np.int64(0), np.int64(x.stride(1)), np.int64(0), np.int32(rows),
                np.int32(1), np.int32(h), np.int32(0), np.int32(e), ptr(weight), np.float32(eps), ptr(cos), ptr(sin),
                np.uint64(0), ptr(out), np.uint64(0), np.int64(0)))
    return out


def write_keys_values(kv: torch.Tensor, weights: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """kv [rows, layers * 2 * G * E] (per layer k then v, unit last stride; a slice of a packed projection),
    weights [layers, E] (each layer's k_norm) -> k_cache[l].view(-1, G, E)[slots] = rope(norm(k)), v_cache[...]
    = v, for every layer l; caches [layers, ..., G, E] contiguous (the engine's [layers, R, cap, G, E])."""
    _bf16_cuda("write_keys_values", kv=kv, weights=weights, k_cache=k_cache, v_cache=v_cache)
    layers, e = weights.shape if weights.dim() == 2 else (0, 0)
    if not layers or not weights.is_contiguous():
        raise ValueError(f"write_keys_values: weights must be contiguous [layers, head_dim], got "
                         f"{tuple(weights.shape)}")
    _head_dim("write_keys_values", e)
    if k_cache.shape != v_cache.shape or k_cache.dim() < 3 or k_cache.shape[0] != layers \
            or k_cache.shape[-1] != e or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"write_keys_values: k_cache and v_cache must be contiguous [{layers}, ..., G, {e}] alike, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    g = k_cache.shape[-2]
    rows = kv.shape[0]
    if kv.dim() != 2 or kv.shape[1] != layers * 2 * g * e or kv.stride(-1) != 1:
        raise ValueError(f"write_keys_values: kv must be [rows, {layers * 2 * g * e}] (layers x k|v x {g} heads x "
                         f"{e}) with a unit last stride, got shape {tuple(kv.shape)} strides {kv.stride()}")
    check_slots("write_keys_values", slots, rows, kv.device)
    check_angles("write_keys_values", cos, sin, rows, e // 2, kv.device)
    if rows:
        warps = rows * layers * 2 * g
        launch(_kernels(kv.device.index)["head_norm_rope"], kv.device, (-(-warps // HNR_WARPS),), (HNR_WARPS * 32,),
               (ptr(kv), np.int64(kv.stride(0)), np.int64(2 * g * e), np.int64(e), np.int64(g * e), np.int32(rows),
                np.int32(layers), np.int32(g), np.int32(1), np.int32(e), ptr(weights), np.float32(eps), ptr(cos),
                ptr(sin), ptr(slots), ptr(k_cache), ptr(v_cache), np.int64(k_cache[0].numel())))


def attention_kernel(rep: int, e: int) -> str:
    """The draft_attention variant for `rep` query heads per kv head and head_dim e (or a clear error)."""
    r, c = _variant(rep, e)
    return f"draft_attention_r{r}_c{c}"


def _variant(rep: int, e: int):
    for r, c in ATTENTION_VARIANTS:
        if rep <= r and e <= 32 * c:
            return r, c
    raise ValueError(f"draft_attention: {rep} query heads per kv head with head_dim {e} has no kernel variant "
                     f"(built: rep <= 8 with head_dim <= 128, rep <= 4 with head_dim <= 256); use "
                     "Engine(backend='torch') for this drafter")


def splits_for(max_keys: int) -> int:
    """Key splits of a call over at most max_keys keys: one (no merge launch) up to ONE_SPLIT_MAX keys."""
    return 1 if max_keys <= ONE_SPLIT_MAX else -(-max_keys // KEYS_PER_SPLIT)


def draft_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor, blk: int,
                    max_keys: int, scale: float) -> torch.Tensor:
    """q [n, B, H, E] contiguous; caches [>= n, cap, G, E] contiguous (request r's rows at [r]); start int64 [n]
    on the device: request r sees cache rows s < min(start[r] + blk, max_keys). Returns [n * B, H * E]."""
    _bf16_cuda("draft_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    if q.dim() != 4 or not q.is_contiguous():
        raise ValueError(f"draft_attention: q must be contiguous [n, B, heads, head_dim], got shape "
                         f"{tuple(q.shape)} strides {q.stride()}")
    n, b, h, e = q.shape
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[0] < n or k_cache.shape[-1] != e \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"draft_attention: caches must be contiguous [>= {n}, cap, G, {e}] alike, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    cap, g = k_cache.shape[1], k_cache.shape[2]
    if h % g:
        raise ValueError(f"draft_attention: {h} query heads are not a multiple of {g} kv heads")
    if not 0 < max_keys <= cap:
        raise ValueError(f"draft_attention: max_keys must be in 1..{cap} (the cache rows), got {max_keys}")
    if start.dtype != torch.long or tuple(start.shape) != (n,) or start.device != q.device:
        raise ValueError(f"draft_attention: start must be int64 [{n}] on {q.device}, got {start.dtype} "
                         f"{tuple(start.shape)}")
    if e % 8 == 0 and (k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16):
        raise ValueError("draft_attention: the caches must be 16-byte aligned")
    rep = h // g
    r_max, _ = _variant(rep, e)
    out = torch.empty(n * b, h * e, dtype=q.dtype, device=q.device)
    splits = splits_for(max_keys)
    kps = ONE_SPLIT_MAX if splits == 1 else KEYS_PER_SPLIT
    part_o = part_ml = None
    if splits > 1:
        part_o = torch.empty(n * g * b, splits, rep, e, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(n * g * b, splits, rep, 2, dtype=torch.float32, device=q.device)
    kernels = _kernels(q.device.index)
    smem = 4 * (r_max * e * (1 + DA_WARPS) + DA_WARPS * r_max * 2)
    launch(kernels[attention_kernel(rep, e)], q.device, (splits, b, n * g), (DA_WARPS * 32,),
           (ptr(q), ptr(k_cache), ptr(v_cache), ptr(out), ptr(part_o), ptr(part_ml), ptr(start), np.int32(blk),
            np.int32(b), np.int32(g), np.int32(rep), np.int32(e), np.int64(cap * g * e), np.int32(kps),
            np.int32(max_keys), np.float32(scale * _LOG2E)), shared_mem=smem)
    if splits > 1:
        launch(kernels["draft_attention_merge"], q.device, (n * g * b,), (DA_WARPS * 32,),
               (ptr(part_o), ptr(part_ml), ptr(out), np.int32(splits), np.int32(b), np.int32(g), np.int32(rep),
                np.int32(e)))
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [rows, 2F] contiguous (gate | up, one GEMM's output) -> bf16(silu(gate)) * up [rows, F]."""
    _bf16_cuda("silu_mul", gu=gu)
    if gu.dim() != 2 or gu.shape[1] % 2 or not gu.is_contiguous():
        raise ValueError(f"silu_mul: gu must be contiguous [rows, 2F], got shape {tuple(gu.shape)}")
    rows, f = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, f, dtype=gu.dtype, device=gu.device)
    if rows * f:
        launch(_kernels(gu.device.index)["silu_mul"], gu.device, (-(-(rows * f) // 256),), (256,),
               (ptr(gu), np.int64(rows), np.int32(f), ptr(out)))
    return out


def rows_rope(start: torch.Tensor, offs: torch.Tensor, m: int, inv_freq: torch.Tensor, amplitude: float):
    """Requests r < n = len(start): rows start[r] + i, i < m -> (flat slots start[r] + i + offs[r] int64 [n * m],
    cos, sin float32 [n * m, half]) = reference.target.rope_cos_sin(inv_freq, positions, amplitude), bit-equal."""
    n = start.shape[0] if start.dim() == 1 else -1
    for name, t in (("start", start), ("offs", offs)):
        if not t.is_cuda or t.dtype != torch.long or tuple(t.shape) != (n,) or not t.is_contiguous():
            raise ValueError(f"rows_rope: {name} must be contiguous int64 [n] on the GPU, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or not inv_freq.is_contiguous() \
            or inv_freq.device != start.device:
        raise ValueError(f"rows_rope: inv_freq must be contiguous float32 [half] on {start.device}, got "
                         f"{inv_freq.dtype} {tuple(inv_freq.shape)} on {inv_freq.device}")
    half = inv_freq.shape[0]
    slots = torch.empty(n * m, dtype=torch.long, device=start.device)
    cos = torch.empty(n * m, half, dtype=torch.float32, device=start.device)
    sin = torch.empty_like(cos)
    if n * m * half:
        launch(_kernels(start.device.index)["rows_rope"], start.device, (-(-(n * m * half) // 256),), (256,),
               (ptr(start), ptr(offs), np.int32(n), np.int32(m), ptr(inv_freq), np.int32(half),
                np.float32(amplitude), ptr(slots), ptr(cos), ptr(sin)))
    return slots, cos, sin
