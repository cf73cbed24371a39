"""Seeded tiny random targets in the real on-disk format (INT4 routed experts included), for tests.

    cfg = tiny_config(n_group=2, topk_group=1)            # any TargetConfig field can be overridden
    write_random_target("/tmp/t", cfg, seed=3)            # config.json + safetensors, Kimi names
    target = load_target("/tmp/t", dtype=torch.float64)

Weights are drawn so that activations stay O(1) through the layers (std 1/sqrt(fan_in)) and logits are
decisive (greedy decoding on a float64 tiny model has no near-ties to speak of).
"""
from __future__ import annotations

import torch

from .checkpoint import save_target
from .config import DrafterConfig, QuantizationConfig, RopeScaling, TargetConfig
from .int4 import quantize
from .target import Int4Linear, Target, rope_inv_freq

__all__ = ["tiny_config", "random_target", "write_random_target"]


def tiny_config(**overrides) -> TargetConfig:
    """A K2-shaped config at toy width: MLA with q_lora, one dense layer then MoE with a shared expert,
    YaRN, INT4 experts (group 8 so that the toy widths divide)."""
    base = dict(
        model_type="kimi_k2", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        first_k_dense_replace=1, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=512,
        rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=64, beta_fast=1.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
        quantization_config=QuantizationConfig(group_size=8, ignore=("lm_head", "re:.*self_attn.*",
                                                                     "re:.*shared_experts.*",
                                                                     "re:.*mlp\\.(gate|up|gate_up|down)_proj.*")),
        bos_token_id=1, eos_token_id=(2,), pad_token_id=0,
    )
    base.update(overrides)
    return TargetConfig(**base)


@torch.no_grad()
def random_target(cfg: TargetConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Target:
    """A Target with seeded random weights (INT4 experts quantized from random float weights)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Target(cfg)
    state = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name == "inv_freq" or name.rsplit(".", 1)[-1] in ("weight_packed", "weight_scale", "weight_shape"):
            continue
        if name.endswith("norm.weight"):
            v = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            v = 0.1 * torch.randn(t.shape, generator=g)
        elif name.endswith("embed_tokens.weight"):
            v = torch.randn(t.shape, generator=g)
        else:                                                     # [out, in] projections, router
            v = torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5
        state[name] = v.to(torch.float32 if name.endswith("e_score_correction_bias") else dtype)
    for name, mod in model.named_modules():
        if isinstance(mod, Int4Linear):
            n, k = mod.weight_packed.shape[0], mod.weight_packed.shape[1] * 8
            w = torch.randn(n, k, generator=g) / k ** 0.5
            packed, scale, shape = quantize(w, cfg.quantization_config.group_size)
            state.update({f"{name}.weight_packed": packed, f"{name}.weight_scale": scale,
                          f"{name}.weight_shape": shape})
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    return model.eval()


def write_random_target(path: str, cfg: TargetConfig | None = None, seed: int = 0, **save_kw) -> str:
    """Write a seeded random target to `path` in the real format; returns `path`. `save_kw` goes to
    `save_target` (dtype, max_shard_bytes, wrapper)."""
    cfg = cfg or tiny_config()
    save_kw.setdefault("dtype", torch.float32)
    save_target(random_target(cfg, seed), cfg, path, **save_kw)
    return path


def tiny_drafter_config(target_cfg: TargetConfig, **overrides) -> DrafterConfig:
    """A DFlash drafter that fits `target_cfg`: 2 layers, GQA 4/2, block 8, layer ids by the DFlash formula,
    the last vocabulary id as the mask token."""
    from .drafter import target_layer_ids_for
    layers = overrides.pop("num_hidden_layers", 2)
    base = dict(hidden_size=target_cfg.hidden_size, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=target_cfg.vocab_size,
                block_size=8, target_layer_ids=tuple(target_layer_ids_for(target_cfg.num_hidden_layers, layers)),
                mask_token_id=target_cfg.vocab_size - 1, rms_norm_eps=1e-6, rope_theta=50000.0,
                max_position_embeddings=target_cfg.max_position_embeddings,
                num_target_layers=target_cfg.num_hidden_layers)
    base.update(overrides)
    return DrafterConfig(**base)


@torch.no_grad()
def random_drafter(cfg, target: Target, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A Drafter with seeded random weights, attached to `target`."""
    from .drafter import Drafter
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Drafter(cfg)
    state = {}
    for name, p in model.named_parameters():
        v = 1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight") else \
            torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
        state[name] = v.to(dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg.dim_head, cfg.rope_theta, cfg.rope_scaling)
    return model.eval().attach(target)
