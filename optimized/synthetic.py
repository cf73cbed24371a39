"""Random-weight targets and drafters at real widths, built straight on the GPU (no checkpoint, no CPU copy), for
benchmarks that need Kimi K2.6 shapes but not its weights:

    target, drafter, moe = k26_engine_parts(layers=12, device="cuda")
    engine = Engine(target, drafter, moe_weights=moe, max_seq_len=8192)

The target is a reference.Target whose dense weights are random bf16 (std 1/sqrt(fan_in), norms 1) and whose
routed experts stay on the meta device: the engine reads them only through the repacked INT4 MoEWeights made
here (random nibbles, bf16 group scales sized so activations stay O(1): weight std ~ 1/sqrt(fan_in)).
Routing over random weights is close to uniform, the worst case for the distinct experts a tree touches.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import torch.nn as nn

from reference.config import load_config, load_drafter_config
from reference.drafter import Drafter, target_layer_ids_for
from reference.target import Target, rope_inv_freq

__all__ = ["k26_configs", "materialize", "random_moe_weights", "k26_engine_parts", "verify_floor", "distinct_experts",
           "CONFIG_DIR", "BW", "PEAK"]

BW, PEAK = 4.24e12, 787e12       # H200 copy bandwidth (bytes read + written) and bf16 matmul peak (GPU.md)
CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "fixtures", "configs")


def k26_configs(layers: int, draft_layers: Optional[int] = None):
    """The shipped K2.6 target and DFlash drafter configs, cut to `layers` target layers (the drafter's target
    layer ids re-spread over them by the DFlash formula)."""
    cfg = load_config(os.path.join(CONFIG_DIR, "kimi-k2.6-text.config.json"))
    cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
    dcfg = load_drafter_config(os.path.join(CONFIG_DIR, "kimi-k2.6-dflash-drafter.config.json"))
    n = draft_layers or dcfg.num_hidden_layers
    ids = tuple(sorted({min(max(i, 0), layers - 1) for i in target_layer_ids_for(layers, n)}))
    dcfg = dataclasses.replace(dcfg, num_hidden_layers=n, target_layer_ids=ids, num_target_layers=layers)
    return cfg, dcfg


def materialize(module: nn.Module, device, dtype=torch.bfloat16, seed: int = 0, skip=lambda name: False):
    """Replace every meta parameter/buffer of `module` (except names where skip(name)) by a random tensor on
    `device`: 2-D weights N(0, 1/fan_in) (embeddings N(0, 1)), 1-D weights 1, biases and buffers 0."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for mod_name, mod in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in list(getattr(mod, kind).items()):
                full = f"{mod_name}.{name}" if mod_name else name
                if t is None or t.device.type != "meta" or skip(full):
                    continue
                if t.dim() == 2 and t.is_floating_point():
                    std = 1.0 if isinstance(mod, nn.Embedding) else t.shape[1] ** -0.5
                    new = torch.randn(t.shape, generator=gen, device=device, dtype=dtype) * std
                elif t.dim() == 1 and name == "weight":
                    new = torch.ones(t.shape, device=device, dtype=dtype)
                else:
                    new = torch.zeros(t.shape, device=device, dtype=t.dtype if not t.is_floating_point() else
                                      (torch.float32 if t.dtype == torch.float32 else dtype))
                getattr(mod, kind)[name] = nn.Parameter(new, requires_grad=False) if kind == "_parameters" else new
    return module


def random_moe_weights(cfg, device, seed: int = 0, experts=None, shared: bool = True):
    """One MoE layer's MoEWeights (optimized.moe layout) with random INT4 nibbles and scales."""
    from optimized.moe import MoEWeights, _pad64
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = list(range(cfg.n_routed_experts)) if experts is None else sorted(int(e) for e in experts)
    e, d, f = len(ids), cfg.hidden_size, cfg.moe_intermediate_size
    dp, fp = _pad64(d), _pad64(f)

    def words(*shape):
        return torch.randint(-2 ** 31, 2 ** 31 - 1, shape, generator=gen, device=device, dtype=torch.int32)

    def scales(shape, fan_in):                     # q uniform in -8..7 has std ~4.6
        s = torch.rand(shape, generator=gen, device=device) * 0.5 + 0.75
        return (s * fan_in ** -0.5 / 4.6).to(torch.bfloat16)

    g2l = torch.full((cfg.n_routed_experts,), -1, dtype=torch.int32)
    g2l[ids] = torch.arange(e, dtype=torch.int32)
    sh = None
    if shared and cfg.n_shared_experts:
        fs = f * cfg.n_shared_experts
        sh = tuple(torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16) * shape[1] ** -0.5
                   for shape in ((fs, d), (fs, d), (d, fs)))
    return MoEWeights(w13=words(e, f // 8, dp // 64, 32, 4), s13=scales((e, f // 8, dp // 64, 8, 2, 2), d),
                      w2=words(e, d // 16, fp // 64, 32, 4), s2=scales((e, d // 16, fp // 64, 8, 2, 2), f),
                      hidden=d, intermediate=f, group_size=cfg.quantization_config.group_size,
                      global_to_local=g2l.to(device),
                      router_weight=torch.randn(cfg.n_routed_experts, d, generator=gen, device=device) * d ** -0.5,
                      router_bias=torch.zeros(cfg.n_routed_experts, device=device), shared=sh)


def k26_engine_parts(layers: int, device="cuda", draft_layers: Optional[int] = None, experts=None, seed: int = 0):
    """(target, drafter, {layer: MoEWeights}) at K2.6 widths with random weights, `layers` target layers.
    experts: the routed expert ids this rank holds (default all)."""
    cfg, dcfg = k26_configs(layers, draft_layers)
    with torch.device("meta"):
        target = Target(cfg)
        drafter = Drafter(dcfg)
    materialize(target, device, seed=seed, skip=lambda n: ".experts." in n or n.endswith("mlp.gate.weight"))
    target.inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    materialize(drafter, device, seed=seed + 1)
    drafter.inv_freq = rope_inv_freq(dcfg.dim_head, dcfg.rope_theta, dcfg.rope_scaling).to(device)
    drafter.eval().attach(target)
    moe = {i: random_moe_weights(cfg, device, seed=seed + 100 + i, experts=experts)
           for i in range(layers) if cfg.is_moe_layer(i)}
    return target.eval(), drafter, moe


def _weight_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters()
               if p.device.type != "meta" and ".experts." not in n)


def verify_floor(engine, t: int, distinct: list, prefix: int, bw: float = BW, peak: float = PEAK) -> dict:
    """Seconds for a verify of t rows over `prefix` cached rows: the sum over its kernels of max(bytes / bw,
    flops / peak), by default the H200's ceilings (GPU.md); pass the ones measured on the card that ran.
    distinct: experts touched per MoE layer (measured). Parts: dense (every non-expert weight byte once, router
    fp32, lm_head), attention (latent rows once vs 2176 flop per head-key pair), moe."""
    cfg, tgt = engine.cfg, engine.target
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * (0.5 + 2 / cfg.quantization_config.group_size)
    dense = attn = 0.0
    for i, layer in enumerate(tgt.model.layers):
        wb = _weight_bytes(layer)
        dense += max(wb / bw, t * wb / peak)                                  # 2 * t * (wb / 2) flops
        if cfg.is_moe_layer(i):
            dense += cfg.n_routed_experts * cfg.hidden_size * 4 / bw
        keys = prefix + t
        attn += max(keys * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 / bw,
                    2176 * cfg.num_attention_heads * t * keys / peak)
    moe = sum(distinct) * expert_bytes / bw
    head = tgt.lm_head.weight.numel() * tgt.lm_head.weight.element_size()
    dense += max(head / bw, t * head / peak)
    return dict(dense=dense, attention=attn, moe=moe, total=dense + attn + moe, expert_bytes=expert_bytes)


def distinct_experts(engine, prompt, mode: str, budget, rows: int) -> list:
    """Experts touched per MoE layer by one verify of `rows` rows, from an eager pass with the router logged."""
    engine.expert_log = []
    eager, engine.eager = engine.eager, True
    try:
        engine.generate(prompt, max_new_tokens=2, mode=mode, budget=budget)
        return [int(idx.unique().numel()) for _, idx in engine.expert_log if idx.shape[0] == rows]
    finally:
        engine.eager, engine.expert_log = eager, None
