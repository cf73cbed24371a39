"""The reference target against itself: the equivalences every fast implementation relies on (float64).

- naive MLA == absorbed MLA;
- a tree-masked forward of each node == the causal forward of its ancestor path;
- incremental decode through the cache == full prefill;
- compact-then-continue == prefill of the kept sequence;
- float32 and bf16 run and stay close to float64.
"""
import json
import os

import pytest
import torch
from hypothesis import example, given, strategies as st

from compare import assert_close
from reference import load_config, load_target
from reference.config import ConfigError, TargetConfig
from reference.factory import random_target, tiny_config, write_random_target
from reference.target import Target

SHARED = os.path.join(os.path.dirname(__file__), "..", "fixtures", "configs")
K26 = os.path.join(SHARED, "kimi-k2.6-text.config.json")


@pytest.fixture(scope="module")
def model():
    return random_target(tiny_config(), seed=7, dtype=torch.float64)


def rand_ids(seed, n, vocab=97):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def random_parents(seed, n):
    """parents[i] in 0..i for nodes 1..n (node 0 = root): any rooted tree in topological order."""
    g = torch.Generator().manual_seed(seed)
    return [int(torch.randint(0, i + 1, (1,), generator=g)) for i in range(n)]


@given(seed=st.integers(0, 10_000), n=st.integers(1, 24))
def test_naive_equals_absorbed(model, seed, n):
    ids = rand_ids(seed, n)
    naive = model.forward(ids, attention="naive").logits
    absorbed = model.forward(ids, attention="absorbed").logits
    assert_close(absorbed, naive, "float64_reassoc", "absorbed vs naive MLA")


@given(seed=st.integers(0, 10_000), prefix=st.integers(1, 12), nodes=st.integers(1, 16))
@example(seed=0, prefix=1, nodes=1)
def test_tree_forward_equals_ancestor_chains(model, seed, prefix, nodes):
    """Node i of a tree verify, with positions start + depth and visibility prefix + ancestors, gives the
    logits (and hidden states) of running its ancestor path causally after the prefix."""
    parents = random_parents(seed, nodes)                    # parent of node i+1
    ids = rand_ids(seed + 1, prefix + nodes + 1)
    prompt, tree_ids = ids[:prefix], ids[prefix:]           # tree_ids[0] = root
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    n1 = nodes + 1
    vis = torch.zeros(n1, prefix + n1, dtype=torch.bool)
    vis[:, :prefix] = True
    for i in range(n1):
        j = i
        while True:
            vis[i, prefix + j] = True
            if j == 0:
                break
            j = parents[j - 1]
    cache = model.new_cache()
    model.forward(prompt, cache=cache)
    out = model.forward(tree_ids, positions=torch.tensor(depth) + prefix, cache=cache, visibility=vis,
                        hidden_layers=[0, 2])
    for i in range(n1):
        path, j = [], i
        while True:
            path.append(j)
            if j == 0:
                break
            j = parents[j - 1]
        chain = torch.cat([prompt, tree_ids[torch.tensor(path[::-1])]])
        ref = model.forward(chain, hidden_layers=[0, 2])
        assert_close(out.logits[i], ref.logits[-1], "float64_reassoc", f"tree node {i} (path {path[::-1]})")
        assert_close(out.hidden[2][i], ref.hidden[2][-1], "float64_reassoc", f"node {i} hidden[2]")


@given(seed=st.integers(0, 10_000), split=st.lists(st.integers(1, 5), min_size=1, max_size=5))
def test_incremental_equals_prefill(model, seed, split):
    ids = rand_ids(seed, sum(split))
    full = model.forward(ids, attention="naive").logits
    cache, got, at = model.new_cache(), [], 0
    for n in split:
        got.append(model.forward(ids[at:at + n], cache=cache).logits)
        at += n
    assert len(cache) == ids.numel()
    assert_close(torch.cat(got), full, "float64_reassoc", "incremental decode vs prefill")


@given(seed=st.integers(0, 10_000), prefix=st.integers(1, 8), extra=st.integers(1, 8))
def test_compact_then_continue_equals_prefill(model, seed, prefix, extra):
    """Run prefix + a chain of `extra` tokens, keep an increasing subset of the new rows whose j-th kept row
    has depth j (the DDTree commit shape: a chain keeps a prefix of itself), continue decoding; the result
    equals a prefill of the kept sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = rand_ids(seed, prefix + extra + 3)
    keep = list(range(int(torch.randint(1, extra + 1, (1,), generator=g))))
    cache = model.new_cache()
    model.forward(ids[:prefix + extra], cache=cache)
    cache.compact(prefix, keep)
    assert len(cache) == prefix + len(keep)
    tail = ids[prefix + extra:]
    got = model.forward(tail, cache=cache).logits
    kept = torch.cat([ids[:prefix], ids[prefix:prefix + extra][keep], tail])
    want = model.forward(kept).logits[-tail.numel():]
    assert_close(got, want, "float64_reassoc", "compact-then-continue vs prefill")


def test_compact_tree_rows_to_a_path(model):
    """Compacting tree rows (accepted path = nodes 0, 2, 5 at depths 0, 1, 2) then continuing equals a
    prefill of prefix + path: the tree rows' RoPE positions equal their new slots."""
    prompt = rand_ids(1, 5)
    tree_ids = rand_ids(2, 6)
    depth = [0, 1, 1, 2, 2, 2]
    vis = torch.zeros(6, 11, dtype=torch.bool)
    vis[:, :5] = True
    # ancestor chains; parents: nodes 1, 2 <- root, 3 <- 1, 4 and 5 <- 2
    anc = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4], 5: [0, 2, 5]}
    for i, a in anc.items():
        vis[i, [5 + j for j in a]] = True
    cache = model.new_cache()
    model.forward(prompt, cache=cache)
    model.forward(tree_ids, positions=torch.tensor(depth) + 5, cache=cache, visibility=vis)
    cache.compact(5, [0, 2, 5])
    nxt = rand_ids(3, 2)
    got = model.forward(nxt, cache=cache).logits
    want = model.forward(torch.cat([prompt, tree_ids[[0, 2, 5]], nxt])).logits[-2:]
    assert_close(got, want, "float64_reassoc", "tree compaction")


def test_cache_truncate_and_bad_compaction(model):
    cache = model.new_cache()
    model.forward(rand_ids(0, 6), cache=cache)
    cache.truncate(4)
    assert len(cache) == 4
    with pytest.raises(ValueError, match="outside"):
        cache.compact(2, [0, 5])
    with pytest.raises(ValueError, match="outside"):
        cache.truncate(9)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.08)])
def test_lower_precisions_track_float64(tmp_path, dtype, tol):
    path = write_random_target(str(tmp_path / "t"), seed=3)
    ids = rand_ids(5, 10)
    ref = load_target(path, dtype=torch.float64).logits(ids)
    low = load_target(path, dtype=dtype).logits(ids)
    assert low.dtype == dtype
    assert_close(low, ref, tol, f"{dtype} vs float64")


def test_forward_rejects_bad_input(model):
    with pytest.raises(ValueError, match="vocabulary"):
        model.logits(torch.tensor([0, 97]))
    with pytest.raises(ValueError, match="non-empty"):
        model.logits(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="visibility"):
        model.forward(torch.tensor([1, 2]), visibility=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least one"):
        model.forward(torch.tensor([1, 2]), visibility=torch.tensor([[True, False], [False, False]]))
    with pytest.raises(ValueError, match="attention"):
        model.forward(torch.tensor([1]), attention="flash")
    with pytest.raises(ValueError, match="hidden_layers"):
        model.forward(torch.tensor([1]), hidden_layers=[3])


# ---- configs -----------------------------------------------------------------------------------------------

def test_k26_config_loads_without_allocating():
    cfg = load_config(K26)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == \
        (7168, 61, 384, 8)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert cfg.latent_dim == 576 and cfg.eos_token_id == (163586,)
    assert cfg.quantization_config.group_size == 32 and cfg.quantization_config.symmetric
    assert abs(cfg.softmax_scale - 0.1446796) < 1e-6          # 192^-0.5 * (1 + 0.1 ln 64)^2
    assert cfg.rope_scaling.amplitude == 1.0
    with torch.device("meta"):                                   # the whole 1T-parameter module, no memory
        model = Target(cfg)
    total = sum(p.numel() for p in model.parameters())
    packed = sum(b.numel() for n, b in model.named_buffers() if n.endswith("weight_packed"))
    d, layers = 7168, 61
    attn = d * 1536 + 1536 + 1536 * 64 * 192 + d * 576 + 512 + 512 * 64 * 256 + 64 * 128 * d   # 101.1M + norms
    expected = (layers * (attn + 2 * d) + 3 * d * 18432 + 60 * (3 * d * 2048 + 384 * d)
                + 2 * 163840 * d + d)
    assert total == expected                                       # every non-expert (bf16) parameter
    assert abs(attn - 101_122_048) < 4096                          # k2-arch.md §6 per-layer attention count
    assert packed * 8 == 60 * 384 * 3 * 7168 * 2048               # every routed weight, packed 8 per word
    assert model.lm_head.weight.device.type == "meta"


def test_k26_yarn_inverse_frequencies():
    """Pairs 0..19 keep their frequency, 20..31 are divided by the factor (k2-arch.md §2.2)."""
    from reference.target import rope_inv_freq
    cfg = load_config(K26)
    base = rope_inv_freq(64, cfg.rope_theta)
    yarn = rope_inv_freq(64, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(yarn[:20], base[:20])
    assert torch.allclose(yarn[20:], base[20:] / 64, rtol=1e-6)


def test_k25_wrapper_config(tmp_path):
    d = json.load(open(K26))
    q = d.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "kimi_k25", "text_config": d, "quantization_config": q}))
    cfg = load_config(str(tmp_path))
    assert cfg.tensor_prefix == "language_model." and cfg.quantization_config.group_size == 32


@pytest.mark.parametrize("change,match", [
    ({"model_type": "llama"}, "model_type"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                              "config_groups": {"g": {"weights": {"num_bits": 4, "symmetric": False,
                                                                  "strategy": "group", "group_size": 32}}}}},
     "asymmetric"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
])
def test_config_errors_name_the_field(tmp_path, change, match):
    d = json.load(open(K26))
    d.update(change)
    if change.get("kv_lora_rank", 1) is None:
        del d["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=match):
        load_config(str(tmp_path))


def test_config_roundtrip():
    cfg = tiny_config(n_group=2, topk_group=1)
    assert TargetConfig.from_dict(cfg.to_dict()) == cfg
