"""The Kimi K2 / DeepSeek-V3 target: a readable forward pass over a compressed latent KV cache.

Legend (shape letters used in comments and einsums):
  T  new tokens in this forward        P  cached prefix rows          S  key rows = P + T
  D  hidden_size                       H  attention heads             Q  q_lora_rank
  C  kv_lora_rank (latent, 512)        R  qk_rope_head_dim (64)       N  qk_nope_head_dim (128)
  A  v_head_dim (128)                  L  latent row = C + R (576)    E  routed experts
  K  experts per token                 F  FFN width                   V  vocab

Module names equal the checkpoint keys (`model.layers.3.self_attn.kv_b_proj.weight`, ...), so loading
needs no rename table. The forward takes an arbitrary set of new tokens with explicit positions and an
explicit visibility over (cached prefix + new tokens): the tree-verify shape. Causal prefill and one-token
decode are the special cases.

Numerics (the conventions of HF `modeling_deepseek` and serving engines, kept in every dtype):
  * RMSNorm, softmax and the router run in max(dtype, float32); the router GEMM is float32 (float64 when
    the model runs in float64);
  * RoPE angles are computed in float32 from float32 inverse frequencies, as HF does, then cast;
  * routed INT4 experts are dequantized when used to the exact product q * scale, then cast to the working
    dtype (so bf16 sees bf16(q * s), exactly what Marlin-style kernels produce).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import TargetConfig
from .int4 import dequantize

__all__ = ["Target", "TargetOutput", "LatentCache", "absorbed_attention", "naive_attention", "route",
           "rope_inv_freq", "apply_rope", "causal_visibility"]

ATTENTION_FORMS = ("absorbed", "naive")


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: at least float32."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(_acc(x.dtype))
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


# ---- RoPE (YaRN, interleaved pairs) --------------------------------------------------------------------

def rope_inv_freq(dim: int, theta: float, scaling=None) -> torch.Tensor:
    """float32 [dim/2] inverse frequencies, YaRN-corrected when `scaling` (a RopeScaling) is given."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    if scaling is None:
        return inv_freq
    # Pairs rotating fewer than beta_slow times over the original context are interpolated (/ factor),
    # pairs rotating more than beta_fast times keep their frequency, with a linear ramp between.
    def corr(rotations):
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) \
            / (2 * math.log(theta))
    low, high = corr(scaling.beta_fast), corr(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                                  # 1: keep original frequency
    return (inv_freq / scaling.factor) * (1 - keep) + inv_freq * keep


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, amplitude: float = 1.0):
    """cos, sin float32 [T, R/2] for integer positions [T] (angles formed in float32, like HF)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return angles.cos() * amplitude, angles.sin() * amplitude


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = True) -> torch.Tensor:
    """Rotate x [T, ..., R] by the angles of its row. Interleaved: pairs (x[2i], x[2i+1]) (K2's layout,
    kept in the cache); otherwise NeoX halves (x[i], x[i+R/2])."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.to(x.dtype).view(shape), sin.to(x.dtype).view(shape)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# ---- the latent KV cache ---------------------------------------------------------------------------------

class LatentCache:
    """Per layer, one row per cached token: [RMSNorm(ckv) (C) | rope(k_pe) (R)] = L values (576 for K2).

    Rows are in slot order; a row's RoPE position is baked into its k_pe part, so compacting rows to new
    slots needs no re-rotation when (as in DDTree) the j-th kept tree row has depth j.
    """

    def __init__(self, num_layers: int):
        self.layers: list[Optional[torch.Tensor]] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.layers[0] is None else self.layers[0].shape[0]

    def get(self, layer: int) -> Optional[torch.Tensor]:
        return self.layers[layer]

    def append(self, layer: int, rows: torch.Tensor) -> torch.Tensor:         # rows [T, L] -> [S, L]
        past = self.layers[layer]
        self.layers[layer] = rows if past is None else torch.cat([past, rows], 0)
        return self.layers[layer]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= len(self):
            raise ValueError(f"truncate: length {length} outside 0..{len(self)}")
        self.layers = [None if t is None or length == 0 else t[:length] for t in self.layers]

    def compact(self, start: int, keep: Sequence[int]) -> None:
        """Keep rows start + keep[j] at slots start + j (gather first, then write) and drop the rest."""
        keep = torch.as_tensor(list(keep), dtype=torch.long)
        if keep.numel() and (int(keep.min()) < 0 or start + int(keep.max()) >= len(self)):
            raise ValueError(f"compact: keep indices {keep.tolist()} outside the {len(self) - start} rows "
                             f"after start {start}")
        for i, t in enumerate(self.layers):
            if t is not None:
                self.layers[i] = torch.cat([t[:start], t[start + keep.to(t.device)]], 0)

    def clone(self) -> "LatentCache":
        c = LatentCache(len(self.layers))
        c.layers = [None if t is None else t.clone() for t in self.layers]
        return c


def causal_visibility(prefix: int, new: int, device=None) -> torch.Tensor:
    """bool [T, P+T]: new token t sees the prefix and new tokens 0..t."""
    rows = torch.arange(new, device=device)[:, None] + prefix
    return torch.arange(prefix + new, device=device)[None, :] <= rows


# ---- attention -------------------------------------------------------------------------------------------

def absorbed_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                       visible: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """MLA over the latent cache with W_UK already absorbed into the query (the verify-attention core).

    q_lat [T, H, C] (q_nope @ W_UK), q_pe [T, H, R] (roped), latent [S, C+R] (the cache rows, new ones
    included), visible bool [T, S]. Returns o_lat [T, H, C], before W_UV. The score runs over C+R values
    but the scale stays qk_head_dim^-0.5 (times the YaRN mscale^2), as in DeepSeek's absorb path.
    """
    c = q_lat.shape[-1]
    kv, k_pe = latent[:, :c], latent[:, c:]                                    # [S, C], [S, R]
    scores = torch.einsum("thc,sc->ths", q_lat, kv) + torch.einsum("thr,sr->ths", q_pe, k_pe)
    scores = scores.to(_acc(scores.dtype)) * softmax_scale                    # [T, H, S]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q_lat.dtype)
    return torch.einsum("ths,sc->thc", p, kv)                                  # [T, H, C]


def naive_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor,
                    visible: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """MLA with keys and values expanded per head from the latent rows (the prefill / textbook form).

    q_nope [T, H, N], q_pe [T, H, R], latent [S, C+R], kv_b = kv_b_proj.weight [H*(N+A), C]. Returns [T, H, A].
    """
    h, n = q_nope.shape[1], q_nope.shape[2]
    c = kv_b.shape[1]
    kv = F.linear(latent[:, :c], kv_b).view(latent.shape[0], h, -1)           # [S, H, N+A]
    k_nope, v = kv[..., :n], kv[..., n:]                                      # [S, H, N], [S, H, A]
    scores = torch.einsum("thn,shn->ths", q_nope, k_nope) + torch.einsum("thr,sr->ths", q_pe, latent[:, c:])
    scores = scores.to(_acc(scores.dtype)) * softmax_scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q_nope.dtype)
    return torch.einsum("ths,sha->tha", p, v)


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.num_attention_heads, cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, D] -> q_nope [T, H, N], roped q_pe [T, H, R], new latent rows [T, C+R]."""
        cfg = self.cfg
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(x.shape[0], cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
        q_pe = apply_rope(q_pe, cos, sin, cfg.rope_interleave)
        k_pe = apply_rope(k_pe, cos, sin, cfg.rope_interleave)
        return q_nope, q_pe, torch.cat([self.kv_a_layernorm(ckv), k_pe], -1)

    def forward(self, x, cos, sin, cache: LatentCache, layer: int, visible: torch.Tensor, form: str):
        cfg = self.cfg
        q_nope, q_pe, rows = self.project(x, cos, sin)
        latent = cache.append(layer, rows)                                       # [S, L]
        w = self.kv_b_proj.weight.view(cfg.num_attention_heads, -1, cfg.kv_lora_rank)   # [H, N+A, C]
        if form == "absorbed":
            q_lat = torch.einsum("thn,hnc->thc", q_nope, w[:, :cfg.qk_nope_head_dim])
            o_lat = absorbed_attention(q_lat, q_pe, latent, visible, cfg.softmax_scale)
            o = torch.einsum("thc,hac->tha", o_lat, w[:, cfg.qk_nope_head_dim:])  # [T, H, A]
        else:
            o = naive_attention(q_nope, q_pe, latent, self.kv_b_proj.weight, visible, cfg.softmax_scale)
        return self.o_proj(o.reshape(x.shape[0], -1))


# ---- feed-forward: dense SwiGLU, INT4 routed experts, router ----------------------------------------------

class Int4Linear(nn.Module):
    """A routed expert projection kept packed (compressed-tensors layout) and dequantized when used."""

    def __init__(self, in_features: int, out_features: int, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 8, dtype=torch.int32))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // group_size,
                                                         dtype=torch.bfloat16))
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int64))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in]: the exact product q * scale (formed in float32), cast to `dtype`."""
        scale = self.weight_scale.to(_acc(self.weight_scale.dtype))
        return dequantize(self.weight_packed, scale, self.weight_shape.tolist(), self.group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Projections are nn.Linear or Int4Linear."""

    def __init__(self, d: int, f: int, group_size: Optional[int] = None):
        super().__init__()
        make = (lambda i, o: Int4Linear(i, o, group_size)) if group_size else \
            (lambda i, o: nn.Linear(i, o, bias=False))
        self.gate_proj, self.up_proj, self.down_proj = make(d, f), make(d, f), make(f, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(router_logits: torch.Tensor, bias: torch.Tensor, cfg: TargetConfig):
    """noaux_tc routing. router_logits [T, E] (float32 or wider) -> (expert ids [T, K], weights [T, K]).

    sigmoid scores; `bias` (e_score_correction_bias) shifts the scores for SELECTION only; group-limited
    top-k (keep the topk_group groups whose top-2 biased scores sum highest); the weights are the unbiased
    scores of the chosen experts, normalized to sum 1 (norm_topk_prob) and times routed_scaling_factor.
    """
    t, e = router_logits.shape
    scores = router_logits.sigmoid()                                              # [T, E]
    choice = scores + bias.to(scores.dtype)
    if cfg.n_group > 1:
        grouped = choice.view(t, cfg.n_group, e // cfg.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)                      # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // cfg.n_group, dim=1), float("-inf"))
    idx = choice.topk(cfg.num_experts_per_tok, dim=-1).indices                   # [T, K]
    w = scores.gather(1, idx)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


class Router(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor):
        acc = _acc(x.dtype)
        return route(F.linear(x.to(acc), self.weight.to(acc)), self.e_score_correction_bias, self.cfg)


class MoE(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        gs = cfg.quantization_config.group_size if cfg.quantization_config else None
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size, gs)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) \
            if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x)                                                     # [T, K], [T, K]
        y = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            y.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None].to(x.dtype))
        return y if self.shared_experts is None else y + self.shared_experts(x)


# ---- the model -------------------------------------------------------------------------------------------

class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    """The `model.` part of the checkpoint."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class TargetOutput:
    logits: torch.Tensor                         # [T, V] float (the model dtype)
    hidden: dict = field(default_factory=dict)   # layer id -> [T, D]: the output of that layer


class Target(nn.Module):
    """The K2 text model. Build with `reference.load_target`; `Target(cfg)` gives uninitialised weights
    (on device="meta" it allocates nothing, which is how a K2.6-sized model is inspected)."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling),
                             persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_cache(self) -> LatentCache:
        return LatentCache(self.cfg.num_hidden_layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head over residual-stream states [T, D] -> [T, V]."""
        return self.lm_head(self.model.norm(h))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                cache: Optional[LatentCache] = None, visibility: Optional[torch.Tensor] = None,
                hidden_layers: Sequence[int] = (), attention: str = "absorbed") -> TargetOutput:
        """Run T new tokens against `cache` (appending their latent rows to it).

        input_ids [T]; positions [T] RoPE positions (default: cache length + 0..T-1); visibility bool
        [T, P+T] over (cached rows + new rows), default causal; hidden_layers: layer ids whose outputs
        to return (HF `hidden_states[l + 1]`); attention: "absorbed" (decode form) or "naive".
        """
        cfg = self.cfg
        cache = self.new_cache() if cache is None else cache
        ids = torch.as_tensor(input_ids, device=self.device)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise ValueError(f"input_ids outside the vocabulary 0..{cfg.vocab_size - 1}")
        t, p = ids.numel(), len(cache)
        pos = torch.arange(p, p + t, device=self.device) if positions is None else \
            torch.as_tensor(positions, device=self.device)
        if pos.shape != (t,):
            raise ValueError(f"positions must have shape ({t},), got {tuple(pos.shape)}")
        vis = causal_visibility(p, t, self.device) if visibility is None else \
            torch.as_tensor(visibility, device=self.device)
        if vis.shape != (t, p + t) or vis.dtype != torch.bool:
            raise ValueError(f"visibility must be bool [{t}, {p + t}] (cached + new rows), got "
                             f"{vis.dtype} {tuple(vis.shape)}")
        if not bool(vis.any(-1).all()):
            raise ValueError("visibility: every new token must see at least one row (an empty row gives NaN)")
        if attention not in ATTENTION_FORMS:
            raise ValueError(f"attention must be one of {ATTENTION_FORMS}, got {attention!r}")
        bad = [l for l in hidden_layers if not 0 <= l < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"hidden_layers {bad} outside 0..{cfg.num_hidden_layers - 1}")

        amplitude = cfg.rope_scaling.amplitude if cfg.rope_scaling is not None else 1.0
        cos, sin = rope_cos_sin(self.inv_freq, pos, amplitude)                 # [T, R/2]
        h = self.embed(ids)                                                       # [T, D]
        hidden = {}
        for i, layer in enumerate(self.model.layers):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, cache, i, vis, attention)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in hidden_layers:
                hidden[i] = h
        return TargetOutput(self.head(h), hidden)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """LongTensor [T] -> [T, V]: a fresh causal prefill (no cache kept)."""
        return self.forward(input_ids).logits
