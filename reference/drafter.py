"""The DFlash block-diffusion drafter (`DFlashDraftModel`), reading the target's hidden states.

Legend: B block positions (block_size, the bonus + L masks)   X context rows (committed tokens)
        D hidden_size   F = n_f * D fused target features   H query heads   G kv heads   E head_dim
        V vocab

One draft call (ddtree-spec.md §1.5): the block `[bonus, mask x L]` is embedded with the TARGET's embedding
(times input_embedding_scale); every layer's queries come from the block only, its keys/values from
[context ; block], with no mask at all (non-causal inside the block, every context row visible). The
context rows are the committed tokens' target features fused once, `hidden_norm(fc(features))`, and their
keys/values are kept between rounds; the block's are dropped after each call. Outputs at block positions
1..L go through the drafter's `norm`, then the TARGET's lm_head (times output_multiplier, optional
softcap): row i predicts the token at position start + i.

RoPE is Qwen3's (NeoX halves), from the drafter's own rope config, at absolute positions.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.nn as nn
from safetensors.torch import save_file

from .checkpoint import CheckpointError, _open, write_directory_atomically
from .config import ConfigError, DrafterConfig, load_drafter_config
from .target import MLP, RMSNorm, Target, apply_rope, rope_cos_sin, rope_inv_freq

__all__ = ["Drafter", "DraftContext", "load_drafter", "save_drafter", "target_layer_ids_for"]


def target_layer_ids_for(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash default: spread the ids evenly from layer 1 to layer N_t - 3 (Python round)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, g, e, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_head, cfg.hidden_size
        self.q_proj = nn.Linear(d, h * e, bias=False)
        self.k_proj = nn.Linear(d, g * e, bias=False)
        self.v_proj = nn.Linear(d, g * e, bias=False)
        self.o_proj = nn.Linear(h * e, d, bias=False)
        self.q_norm = RMSNorm(e, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(e, cfg.rms_norm_eps)
        self.heads, self.kv_heads, self.head_dim = h, g, e

    def keys_values(self, x: torch.Tensor, cos, sin):
        """x [n, D] -> roped k [n, G, E], v [n, G, E] (context rows and block rows alike)."""
        k = self.k_norm(self.k_proj(x).view(x.shape[0], self.kv_heads, self.head_dim))
        return apply_rope(k, cos, sin, interleave=False), self.v_proj(x).view(x.shape[0], self.kv_heads, -1)

    def forward(self, x, cos, sin, ctx_k, ctx_v):
        b = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(b, self.heads, self.head_dim))
        q = apply_rope(q, cos, sin, interleave=False)                          # [B, H, E]
        k_blk, v_blk = self.keys_values(x, cos, sin)
        k = torch.cat([ctx_k, k_blk], 0).repeat_interleave(self.heads // self.kv_heads, dim=1)   # [X+B, H, E]
        v = torch.cat([ctx_v, v_blk], 0).repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = torch.einsum("bhe,she->hbs", q, k).to(torch.promote_types(q.dtype, torch.float32))
        p = torch.softmax(scores * self.head_dim ** -0.5, dim=-1).to(q.dtype)    # no mask: non-causal
        return self.o_proj(torch.einsum("hbs,she->bhe", p, v).reshape(b, -1))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DraftContext:
    """The drafter's persistent state: per layer, keys/values of the committed context rows."""

    def __init__(self, num_layers: int):
        self.k: list[Optional[torch.Tensor]] = [None] * num_layers
        self.v: list[Optional[torch.Tensor]] = [None] * num_layers
        self.length = 0


class Drafter(nn.Module):
    """Module names equal the DFlash checkpoint keys (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...).
    The target (embedding, lm_head) is borrowed, never owned or saved."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.dim_head, cfg.rope_theta, cfg.rope_scaling),
                             persistent=False)
        self.target: Optional[Target] = None     # set by load_drafter / attach

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    @property
    def target_layer_ids(self) -> tuple:
        return self.cfg.target_layer_ids

    def attach(self, target: Target) -> "Drafter":
        """Borrow `target`'s embedding and lm_head after checking that the pair fits (clear errors)."""
        validate_pair(self.cfg, target, "drafter")
        object.__setattr__(self, "target", target)   # not a submodule: never saved with the drafter
        return self

    def new_context(self) -> DraftContext:
        return DraftContext(self.cfg.num_hidden_layers)

    @property
    def rope_amplitude(self) -> float:
        return self.cfg.rope_scaling.amplitude if self.cfg.rope_scaling is not None else 1.0

    def _cos_sin(self, positions: torch.Tensor):
        return rope_cos_sin(self.inv_freq, positions, self.rope_amplitude)

    @torch.no_grad()
    def extend_context(self, ctx: DraftContext, features: torch.Tensor) -> None:
        """Append committed rows: features [n, F] (target hidden states at target_layer_ids, concatenated)
        at positions ctx.length .. ctx.length + n - 1."""
        c = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))       # [n, D]
        cos, sin = self._cos_sin(torch.arange(ctx.length, ctx.length + c.shape[0], device=c.device))
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(c, cos, sin)
            ctx.k[i] = k if ctx.k[i] is None else torch.cat([ctx.k[i], k], 0)
            ctx.v[i] = v if ctx.v[i] is None else torch.cat([ctx.v[i], v], 0)
        ctx.length += c.shape[0]

    @torch.no_grad()
    def forward(self, ctx: DraftContext, bonus_token: int, block_size: Optional[int] = None) -> torch.Tensor:
        """One draft: block [bonus, mask x (block_size-1)] at positions ctx.length.. -> logits [block_size-1, V].
        The context is left unchanged (the block's keys/values are not kept)."""
        if self.target is None:
            raise RuntimeError("drafter has no target: load it with load_drafter(path, target=...) or attach()")
        if ctx.length == 0:
            raise ValueError("draft: the context is empty; extend_context with the prompt's features first")
        b = self.cfg.block_size if block_size is None else block_size
        ids = torch.full((b,), self.cfg.mask_token_id, dtype=torch.long, device=self.fc.weight.device)
        ids[0] = bonus_token
        h = self.target.embed(ids).to(self.fc.weight.dtype) * self.cfg.input_embedding_scale   # [B, D]
        cos, sin = self._cos_sin(torch.arange(ctx.length, ctx.length + b, device=h.device))
        for i, layer in enumerate(self.layers):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, ctx.k[i], ctx.v[i])
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.logits(self.norm(h)[1:])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter outputs [L, D] through the target's lm_head (no target final norm) -> [L, V]."""
        logits = self.target.lm_head(hidden.to(self.target.dtype)) * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


def validate_pair(cfg: DrafterConfig, target: Target, where: str) -> None:
    t = target.cfg
    problems = []
    if cfg.hidden_size != t.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target hidden_size {t.hidden_size}")
    if cfg.vocab_size != t.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab_size {t.vocab_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's layers 0..{t.num_hidden_layers - 1}")
    if not 0 <= cfg.mask_token_id < t.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target vocabulary 0..{t.vocab_size - 1}")
    if cfg.block_size < 2:
        problems.append(f"block_size {cfg.block_size} < 2 (a block needs the bonus and at least one mask)")
    if problems:
        raise ConfigError(f"{where}: drafter does not fit the target: " + "; ".join(problems))


def load_drafter(path: str, target: Target, dtype: Optional[torch.dtype] = None, device=None) -> Drafter:
    """Load an HF-format DFlash drafter directory and attach it to `target` (dtype/device default to the
    target's). Fails clearly on a config/tensor problem or a drafter that does not fit the target."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory (a drafter checkpoint is an HF-format directory)")
    cfg = load_drafter_config(path)
    validate_pair(cfg, target, os.path.join(path, "config.json"))
    dtype = dtype or target.dtype
    device = device or target.device
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no .safetensors file")
    with torch.device("meta"):
        model = Drafter(cfg)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    state = {}
    for file in files:
        full = os.path.join(path, file)
        with _open(full) as f:
            for name in f.keys():
                short = name[len("model."):] if name.startswith("model.") else name
                if short.endswith("rotary_emb.inv_freq"):
                    continue
                if short not in expected:
                    raise CheckpointError(f"{full}: unexpected tensor {name!r}")
                try:
                    t = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{full}: tensor {name!r} cannot be read: truncated or corrupt "
                                          f"file ({e})") from None
                if tuple(t.shape) != expected[short] or not t.dtype.is_floating_point:
                    raise CheckpointError(f"{full}: tensor {name!r} has {t.dtype} {tuple(t.shape)}, expected a "
                                          f"float tensor of shape {expected[short]}")
                state[short] = t.to(dtype=dtype, device=device)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{path}: missing tensor {missing[0]!r}" + (f" (+{len(missing) - 1} more)"
                                                                         if len(missing) > 1 else ""))
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg.dim_head, cfg.rope_theta, cfg.rope_scaling).to(device)
    return model.eval().attach(target)


def save_drafter(drafter: Drafter, path: str, dtype: Optional[torch.dtype] = torch.bfloat16) -> None:
    """Write an HF-format DFlash directory (config.json + model.safetensors) atomically."""
    state = {n: (p.detach().cpu().to(dtype) if dtype else p.detach().cpu()).contiguous()
             for n, p in drafter.named_parameters()}
    config = drafter.cfg.to_dict()
    if dtype is not None:
        config["torch_dtype"] = str(dtype).replace("torch.", "")
    def write(tmp: str) -> None:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})

    write_directory_atomically(path, write)
