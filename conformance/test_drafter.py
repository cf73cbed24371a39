"""The DFlash drafter against the PyPI `dflash` package (z-lab, 0.1.0): same logits, and chain decoding with
the same tokens AND the same per-round acceptance lengths as `dflash.model.dflash_generate`.

Both models are built by their own libraries (transformers DeepseekV3ForCausalLM target, dflash
DFlashDraftModel drafter), saved with `save_pretrained`, and loaded through our loaders (float64).
"""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
dflash_model = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
from transformers import Qwen3Config  # noqa: E402

from compare import assert_close, assert_tokens_equal  # noqa: E402
from reference import generate, load_drafter, load_target  # noqa: E402
from reference.checkpoint import CheckpointError  # noqa: E402
from reference.config import ConfigError  # noqa: E402
from reference.drafter import target_layer_ids_for  # noqa: E402
from test_target_oracle import YARN, hf_model  # noqa: E402

VOCAB = 10


def hf_pair(tmp_path, seed, block_size=8, draft_layers=2, target_overrides=None, draft_rope=None):
    target = hf_model({"vocab_size": VOCAB, "rope_scaling": YARN, **(target_overrides or {})}, seed)
    target.save_pretrained(tmp_path / "target")
    n_t = target.config.num_hidden_layers
    qc = Qwen3Config(hidden_size=32, num_hidden_layers=draft_layers, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, intermediate_size=48, vocab_size=VOCAB, rope_theta=50000.0,
                     max_position_embeddings=256, rms_norm_eps=1e-6, **({"rope_scaling": draft_rope}
                                                                        if draft_rope else {}))
    qc.block_size = block_size
    qc.num_target_layers = n_t
    qc.dflash_config = {"target_layer_ids": target_layer_ids_for(n_t, draft_layers), "mask_token_id": VOCAB - 1}
    torch.manual_seed(seed)
    drafter = dflash_model.DFlashDraftModel(qc).to(torch.float64).eval()
    g = torch.Generator().manual_seed(seed + 50)
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if n.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    drafter.save_pretrained(tmp_path / "drafter")
    ours_t = load_target(str(tmp_path / "target"), dtype=torch.float64)
    ours_d = load_drafter(str(tmp_path / "drafter"), target=ours_t)
    return target, drafter, ours_t, ours_d


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
def test_draft_logits_match_dflash(tmp_path, seed, rope):
    hf_t, hf_d, target, drafter = hf_pair(tmp_path, seed, draft_rope=rope)
    ids = torch.randint(0, VOCAB - 1, (11,), generator=torch.Generator().manual_seed(seed))
    layers = hf_d.target_layer_ids
    with torch.no_grad():
        out = hf_t(ids[None], output_hidden_states=True)
        feats = dflash_model.extract_context_feature(out.hidden_states, layers)
        block = torch.tensor([[int(ids[-1])] + [VOCAB - 1] * 7])
        noise = torch.nn.functional.embedding(block, hf_t.get_input_embeddings().weight)
        h = hf_d(target_hidden=feats, noise_embedding=noise, position_ids=torch.arange(0, 19)[None])
        want = hf_d.compute_logits(h[:, 1:], hf_t.lm_head)[0]                 # [7, V]
    ctx = drafter.new_context()
    o = target.forward(ids, hidden_layers=list(layers))
    drafter.extend_context(ctx, torch.cat([o.hidden[i] for i in layers], -1))
    assert_close(drafter(ctx, int(ids[-1])), want, "hf_float64", "draft logits vs dflash")


# Seeds where the random drafter is right now and then (a run of 1s would not test acceptance).
@pytest.mark.parametrize("seed,block_size,max_new", [(1, 8, 40), (3, 8, 33), (1, 4, 30), (1, 2, 31)])
def test_chain_matches_dflash_generate(tmp_path, monkeypatch, seed, block_size, max_new):
    """Tokens and per-round acceptance lengths equal `dflash_generate`'s, stop tokens included."""
    import time
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)   # its stats timer assumes CUDA
    hf_t, hf_d, target, drafter = hf_pair(tmp_path, seed, block_size=block_size)
    prompt = torch.randint(0, VOCAB - 1, (6,), generator=torch.Generator().manual_seed(seed + 7))
    runs = {}
    for stops in (None, [int(prompt[0])]):
        runs[stops is None] = want = dflash_model.dflash_generate(hf_d, hf_t, prompt[None], max_new, stops, temperature=0.0,
                                            return_stats=True)
        got = generate(target, drafter, prompt.tolist(), max_new_tokens=max_new, mode="chain",
                       stop_token_ids=stops)
        assert_tokens_equal(got.tokens, want.output_ids[0, prompt.numel():].tolist(), f"tokens stops={stops}")
        assert got.acceptance_lengths == want.acceptance_lengths, (got.acceptance_lengths,
                                                                   want.acceptance_lengths)
    full = runs[True]
    assert max(full.acceptance_lengths) >= 2, "no multi-token round: weak test"
    ddtree = generate(target, drafter, prompt.tolist(), max_new_tokens=max_new, mode="ddtree", budget=10)
    assert_tokens_equal(ddtree.tokens, full.output_ids[0, prompt.numel():].tolist(), "ddtree vs dflash chain")


# ---- load_drafter validation ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    hf_pair(tmp, 0)
    return tmp


def edited(saved_pair, tmp_path, **dflash_changes):
    import shutil
    dst = tmp_path / "d"
    shutil.copytree(saved_pair / "drafter", dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in dflash_changes.items():
        if k in ("target_layer_ids", "mask_token_id"):
            cfg["dflash_config"][k] = v
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("change,match", [
    (dict(hidden_size=48), "hidden_size 48 != target hidden_size 32"),
    (dict(vocab_size=25), "vocab_size 25 != target vocab_size 10"),
    (dict(target_layer_ids=[0, 3]), r"target_layer_ids \[3\] outside"),
    (dict(mask_token_id=10), "mask_token_id 10 outside"),
    (dict(block_size=1), "block_size 1 < 2"),
])
def test_load_drafter_rejects_a_mismatched_pair(saved_pair, tmp_path, change, match):
    target = load_target(str(saved_pair / "target"), dtype=torch.float64)
    with pytest.raises(ConfigError, match=match):
        load_drafter(edited(saved_pair, tmp_path, **change), target=target)


def test_load_drafter_file_errors(saved_pair, tmp_path):
    target = load_target(str(saved_pair / "target"), dtype=torch.float64)
    path = edited(saved_pair, tmp_path)
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    state.pop("fc.weight")
    save_file(state, file)
    with pytest.raises(CheckpointError, match="missing tensor 'fc.weight'"):
        load_drafter(path, target=target)
    state["fc.weight"] = torch.zeros(3, 3)
    save_file(state, file)
    with pytest.raises(CheckpointError, match="'fc.weight' has .* expected a float tensor of shape"):
        load_drafter(path, target=target)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_drafter(str(tmp_path / "nope"), target=target)
