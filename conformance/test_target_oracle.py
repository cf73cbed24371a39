"""External oracle: our reference target == transformers' DeepseekV3ForCausalLM (float64).

Each case builds a tiny random DeepseekV3ForCausalLM, saves it with `save_pretrained`, loads the directory
through `reference.load_target` and compares logits. With INT4 experts, the HF model's routed experts are
quantized and packed by the `compressed-tensors` library into a Kimi-format checkpoint; the HF side runs the
library's own dequantization of the same tensors.

Tolerance `hf_float64` (1e-5 of max|logit|): transformers runs RMSNorm in float32 even inside a float64 model
(and the router and RoPE angles in float32), so the two agree to float32 precision, not float64.
"""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from compare import assert_close  # noqa: E402
from reference import load_target  # noqa: E402
from reference.checkpoint import INDEX_FILE  # noqa: E402

BASE = dict(vocab_size=101, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            rope_theta=50000.0, max_position_embeddings=256, rms_norm_eps=1e-6, norm_topk_prob=True)
YARN = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 1.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

CASES = {
    "plain": {},
    "yarn": {"rope_scaling": YARN},
    "groups": {"n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
               "rope_scaling": YARN},
    "dense2": {"first_k_dense_replace": 2, "num_hidden_layers": 4},
    "no_q_lora": {"q_lora_rank": None, "rope_scaling": YARN},
    "two_shared": {"n_shared_experts": 2, "norm_topk_prob": False},
}


def hf_model(overrides: dict, seed: int) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**{**BASE, **overrides})
    cfg._experts_implementation = "eager"      # the grouped-GEMM path has no float64 kernel
    model = DeepseekV3ForCausalLM(cfg).to(torch.float64).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # O(1) activations and decisive logits: HF's 0.02 init makes everything ~0
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def ids_for(seed: int, vocab: int, n: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed + 1000))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case, seed):
    model = hf_model(CASES[case], seed)
    model.save_pretrained(tmp_path)
    ours = load_target(str(tmp_path), dtype=torch.float64)
    ids = ids_for(seed, model.config.vocab_size)
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    assert_close(ours.logits(ids), want, "hf_float64", f"{case}/seed{seed} logits")


@pytest.mark.parametrize("seed", [0, 1])
def test_int4_experts_match_transformers(tmp_path, seed):
    """Routed experts packed by compressed-tensors; the HF side runs the library's dequantization."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import load_file, save_file

    model = hf_model({"rope_scaling": YARN}, seed)
    model.save_pretrained(tmp_path)
    gs = 8
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=gs)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    files = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(files) == 1 and not os.path.exists(tmp_path / INDEX_FILE)
    state = load_file(tmp_path / files[0])
    n_quantized = 0
    for name in [n for n in state if ".mlp.experts." in n and n.endswith(".weight")]:
        w = state.pop(name).to(torch.bfloat16)                                   # [N, K]
        g = w.float().view(w.shape[0], -1, gs)
        scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16),
                                                        "weight_zero_point": zp}, scheme)
        prefix = name[: -len(".weight")]
        for k in ("weight_packed", "weight_scale", "weight_shape"):
            state[f"{prefix}.{k}"] = packed[k]
        # The HF model runs the library's dequantization of exactly what was written (scales in float64,
        # so the float64 model sees the exact q * s that our float64 reference uses).
        deq = PackedQuantizationCompressor.decompress(
            {"weight_packed": packed["weight_packed"], "weight_scale": packed["weight_scale"].double(),
             "weight_shape": packed["weight_shape"]}, scheme)["weight"]
        layer, e, proj = prefix.split(".")[2], int(prefix.split(".")[5]), prefix.split(".")[6]
        experts = model.model.layers[int(layer)].mlp.experts
        with torch.no_grad():
            inter = experts.intermediate_dim
            if proj == "gate_proj":
                experts.gate_up_proj[e, :inter] = deq
            elif proj == "up_proj":
                experts.gate_up_proj[e, inter:] = deq
            else:
                experts.down_proj[e] = deq
        n_quantized += 1
    assert n_quantized == 2 * 8 * 3
    save_file(state, tmp_path / files[0], metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(),
                                                                "input_activations": None}},
                                  "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                             "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    ours = load_target(str(tmp_path), dtype=torch.float64)
    expert = ours.model.layers[1].mlp.experts[0].gate_proj
    assert expert.weight_packed.dtype == torch.int32, "routed experts must stay packed in memory"
    ids = ids_for(seed, model.config.vocab_size)
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    assert_close(ours.logits(ids), want, "hf_float64", f"int4/seed{seed} logits")
