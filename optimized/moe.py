"""INT4 (W4A16) MoE for Kimi K2.6-class layers: CuPy RawKernels (optimized/kernels/moe_*.cu) over a layout
repacked once at load. Replaces reference.target.MoE.forward and its parts, with the same semantics.

Legend: T tokens, D hidden, F expert intermediate, E routed experts (global), L experts held here,
K experts per token, P = T*K token-expert pairs, A = min(L, P) slots for active experts, G quant group,
Dp / Fp = D / F rounded up to 64, R = rows / 16 (weight tiles), C = Dp / 64 or Fp / 64 (k chunks).

Stages (each a function below; no host synchronisation anywhere, so the whole layer can be graph-captured):
  router        logits = x.float() @ W_r.float().T in fp32 (moe_router_gemm's 8 column-slice partials up to 32
                tokens, cuBLAS above), then `route` (kernel; adds the partials in order)
  group_tokens  pairs sorted by expert + the active-expert table (moe_group; one warp for <= 32 pairs)
  gate_up       fused dequant GEMM of gate and up with SwiGLU -> h [P, Fp] bf16 (moe_int4_gemm EPI 0)
  group_gate_up both in one launch for <= 32 pairs (moe_int4_gate_up_grouped; what moe_routed runs there)
  down          dequant GEMM -> y [P, D] fp32 (moe_int4_gemm EPI 1)
  gate_up_down  gate_up then down in one launch (moe_int4_fused; what moe_routed runs)
  combine       out[t] = sum_k w[t,k] y[pos(t,k)] (+ shared expert), fp32 sums (moe_combine)
  moe_forward   all of them + the shared expert through torch (cuBLAS, bf16)
Expert parallel: MoEWeights may hold any subset of the experts (`global_to_local`); pairs routed elsewhere are
skipped and `moe_forward(..., partial=True)` returns this rank's fp32 partial sum for the all-reduce.

Weight layout (`repack`; `unrepack` inverts it bit for bit). Per expert and matrix W [N, K] (N out, K in),
K padded to Kp = 64*C with q = 0, scale 0:
  words  int32 [N/16, C, 32, 4]      tile r, k chunk c, lane l = 4g + t, word s (k-step s of mma m16n8k16)
  scales bf16  [N/16, C, 8, 2, 2]    [r, c, g, gh, rh] = scale of row 16r + 8rh + g, group 2c + gh
Inside a chunk, fragment slot j (0..3) of k-step s for lane t reads physical column
k = 64c + 32*(s // 2) + 8t + 4*(s % 2) + j: k-steps 0-1 cover scale group 2c, k-steps 2-3 group 2c + 1, and a
lane's activations per chunk are two runs of 8 (two 16-byte loads, 32 columns apart). The kernel multiplies the
exact q (bf16) by the activations, sums each group's two k-steps in fp32, then adds scale * sum into the fp32
accumulator: the scale is never rounded into the weight (the reference rounds q * s to bf16 first, so results
agree within that rounding, and this is nearer the float64 value).
Nibble p of a word (u = q + 8) is row 16r + g + 8*(p & 1), slot j = 2*((p >> 1) & 1) + (p >> 2): the kernel
takes nibble pairs (i, i+4) with one LOP3 into the bf16x2 register the mma A operand wants.
gate and up are interleaved by tile: rows 0-7 of tile r are gate rows 8r..8r+7, rows 8-15 the up rows of the
same channels, so SwiGLU happens in registers. Group sizes that are multiples of 32 are stored per 32.
All experts of a rank are stacked: w13 [L, F/8, Dp/64, 32, 4], s13 [L, F/8, Dp/64, 8, 2, 2],
w2 [L, D/16, Fp/64, 32, 4], s2 [L, D/16, Fp/64, 8, 2, 2].

Launch arguments are raw device pointers (`data_ptr`, the address `__cuda_array_interface__` exposes: zero
copy) on torch's current stream; building CuPy views per call would cost microseconds per tensor.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from reference.int4 import pack_int4

from .cuda_launch import launch, ptr as _p

__all__ = ["MoEWeights", "Grouping", "compile_target", "repack", "unrepack", "pack_experts", "load_moe_weights", "route", "router",
           "router_parts", "router_logits", "router_path", "group_tokens", "pick_variant", "gate_up", "down", "gate_up_down", "combine", "moe_routed", "shared_expert", "moe_forward"]

_KERNELS = Path(__file__).resolve().parent / "kernels"
# (NT n-tiles of 8 tokens per pass, U chunks per register stage, XB chunks per activation batch, S warps per
# item splitting K): the instantiations compiled (each also in the .cu's MOE_NVCC_CHECK list). (1, 4, 4, 1) was
# the fastest unsplit variant on the H200 at every T from 1 to 256 (bench/results/moe_int4.md); NT=4 serves
# experts with > 32 tokens. S = 2 (split K, <= 64 registers so 4 blocks per SM) doubles the warps in flight when
# there are few items: 4-5% faster at T = 1..4 (bench/results/moe_notes.md, runs 8-9). Only S = 1 variants have a
# one-launch kernel.
GEMM_VARIANTS = ((1, 4, 4, 1), (1, 4, 1, 1), (1, 2, 2, 1), (4, 1, 1, 1), (1, 1, 1, 2))
_WARPS = 8
# moe_routed runs gate/up and down as one launch from this many token-expert pairs for experts of at most
# SMALL_EXPERT weights (the trained pair's). Set first at K2.6 shapes, where on the H200 the fused launch was faster
# at T = 8..256 (K = 8) and slower at T = 1 (bench/results/moe_int4.md, `fused` columns).
FUSED_MIN_PAIRS = 64
# Experts above SMALL_EXPERT weights (K2.6's) take the one launch from 24 pairs on: H100, uniform routing
# (bench/results/k26_run7/call2, moe_variant_ab): T = 3 210.9 us fused against 222.1 for the split-K two launches,
# T = 5 317.9 against 334.7; at T = 1 (8 pairs) the two launches are within 1 us of any fused variant.
FUSED_MIN_PAIRS_LARGE = 24
FUSED_MAX_ACTIVE = 512   # local experts the one-launch kernel's pass-prefix table holds (MOE_FUSED_MAX_ACTIVE)


def _pad64(n: int) -> int:
    return -(-n // 64) * 64


# ---- layout --------------------------------------------------------------------------------------------------

def _nibbles(packed: torch.Tensor, scale: torch.Tensor, n: int, k: int, group_size: int, what: str):
    """compressed-tensors (int32 [N, K/8], bf16 [N, K/G]) -> nibbles uint8 [N, Kp], per-32 scales [N, Kp/32]."""
    if group_size % 32:
        raise ValueError(f"{what}: group_size {group_size} unsupported; the INT4 MoE kernels need a multiple of 32 "
                         "(Kimi K2.6 uses 32)")
    if k % group_size or n % 16:
        raise ValueError(f"{what}: shape [{n}, {k}] unsupported; need rows % 16 == 0 and in_features % group_size "
                         f"({group_size}) == 0")
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, k // 8):
        raise ValueError(f"{what}: weight_packed must be int32 [{n}, {k // 8}] (compressed-tensors pack-quantized), "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    if scale.dtype != torch.bfloat16 or tuple(scale.shape) != (n, k // group_size):
        raise ValueError(f"{what}: weight_scale must be bfloat16 [{n}, {k // group_size}] (the kernels read "
                         f"bf16 scale pairs), got {scale.dtype} {tuple(scale.shape)}")
    kp = _pad64(k)
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    u = ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).reshape(n, k)
    sc = scale.repeat_interleave(group_size // 32, dim=1) if group_size > 32 else scale
    if kp != k:
        u = torch.cat([u, torch.full((n, kp - k), 8, dtype=torch.uint8, device=u.device)], 1)
        sc = torch.cat([sc, torch.zeros(n, (kp - k) // 32, dtype=sc.dtype, device=sc.device)], 1)
    return u, sc


def _tiles(u: torch.Tensor, sc: torch.Tensor):
    """nibbles [N, Kp] + scales [N, Kp/32] (rows in tile order) -> words int32 [R, C, 32, 4], bf16 [R, C, 8, 2, 2]."""
    n, kp = u.shape
    r, c = n // 16, kp // 64
    v = u.view(r, 2, 8, c, 2, 4, 2, 2, 2).permute(0, 3, 2, 5, 4, 6, 8, 7, 1)  # [R, C, g, t, sh, sl, jb0, jb1, rh]
    v = v.reshape(r, c, 32, 4, 8).to(torch.int64) << (4 * torch.arange(8, device=u.device))
    words = v.sum(-1)
    words = (words - ((words >> 31) << 32)).to(torch.int32)                  # unsigned 32-bit -> int32 view
    s = sc.reshape(r, 2, 8, c, 2).permute(0, 3, 2, 4, 1).contiguous()        # [R, C, g, gh, rh]
    return words, s


def _untiles(words: torch.Tensor, s: torch.Tensor):
    r, c = words.shape[:2]
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int32)
    nib = ((words.unsqueeze(-1) >> shifts) & 0xF).view(r, c, 8, 4, 2, 2, 2, 2, 2)
    u = nib.permute(0, 8, 2, 1, 4, 3, 5, 7, 6).reshape(r * 16, c * 64)       # back to [R, rh, g, C, sh, t, sl, jb1, jb0]
    sc = s.permute(0, 4, 2, 1, 3).reshape(r * 16, c * 2)
    return u, sc


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[F, X] x2 -> [2F, X]: tile r = 8 gate rows then the 8 up rows of the same channels."""
    f = gate.shape[0]
    return torch.stack((gate.reshape(f // 8, 8, -1), up.reshape(f // 8, 8, -1)), 1).reshape(2 * f, -1)


def repack(gate, up, down, group_size: int):
    """One expert's (weight_packed, weight_scale) pairs, compressed-tensors layout -> (w13, s13, w2, s2)."""
    f, d = gate[0].shape[0], gate[0].shape[1] * 8
    ug, sg = _nibbles(*gate, f, d, group_size, "gate_proj")
    uu, su = _nibbles(*up, f, d, group_size, "up_proj")
    ud, sd = _nibbles(*down, d, f, group_size, "down_proj")
    if f % 16:
        raise ValueError(f"moe_intermediate_size {f} unsupported: need a multiple of 16")
    w13, s13 = _tiles(_interleave(ug, uu), _interleave(sg, su))
    w2, s2 = _tiles(ud, sd)
    return w13, s13, w2, s2


def unrepack(w13, s13, w2, s2, hidden: int, intermediate: int, group_size: int):
    """Inverse of `repack`: -> gate, up, down as (weight_packed int32, weight_scale bf16)."""
    gs, f = group_size // 32, intermediate

    def ct(u, sc, k):                      # rows in order -> compressed-tensors, first k columns
        return pack_int4(u[:, :k].to(torch.int16) - 8), sc[:, : k // 32 : gs].contiguous()
    u13, sc13 = _untiles(w13, s13)
    u13, sc13 = u13.view(f // 8, 2, 8, -1), sc13.view(f // 8, 2, 8, -1)
    gate = ct(u13[:, 0].reshape(f, -1), sc13[:, 0].reshape(f, -1), hidden)
    up = ct(u13[:, 1].reshape(f, -1), sc13[:, 1].reshape(f, -1), hidden)
    return gate, up, ct(*_untiles(w2, s2), intermediate)


# ---- weights -------------------------------------------------------------------------------------------------

@dataclass
class MoEWeights:
    """One MoE layer's weights as the kernels read them (all on one CUDA device, or CPU for layout tests)."""
    w13: torch.Tensor                 # int32 [L, F/8, Dp/64, 32, 4]
    s13: torch.Tensor                 # bf16  [L, F/8, Dp/64, 8, 2, 2]
    w2: torch.Tensor                  # int32 [L, D/16, Fp/64, 32, 4]
    s2: torch.Tensor                  # bf16  [L, D/16, Fp/64, 8, 2, 2]
    hidden: int                       # D
    intermediate: int                 # F
    group_size: int
    global_to_local: torch.Tensor     # int32 [E]: local index of each global expert, -1 where not held
    router_weight: Optional[torch.Tensor] = None    # fp32 [E, D]
    router_bias: Optional[torch.Tensor] = None      # fp32 [E] (e_score_correction_bias)
    shared: Optional[tuple] = None                  # bf16 (gate [Fs, D], up [Fs, D], down [D, Fs])

    @property
    def local_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def n_experts(self) -> int:
        return self.global_to_local.shape[0]

    @property
    def device(self) -> torch.device:
        return self.w13.device


def pack_experts(experts: Sequence, hidden: int, intermediate: int, group_size: int, device=None,
                 expert_ids: Optional[Sequence[int]] = None, n_experts: Optional[int] = None, **extra) -> MoEWeights:
    """experts: per held expert a (gate, up, down) of (weight_packed, weight_scale). Repacks one expert at a time
    on its own device, then moves it to `device`. expert_ids: their global ids (default 0..L-1)."""
    ids = list(range(len(experts))) if expert_ids is None else [int(e) for e in expert_ids]
    n_experts = n_experts or (max(ids) + 1 if ids else 0)
    if len(ids) != len(experts) or len(set(ids)) != len(ids) or any(not 0 <= e < n_experts for e in ids):
        raise ValueError(f"pack_experts: expert_ids {ids[:8]}... must be distinct ids in [0, {n_experts})")
    dp, fp = _pad64(hidden), _pad64(intermediate)
    device = torch.device(device) if device is not None else experts[0][0][0].device
    out = dict(w13=torch.empty(len(ids), intermediate // 8, dp // 64, 32, 4, dtype=torch.int32, device=device),
               s13=torch.empty(len(ids), intermediate // 8, dp // 64, 8, 2, 2, dtype=torch.bfloat16, device=device),
               w2=torch.empty(len(ids), hidden // 16, fp // 64, 32, 4, dtype=torch.int32, device=device),
               s2=torch.empty(len(ids), hidden // 16, fp // 64, 8, 2, 2, dtype=torch.bfloat16, device=device))
    for i, (gate, up, dn) in enumerate(experts):
        if gate[0].shape[1] * 8 != hidden or gate[0].shape[0] != intermediate:
            raise ValueError(f"expert {ids[i]}: gate_proj packs [{gate[0].shape[0]}, {gate[0].shape[1] * 8}], "
                             f"expected [{intermediate}, {hidden}]")
        for name, t in zip(("w13", "s13", "w2", "s2"), repack(gate, up, dn, group_size)):
            out[name][i].copy_(t)
    g2l = torch.full((n_experts,), -1, dtype=torch.int32)
    g2l[ids] = torch.arange(len(ids), dtype=torch.int32)
    return MoEWeights(**out, hidden=hidden, intermediate=intermediate, group_size=group_size,
                      global_to_local=g2l.to(device), **extra)


def load_moe_weights(moe, cfg, experts: Optional[Sequence[int]] = None, device="cuda",
                     with_shared: bool = True) -> MoEWeights:
    """From a reference `MoE` module: the routed experts `experts` (default all; a rank's share for expert
    parallelism), the router, and the shared expert in bf16 (with_shared=False on ranks that skip it)."""
    if cfg.quantization_config is None:
        raise ValueError("load_moe_weights: the routed experts are not INT4 (config has no quantization_config)")
    if cfg.scoring_func != "sigmoid" or cfg.topk_method != "noaux_tc":
        raise ValueError(f"load_moe_weights: scoring_func {cfg.scoring_func!r} / topk_method {cfg.topk_method!r} "
                         "unsupported (only sigmoid + noaux_tc, as Kimi K2)")
    ids = list(range(cfg.n_routed_experts)) if experts is None else sorted({int(e) for e in experts})
    triples = [tuple((m.weight_packed, m.weight_scale) for m in (moe.experts[e].gate_proj, moe.experts[e].up_proj,
                                                                  moe.experts[e].down_proj)) for e in ids]
    shared = None
    if with_shared and moe.shared_experts is not None:
        s = moe.shared_experts
        shared = tuple(lin.weight.detach().to(device, torch.bfloat16).contiguous()
                       for lin in (s.gate_proj, s.up_proj, s.down_proj))
    return pack_experts(triples, cfg.hidden_size, cfg.moe_intermediate_size, cfg.quantization_config.group_size,
                        device, expert_ids=ids, n_experts=cfg.n_routed_experts,
                        router_weight=moe.gate.weight.detach().to(device, torch.float32).contiguous(),
                        router_bias=moe.gate.e_score_correction_bias.detach().to(device, torch.float32).contiguous(),
                        shared=shared)


# ---- kernels -------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _kernels(device_index: int):
    """Compile (once per device; CuPy caches the cubin on disk) and return (functions, SM count, warps/SM)."""
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("optimized.moe needs CuPy (pip install cupy-cuda13x) and a CUDA GPU") from e
    # CuPy appends -arch=sm_<major><minor> of the current device itself (NVRTC -> cubin; a second -arch is an
    # NVRTC invalid-option error), so sm_90 on H200 and sm_120 on RTX PRO 6000: mma.sync only, no wgmma.
    options = ("-std=c++17",)
    gemm = [_gemm_name(v, epi) for v in GEMM_VARIANTS for epi in (0, 1)]
    comb = ["moe_combine<0>", "moe_combine<1>"] + [_fused_name(v) for v in GEMM_VARIANTS if v[3] == 1] \
        + [_grouped_name(v) for v in GEMM_VARIANTS]
    with cupy.cuda.Device(device_index):
        m1 = cupy.RawModule(code=(_KERNELS / "moe_int4.cu").read_text(), options=options,
                            name_expressions=gemm + comb)
        m2 = cupy.RawModule(code=(_KERNELS / "moe_route.cu").read_text(), options=options)
        fns = {n: m1.get_function(n) for n in gemm + comb + ["moe_group_small"]}
        fns.update({n: m2.get_function(n) for n in ("moe_route", "moe_group", "moe_router_gemm")})
    props = torch.cuda.get_device_properties(device_index)
    return fns, props.multi_processor_count, props.max_threads_per_multi_processor // 32


def compile_target(device_index: int = 0) -> str:
    """The NVRTC target CuPy builds these kernels for on that device, e.g. '-arch=sm_90 (cubin)' (provenance;
    reads a CuPy-internal helper, so 'unknown' where that moved)."""
    import cupy
    try:
        from cupy.cuda import compiler
        with cupy.cuda.Device(device_index):
            arch, method = compiler._get_arch_for_options_for_nvrtc()
        return f"{arch} ({method})"
    except Exception:                                   # noqa: BLE001 - provenance only
        return "unknown"


def _launch(name: str, device: torch.device, grid, block, args, shared_mem: int = 0):
    launch(_kernels(device.index)[0][name], device, grid, block, args, shared_mem)


def _need_cuda(what: str, *tensors):
    for t in tensors:
        if not (isinstance(t, torch.Tensor) and t.is_cuda):
            raise ValueError(f"{what}: needs CUDA tensors (the INT4 MoE kernels have no CPU path; use "
                             "reference.target.MoE on CPU), got "
                             f"{t.device if isinstance(t, torch.Tensor) else type(t).__name__}")


# ---- stages --------------------------------------------------------------------------------------------------

def route(router_logits: torch.Tensor, bias: torch.Tensor, cfg):
    """reference.target.route on the GPU: fp32 logits [T, E] -> (expert ids int64 [T, K], weights fp32 [T, K]),
    ids in descending order of the biased score (torch.topk order); ties go to the lower id. The logits may also
    come as parts [P, T, E] whose sum (taken in order 0..P-1) they are: moe_router_gemm's column slices."""
    _need_cuda("route", router_logits, bias)
    parts = router_logits if router_logits.dim() == 3 else router_logits.unsqueeze(0)
    p, t, e = parts.shape
    k, ng = cfg.num_experts_per_tok, max(1, cfg.n_group)
    if router_logits.dtype != torch.float32 or router_logits.dim() not in (2, 3) or bias.dtype != torch.float32 \
            or bias.shape != (e,):
        raise ValueError(f"route: need float32 logits [T, E] (or parts [P, T, E]) and float32 bias [E], got "
                         f"{router_logits.dtype} {tuple(router_logits.shape)} and {bias.dtype} {tuple(bias.shape)}")
    if e != cfg.n_routed_experts or e % ng or not 0 < k <= e or not 0 < cfg.topk_group <= ng:
        raise ValueError(f"route: E={e}, n_routed_experts={cfg.n_routed_experts}, n_group={ng}, "
                         f"topk_group={cfg.topk_group}, K={k} inconsistent")
    idx = torch.empty(t, k, dtype=torch.int64, device=router_logits.device)
    w = torch.empty(t, k, dtype=torch.float32, device=router_logits.device)
    smem = 4 * (2 * e + 2 * ng + k)
    if smem > 48 * 1024:
        raise ValueError(f"route: {e} experts need {smem} B of shared memory per token (> 48 KB)")
    if t:
        _launch("moe_route", router_logits.device, (t,), (128,),
                (_p(parts.contiguous()), np.int32(p), _p(bias.contiguous()), np.int32(e), np.int32(k), np.int32(ng),
                 np.int32(cfg.topk_group if ng > 1 else 1), np.int32(bool(cfg.norm_topk_prob)),
                 np.float32(cfg.routed_scaling_factor), _p(idx), _p(w)), smem)
    return idx, w


# Which router GEMM runs: moe_router_gemm (fp32 SIMT, ROUTER_RK column-slice partials that `route` adds in order,
# every 16-token pass in its own blocks) or cuBLAS's fp32 GEMM (x.float(), then F.linear). bench/router_ab.py,
# H100, us per call at T = 1 / 17 / 33 / 65 / 129 / 257 (bench/results/engine_run14/router_ab.md):
#   K2.6 (E 384, D 7168): kernel 3.7 / 15.4 / 26.6 / 42.1 / 82.3 / 161, cuBLAS 8.6 / 21.0 / 34.9 / 31.5 / 41.7 / 64
#   trained pair (E 16, D 256): kernel 2.2 / 6.0 / 6.0 / 6.0 / 6.1 / 6.2, cuBLAS 4.0 / 9.2 / 9.2 / 9.3 / 9.7 / 9.7
# So the kernel serves up to ROUTER_KERNEL_MAX_T tokens (between the measured 33, faster, and 65, slower), and any
# T for router weights of at most ROUTER_SMALL_W entries, whose passes cost no more than the launch.
ROUTER_KERNEL_MAX_T = 48
ROUTER_SMALL_W = 1 << 18
ROUTER_RK, ROUTER_EG = 8, 16          # column slices, experts per block (ROUTER_RK / ROUTER_EG in the .cu)
ROUTER_TT = 16                        # tokens per pass; each pass has its own blocks (grid z)
ROUTER_CMAX = 8                       # float4 columns per lane and slice: D <= 32768


def router_path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which router GEMM a call runs: "kernel" (moe_router_gemm) for bf16 x of <= ROUTER_KERNEL_MAX_T rows (any
    rows when the weight has <= ROUTER_SMALL_W entries) with D % 32 == 0, D <= 32768 and aligned rows, else
    "cublas" (F.linear in fp32)."""
    t, d = x.shape
    ok = (x.dtype == torch.bfloat16 and weight.dtype == torch.float32 and d % (4 * ROUTER_RK) == 0
          and d <= 4 * 32 * ROUTER_CMAX * ROUTER_RK
          and x.is_contiguous() and weight.is_contiguous() and x.data_ptr() % 8 == 0 and weight.data_ptr() % 16 == 0)
    small = weight.numel() <= ROUTER_SMALL_W
    return "kernel" if ok and t >= 1 and (t <= ROUTER_KERNEL_MAX_T or small) else "cublas"


def router_parts(x: torch.Tensor, weight: torch.Tensor, path: Optional[str] = None) -> torch.Tensor:
    """The router logits x.float() @ weight.T as fp32 parts [P, T, E] whose in-order sum they are: P = ROUTER_RK
    column slices (moe_router_gemm) or P = 1 (cuBLAS), by `router_path` (or `path`, to compare the two: "kernel"
    raises where router_path would not allow it, whatever T). Deterministic on either path."""
    _need_cuda("router", x, weight)
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"router: x [T, D] and weight [E, D] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if path not in (None, "kernel", "cublas"):
        raise ValueError(f"router: path must be None, 'kernel' or 'cublas', got {path!r}")
    if path == "kernel" and x.shape[0] and router_path(x[:1], weight) != "kernel":
        raise ValueError(f"router: moe_router_gemm cannot take x {x.dtype} {tuple(x.shape)} / weight "
                         f"{weight.dtype} {tuple(weight.shape)} (needs bf16 x, fp32 W, D % 32 == 0, D <= 32768, "
                         "aligned contiguous rows)")
    if (path or router_path(x, weight)) == "cublas" or x.shape[0] == 0:
        return F.linear(x.float(), weight).unsqueeze(0)
    t, d = x.shape
    e = weight.shape[0]
    parts = torch.empty(ROUTER_RK, t, e, dtype=torch.float32, device=x.device)
    _launch("moe_router_gemm", x.device, (-(-e // ROUTER_EG), ROUTER_RK, -(-t // ROUTER_TT)), (256,),
            (_p(x), _p(weight), np.int32(t), np.int32(e), np.int32(d), _p(parts)))
    return parts


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x.float() @ weight.T in fp32 [T, E]: `router_parts` added in order, the values `route` sees."""
    parts = router_parts(x, weight)
    out = parts[0].clone()
    for p in range(1, parts.shape[0]):
        out += parts[p]
    return out


def router(x: torch.Tensor, weights: MoEWeights, cfg):
    """The router GEMM in fp32 (`router_parts`), then `route`."""
    if weights.router_weight is None:
        raise ValueError("router: these MoEWeights carry no router (load them with load_moe_weights)")
    return route(router_parts(x.contiguous(), weights.router_weight), weights.router_bias, cfg)


@dataclass
class Grouping:
    """Token-expert pairs sorted by local expert. Sizes are host-known upper bounds; counts live on the device."""
    pos_of_pair: torch.Tensor     # int32 [T*K]: sorted position of pair t*K+k, -1 where the expert is not held
    token_of_pos: torch.Tensor    # int32 [T*K]: token of each sorted position (valid below the owned count)
    active: torch.Tensor          # int32 [3, A]: local expert id, first position, count (first n_active used)
    n_active: torch.Tensor        # int32 [1]
    sync: torch.Tensor            # int32 [A + 1]: zero after grouping; used up by one gate_up_down call
    tokens: int
    top_k: int
    fused_used: bool = False


SMALL_PAIRS = 32     # up to this many token-expert pairs, one warp groups them (and gate/up can do it itself)


def _grouping(idx: torch.Tensor, weights: MoEWeights) -> Grouping:
    """The grouping's buffers, not yet filled."""
    _need_cuda("group_tokens", idx)
    if idx.dtype != torch.int64 or idx.dim() != 2:
        raise ValueError(f"group_tokens: need expert ids int64 [T, K], got {idx.dtype} {tuple(idx.shape)}")
    t, k = idx.shape
    p, L = t * k, weights.local_experts
    a = max(1, min(L, p))
    if L > 4096:
        raise ValueError(f"group_tokens: {L} local experts > 4096 (shared-memory table)")
    buf = torch.empty(2 * p + 4 * a + 2, dtype=torch.int32, device=idx.device)
    return Grouping(buf[:p], buf[p:2 * p], buf[2 * p:2 * p + 3 * a].view(3, a),
                    buf[2 * p + 3 * a:2 * p + 3 * a + 1], buf[2 * p + 3 * a + 1:], t, k)


def _group_args(idx: torch.Tensor, weights: MoEWeights, g: Grouping) -> tuple:
    return (_p(idx.contiguous()), np.int32(g.tokens * g.top_k), np.int32(g.top_k), _p(weights.global_to_local),
            np.int32(weights.n_experts), _p(g.pos_of_pair), _p(g.token_of_pos), _p(g.active),
            np.int32(g.active.shape[1]), _p(g.n_active), _p(g.sync))


def group_tokens(idx: torch.Tensor, weights: MoEWeights) -> Grouping:
    g = _grouping(idx, weights)
    p, k, L, a = g.tokens * g.top_k, g.top_k, weights.local_experts, g.active.shape[1]
    if p <= SMALL_PAIRS:                          # one warp, no shared table (T <= 4 at K = 8)
        _launch("moe_group_small", idx.device, (1,), (32,), _group_args(idx, weights, g))
        return g
    _launch("moe_group", idx.device, (1,), (1024,),
            (_p(idx.contiguous()), np.int32(p), np.int32(k), _p(weights.global_to_local), np.int32(weights.n_experts),
             np.int32(L), _p(g.pos_of_pair), _p(g.token_of_pos), _p(g.active), np.int32(a), _p(g.n_active),
             _p(g.sync)), 4 * (3 * L + 32))
    return g


def _gemm_name(variant, epi: int) -> str:
    return "moe_int4_gemm<%d,%d,%d,%d,%d>" % (*variant, epi)


def _grouped_name(variant) -> str:
    return "moe_int4_gate_up_grouped<%d,%d,%d,%d>" % variant


def _fused_name(variant) -> str:
    if variant[3] != 1:
        raise ValueError(f"gate_up_down: variant {variant} splits K (S = {variant[3]}); the one-launch kernel has "
                         "S = 1 variants only: " + str([v for v in GEMM_VARIANTS if v[3] == 1]))
    return "moe_int4_fused<%d,%d,%d>" % variant[:3]


SMALL_EXPERT = 1 << 20  # hidden x intermediate at most this: a tile's weights are a few chunks, latency-bound


def pick_variant(tokens: int, top_k: int, n_experts: int, split: bool = True, expert_elems: int = 0):
    """(NT, U, XB, S) for a call. Up to SMALL_PAIRS token-expert pairs (T <= 4 at K = 8) K is split over two warps
    (S = 2): gate/up 4-5% and down 4% faster there (H200, bench/results/moe_run9/moe_stage_variants.json).
    Beyond, NT=1 (8-token passes) with activations batched 4 chunks deep measured fastest at every T up to 256 under
    near-uniform routing at K2.6's shapes (bench/results/moe_int4.md): with 1-15 tokens per expert the weight
    stream, not the tokens, is the cost. Only when the likely largest expert (mean + 3 sigma of uniform routing,
    at most T) needs more than 4 passes do wider n-tiles take over. Small experts (expert_elems = hidden x
    intermediate <= SMALL_EXPERT, e.g. the trained pair's 256 x 192) are bound by each pass's latency instead, so
    wider n-tiles take over from 2 passes on (H100, bench/results/moe_variant_ab.md: T = 65 at 16 experts top-4
    13.5 us against 16.7 with 8-token passes). split=False: S = 1 only (the one-launch gate_up_down has no split-K
    kernel)."""
    if split and tokens * top_k <= SMALL_PAIRS:
        return (1, 1, 1, 2)
    m = tokens * top_k / max(1, n_experts)
    need = min(tokens, m + 3 * math.sqrt(m) + 1)
    wide = 16 if 0 < expert_elems <= SMALL_EXPERT else 32
    return (1, 4, 4, 1) if need <= wide else (4, 1, 1, 1)


@functools.lru_cache(maxsize=None)
def _resident_blocks(name: str, device_index: int) -> int:
    """Blocks of 8 warps that fit on the whole GPU at once (registers are the limit): the persistent grid."""
    fns, n_sm, warps_per_sm = _kernels(device_index)
    per_warp = -(-fns[name].num_regs * 32 // 256) * 256
    return n_sm * max(1, min(warps_per_sm, 65536 // per_warp) // _WARPS)


def _grid(name: str, device: torch.device, items: int, warps_per_item: int = 1) -> int:
    """Blocks for a persistent launch: as many as fit at once, no more than the items need."""
    return max(1, min(_resident_blocks(name, device.index), -(-items // (_WARPS // warps_per_item))))


def _variant_key(v) -> tuple:
    """A variant as a 4-tuple; (NT, U, XB) means S = 1."""
    v = tuple(v)
    return v + (1,) if len(v) == 3 else v


def _variant(g: Grouping, weights: MoEWeights, variant, split: bool = True):
    """The caller's (NT, U, XB[, S]), checked to be compiled, or `pick_variant`'s choice for this grouping."""
    variant = _variant_key(variant) if variant is not None else pick_variant(
        g.tokens, g.top_k, weights.n_experts, split, weights.hidden * weights.intermediate)
    if variant not in GEMM_VARIANTS:
        raise ValueError(f"moe gemm: variant {variant} not compiled; choose from {GEMM_VARIANTS}")
    return variant


def _h_buffer(weights: MoEWeights, g: Grouping, device) -> torch.Tensor:
    """gate_up's output h [P, Fp] bf16; padding columns past F zeroed (down reads all Fp)."""
    f, fp = weights.intermediate, _pad64(weights.intermediate)
    return (torch.empty if fp == f else torch.zeros)(g.tokens * g.top_k, fp, dtype=torch.bfloat16, device=device)


def _run_gemm(epi: int, act: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, g: Grouping, out: torch.Tensor,
              weights: MoEWeights, variant):
    v = _variant(g, weights, variant)
    name = _gemm_name(v, epi)
    r, c = wq.shape[1], wq.shape[2]
    a = g.active.shape[1]
    _launch(name, act.device, (_grid(name, act.device, a * r, v[3]),), (32 * _WARPS,),
            (_p(wq), _p(ws), _p(act), np.int32(act.shape[1]), _p(g.token_of_pos if epi == 0 else None),
             _p(g.active), np.int32(a), _p(g.n_active), _p(out), np.int32(out.shape[1]), np.int32(r), np.int32(c)))


def gate_up(x: torch.Tensor, weights: MoEWeights, grouping: Grouping, variant=None) -> torch.Tensor:
    """h [P, Fp] bf16 = silu(x W_gate^T) * (x W_up^T) for every sorted pair (rows past the owned count unset;
    columns past F zero)."""
    xp = _check_x(x, weights)
    h = _h_buffer(weights, grouping, x.device)
    _run_gemm(0, xp, weights.w13, weights.s13, grouping, h, weights, variant)
    return h


def group_gate_up(x: torch.Tensor, idx: torch.Tensor, weights: MoEWeights, variant=None):
    """`group_tokens` then `gate_up` in one launch, for <= SMALL_PAIRS token-expert pairs: (Grouping, h), both
    bitwise what the two launches give (moe_int4_gate_up_grouped)."""
    xp = _check_x(x, weights)
    g = _grouping(idx, weights)
    if g.tokens * g.top_k > SMALL_PAIRS:
        raise ValueError(f"group_gate_up: {g.tokens * g.top_k} token-expert pairs > {SMALL_PAIRS}; use "
                         "group_tokens then gate_up")
    v = _variant(g, weights, variant)
    name = _grouped_name(v)
    h = _h_buffer(weights, g, x.device)
    r, c = weights.w13.shape[1], weights.w13.shape[2]
    _launch(name, x.device, (_grid(name, x.device, g.active.shape[1] * r, v[3]),), (32 * _WARPS,),
            (_p(weights.w13), _p(weights.s13), _p(xp), np.int32(xp.shape[1])) + _group_args(idx, weights, g)
            + (_p(h), np.int32(h.shape[1]), np.int32(r), np.int32(c)))
    return g, h


def down(h: torch.Tensor, weights: MoEWeights, grouping: Grouping, variant=None) -> torch.Tensor:
    """y [P, D] fp32 = h W_down^T per sorted pair."""
    y = torch.empty(h.shape[0], weights.hidden, dtype=torch.float32, device=h.device)
    _run_gemm(1, h, weights.w2, weights.s2, grouping, y, weights, variant)
    return y


def gate_up_down(x: torch.Tensor, weights: MoEWeights, grouping: Grouping, variant=None) -> torch.Tensor:
    """`down(gate_up(x))` in one launch (moe_int4_fused): y [P, D] fp32, bitwise equal to the two stages. Uses up
    the grouping's `sync` counters: once per `group_tokens` (a second call raises; graph replays rerun both)."""
    if grouping.fused_used:
        raise ValueError("gate_up_down: this grouping's counters are used up; call group_tokens again")
    xp = _check_x(x, weights)
    name = _fused_name(_variant(grouping, weights, variant, split=False))
    h = _h_buffer(weights, grouping, x.device)
    y = torch.empty(h.shape[0], weights.hidden, dtype=torch.float32, device=x.device)
    r13, c13, r2, c2 = weights.w13.shape[1], weights.w13.shape[2], weights.w2.shape[1], weights.w2.shape[2]
    a = grouping.active.shape[1]
    if a > FUSED_MAX_ACTIVE:
        raise ValueError(f"gate_up_down: {a} local experts; the one-launch kernel's pass table holds "
                         f"{FUSED_MAX_ACTIVE} (run gate_up then down, or hold fewer experts per rank)")
    _launch(name, x.device, (_grid(name, x.device, a * (r13 + r2)),), (32 * _WARPS,),
            (_p(weights.w13), _p(weights.s13), _p(weights.w2), _p(weights.s2), _p(xp), np.int32(xp.shape[1]),
             _p(grouping.token_of_pos), _p(grouping.active), np.int32(a), _p(grouping.n_active), _p(h),
             np.int32(h.shape[1]), _p(y), np.int32(weights.hidden), np.int32(r13), np.int32(c13), np.int32(r2), np.int32(c2),
             _p(grouping.sync)))
    grouping.fused_used = True
    return y


def combine(y: torch.Tensor, grouping: Grouping, w: torch.Tensor, add: Optional[torch.Tensor] = None,
            out_dtype=torch.bfloat16, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out [T, D] = sum_k w[t,k] y[pos(t,k)] (+ add, bf16 [T, D]) in fp32, written as out_dtype (bf16 or fp32)."""
    t, k, d = grouping.tokens, grouping.top_k, y.shape[1]
    if w.dtype != torch.float32 or tuple(w.shape) != (t, k):
        raise ValueError(f"combine: weights must be float32 [{t}, {k}], got {w.dtype} {tuple(w.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"combine: out_dtype {out_dtype} unsupported (bfloat16 or float32)")
    if add is not None and (add.dtype != torch.bfloat16 or tuple(add.shape) != (t, d)):
        raise ValueError(f"combine: add must be bfloat16 [{t}, {d}], got {add.dtype} {tuple(add.shape)}")
    out = torch.empty(t, d, dtype=out_dtype, device=y.device) if out is None else out
    if out.dtype != out_dtype or tuple(out.shape) != (t, d) or not out.is_contiguous():
        raise ValueError(f"combine: out must be contiguous {out_dtype} [{t}, {d}]")
    _launch(f"moe_combine<{int(out_dtype == torch.bfloat16)}>", y.device, (-(-d // 1024), t), (256,),
            (_p(y), _p(grouping.pos_of_pair), _p(w.contiguous()), _p(None if add is None else add.contiguous()),
             np.int32(k), np.int32(d), _p(out)))
    return out


def _check_x(x: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
    """x bf16 [T, D] on the weights' device -> contiguous, padded to Dp columns."""
    _need_cuda("moe", x, weights.w13)
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != weights.hidden:
        raise ValueError(f"moe: need activations bfloat16 [T, {weights.hidden}], got {x.dtype} {tuple(x.shape)} "
                         "(the INT4 kernels are W4A16 with bf16 activations)")
    if x.device != weights.device:
        raise ValueError(f"moe: activations on {x.device}, weights on {weights.device}")
    dp = _pad64(weights.hidden)
    xp = F.pad(x, (0, dp - weights.hidden)) if dp != weights.hidden else x.contiguous()
    return xp if xp.data_ptr() % 16 == 0 else xp.clone()          # the kernels read 16-byte vectors


def fused_min_pairs(weights: MoEWeights) -> int:
    """Token-expert pairs from which moe_routed runs gate/up and down as one launch: FUSED_MIN_PAIRS, or
    FUSED_MIN_PAIRS_LARGE for experts of more than SMALL_EXPERT weights."""
    return FUSED_MIN_PAIRS_LARGE if weights.hidden * weights.intermediate > SMALL_EXPERT else FUSED_MIN_PAIRS


def moe_routed(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, weights: MoEWeights,
               add: Optional[torch.Tensor] = None, out_dtype=torch.bfloat16, out=None, variant=None,
               fused: Optional[bool] = None):
    """sum_k w[t,k] expert_{idx[t,k]}(x[t]) over the experts held in `weights` (+ add): [T, D].
    fused: gate/up and down in one launch (default from `fused_min_pairs` token-expert pairs on, for variants
    that do not split K and at most FUSED_MAX_ACTIVE active experts) or two."""
    _check_x(x, weights)
    if idx.shape != w.shape or idx.shape[0] != x.shape[0]:
        raise ValueError(f"moe_routed: idx {tuple(idx.shape)} / w {tuple(w.shape)} do not match x {tuple(x.shape)}")
    if fused is None:
        fused = idx.numel() >= fused_min_pairs(weights) and (variant is None or _variant_key(variant)[3] == 1) \
            and min(weights.local_experts, idx.numel()) <= FUSED_MAX_ACTIVE
    if fused:
        g = group_tokens(idx, weights)
        y = gate_up_down(x, weights, g, variant)
    elif idx.numel() <= SMALL_PAIRS:
        g, h = group_gate_up(x, idx, weights, variant)
        y = down(h, weights, g, variant)
    else:
        g = group_tokens(idx, weights)
        y = down(gate_up(x, weights, g, variant), weights, g, variant)
    return combine(y, g, w, add, out_dtype, out)


def shared_expert(x: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
    gate, up, dn = weights.shared
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), dn)


def moe_forward(x: torch.Tensor, weights: MoEWeights, cfg, *, partial: bool = False, with_shared: bool = True,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reference MoE.forward for bf16 x [T, D]: route, held routed experts, + shared expert (when held and
    with_shared). partial=True returns the fp32 partial sum for an expert-parallel all-reduce."""
    _check_x(x, weights)
    if cfg.hidden_size != weights.hidden or cfg.moe_intermediate_size != weights.intermediate \
            or cfg.n_routed_experts != weights.n_experts:
        raise ValueError("moe_forward: cfg (hidden_size, moe_intermediate_size, n_routed_experts) = "
                         f"({cfg.hidden_size}, {cfg.moe_intermediate_size}, {cfg.n_routed_experts}) does not match "
                         f"the weights ({weights.hidden}, {weights.intermediate}, {weights.n_experts})")
    idx, w = router(x, weights, cfg)
    add = shared_expert(x, weights) if with_shared and weights.shared is not None else None
    return moe_routed(x, idx, w, weights, add, torch.float32 if partial else torch.bfloat16, out)
