"""CPU bench of the reference target forward (the ground truth's own speed, for regression tracking)."""
import pytest
import torch

from reference.factory import random_target, tiny_config


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=8, n_routed_experts=16, num_experts_per_tok=4,
                      kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    return random_target(cfg, seed=0, dtype=torch.float32)


@pytest.mark.parametrize("tokens", [1, 16, 128])
def test_reference_prefill(benchmark, provenance, model, tokens):
    torch.set_num_threads(2)
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    benchmark(model.logits, ids)
    benchmark.extra_info["tokens"] = tokens
    benchmark.extra_info["tokens_per_s"] = tokens / benchmark.stats.stats.median


def test_reference_tree_verify(benchmark, provenance, model):
    """One verify of 33 tree rows (budget 32) against a 256-token cached prefix, absorbed MLA."""
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.cfg.vocab_size, (256,), generator=g)
    cache = model.new_cache()
    model.forward(prefix, cache=cache)
    ids = torch.randint(0, model.cfg.vocab_size, (33,), generator=g)
    parents = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 33)]
    depth = [0] * 33
    vis = torch.zeros(33, 256 + 33, dtype=torch.bool)
    vis[:, :256] = True
    for i in range(33):
        depth[i] = 0 if i == 0 else depth[parents[i]] + 1
        j = i
        while True:
            vis[i, 256 + j] = True
            if j == 0:
                break
            j = parents[j]
    pos = torch.tensor(depth) + 256

    def run():
        model.forward(ids, positions=pos, cache=cache, visibility=vis)
        cache.truncate(256)
    benchmark(run)
