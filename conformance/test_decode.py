"""The reference decode loop: greedy DDTree == greedy AR token-for-token, commit invariants, stop tokens,
lossless sampling (chi-square), and clear errors for bad input. Float64 tiny models throughout.

A tiny vocabulary (16) makes a random drafter right often enough that rounds accept several tokens, so the
tree, the walk and the compaction are exercised beyond the root.
"""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from compare import assert_close, assert_tokens_equal
from reference import generate
from reference.decode import commit, compile_tree, draft, follow_verified_tree, prefill, verify
from reference.factory import random_drafter, random_target, tiny_config, tiny_drafter_config
from reference.tree import build_tree

VOCAB = 8


def make_pair(seed=0, vocab=VOCAB, block_size=8, **target_overrides):
    cfg = tiny_config(vocab_size=vocab, **target_overrides)
    target = random_target(cfg, seed=seed, dtype=torch.float64)
    dcfg = tiny_drafter_config(cfg, block_size=block_size)
    return target, random_drafter(dcfg, target, seed=seed + 100, dtype=torch.float64)


@pytest.fixture(scope="module")
def pair():
    return make_pair(0)


def prompt_for(seed, n=5, vocab=VOCAB):
    return torch.randint(0, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@given(seed=st.integers(0, 1000), budget=st.sampled_from([0, 1, 2, 3, 5, 7, 8, 12, 15, 16, 40, 100]))
@example(seed=0, budget=0)          # AR through the verify path
@example(seed=0, budget=8)          # budget == vocab
@example(seed=2, budget=40)         # budget > vocab
@example(seed=1, budget=12)         # budget + 1 != block_size
@settings(max_examples=12)
def test_greedy_ddtree_equals_ar(pair, seed, budget):
    target, drafter = pair
    prompt = prompt_for(seed)
    ar = generate(target, drafter, prompt, max_new_tokens=20, mode="ar")
    dd = generate(target, drafter, prompt, max_new_tokens=20, mode="ddtree", budget=budget)
    assert_tokens_equal(dd.tokens, ar.tokens, f"ddtree budget {budget} vs ar")
    assert sum(dd.acceptance_lengths) == len(dd.tokens) - 1          # the first token comes from the prefill
    assert all(1 <= a <= drafter.block_size for a in dd.acceptance_lengths)
    assert ar.acceptance_lengths == [1] * (len(ar.tokens) - 1)


def test_ddtree_accepts_more_than_one_token_somewhere(pair):
    """Guard for the test above: the tiny vocabulary really produces multi-token rounds."""
    target, drafter = pair
    taus = []
    for seed in range(4):
        taus += generate(target, drafter, prompt_for(seed), max_new_tokens=20, mode="ddtree",
                         budget=60).acceptance_lengths
    assert max(taus) >= 3, taus


@pytest.mark.parametrize("seed", [0, 1])
def test_chain_equals_ar(pair, seed):
    target, drafter = pair
    prompt = prompt_for(seed)
    ar = generate(target, drafter, prompt, max_new_tokens=20, mode="ar")
    ch = generate(target, drafter, prompt, max_new_tokens=20, mode="chain")
    assert_tokens_equal(ch.tokens, ar.tokens, "chain vs ar")


def test_block_size_two_full_vocab_budget_accepts_every_round():
    """One drafted position and every token in the tree: the target's choice is always a node."""
    target, drafter = make_pair(3, block_size=2)
    out = generate(target, drafter, prompt_for(3), max_new_tokens=21, mode="ddtree", budget=VOCAB + 4)
    assert out.acceptance_lengths == [2] * 10, out.acceptance_lengths
    ar = generate(target, drafter, prompt_for(3), max_new_tokens=21, mode="ar")
    assert_tokens_equal(out.tokens, ar.tokens, "block 2 vs ar")


def test_commit_leaves_the_cache_of_a_causal_prefill(pair):
    """After every round (budgets changing from round to round, so tree shapes differ), the target's latent
    cache equals a causal prefill of the committed tokens and the drafter context equals one built from that
    prefill's features: nothing of an earlier tree survives."""
    target, drafter = pair
    prompt = torch.tensor(prompt_for(7))
    state = prefill(target, drafter, prompt, lambda l: l.argmax(-1))
    committed = prompt.tolist()
    for budget in [5, 1, 12, 0, 3, 7]:
        tree = build_tree(draft(drafter, state, drafter.block_size), budget)
        compiled = compile_tree(tree, state.bonus, state.start)
        logits, feats = verify(target, state, compiled, drafter.target_layer_ids)
        accepted, bonus = follow_verified_tree(compiled, logits.argmax(-1))
        committed += [int(compiled.ids[i]) for i in accepted]
        commit(state, drafter, accepted, feats, int(bonus))

        fresh = target.new_cache()
        out = target.forward(torch.tensor(committed), cache=fresh, hidden_layers=drafter.target_layer_ids)
        assert len(state.cache) == len(committed) == state.start
        for layer in range(target.cfg.num_hidden_layers):
            assert_close(state.cache.get(layer), fresh.get(layer), "float64_reassoc", f"cache layer {layer}")
        ctx = drafter.new_context()
        drafter.extend_context(ctx, torch.cat([out.hidden[i] for i in drafter.target_layer_ids], -1))
        assert ctx.length == state.context.length
        for layer in range(drafter.cfg.num_hidden_layers):
            assert_close(state.context.k[layer], ctx.k[layer], "float64_reassoc", f"draft k {layer}")
            assert_close(state.context.v[layer], ctx.v[layer], "float64_reassoc", f"draft v {layer}")


def test_stop_token_as_accepted_node_and_as_bonus(pair):
    """A stop token ends generation whether it arrives as an accepted node or as the bonus; the output is the
    AR output cut just after the stop token's first occurrence. Both arrivals are exercised."""
    target, drafter = pair
    seen = set()
    for seed in range(12):
        prompt = prompt_for(seed)
        ar = generate(target, drafter, prompt, max_new_tokens=24, mode="ar").tokens
        stop = ar[min(6, len(ar) - 1)]
        want = ar[:ar.index(stop) + 1]
        out = generate(target, drafter, prompt, max_new_tokens=24, mode="ddtree", budget=15,
                       stop_token_ids=[stop], trace=True)
        assert_tokens_equal(out.tokens, want, f"seed {seed} stop {stop}")
        if out.trace:
            last = out.trace[-1]
            # cut before the bonus: the stop was an accepted node; otherwise it was the bonus itself
            seen.add("bonus" if len(last.emitted) == len(last.accepted) else "node")
        if seen == {"bonus", "node"}:
            break
    assert seen == {"bonus", "node"}, seen


def test_mask_token_emitted_by_the_target_is_kept(pair):
    """The drafter's mask id is an ordinary token for the target: when the target emits it, it stays."""
    target, _ = pair
    prompt = prompt_for(2)
    ar = generate(target, None, prompt, max_new_tokens=16, mode="ar").tokens
    mask = ar[3]
    drafter = random_drafter(tiny_drafter_config(target.cfg, mask_token_id=mask), target, seed=5,
                             dtype=torch.float64)
    out = generate(target, drafter, prompt, max_new_tokens=16, mode="ddtree", budget=8)
    assert mask in out.tokens
    assert_tokens_equal(out.tokens, ar, "with mask id emitted")


def test_max_new_tokens_is_respected(pair):
    target, drafter = pair
    for n in (1, 2, 3, 9):
        out = generate(target, drafter, prompt_for(1), max_new_tokens=n, mode="ddtree", budget=15)
        assert len(out.tokens) == n and sum(out.acceptance_lengths) == n - 1


def test_trace_records_each_round(pair):
    target, drafter = pair
    out = generate(target, drafter, prompt_for(4), max_new_tokens=12, mode="ddtree", budget=6, trace=True)
    assert len(out.trace) == len(out.acceptance_lengths)
    for t, a in zip(out.trace, out.acceptance_lengths):
        assert t.tree.n <= 6 and t.accepted[0] == 0 and len(t.emitted) == a
        assert len(t.target_choices) == t.tree.n + 1


# ---- sampling: lossless ---------------------------------------------------------------------------------------

def chi2_pvalue(observed: dict, expected: dict) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    small = [k for k, e in expected.items() if e < 5]
    obs = [observed.get(k, 0) for k in expected if k not in small] + [sum(observed.get(k, 0) for k in small)]
    exp = [e for k, e in expected.items() if k not in small] + [sum(expected[k] for k in small)]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
@pytest.mark.parametrize("mode,budget", [("ar", None), ("ddtree", 8), ("ddtree", 2), ("chain", None)])
def test_sampled_tokens_follow_the_target_distribution(mode, budget):
    """The first three sampled tokens (t1 from the prefill, t2 from the root row, t3 from a tree row when a
    node was accepted) follow the target's exact joint distribution p(t1) p(t2|t1) p(t3|t1,t2).
    Chi-square at significance 1e-3, fixed seeds (deterministic); vocab 6, 2500 samples."""
    target, drafter = make_pair(11, vocab=6, block_size=4)
    prompt = [1, 4, 2]
    temperature = 1.3
    n = 2500
    # exact joint from the target itself
    expected = {}
    p1 = torch.softmax(target.logits(torch.tensor(prompt))[-1] / temperature, -1)
    for a in range(6):
        p2 = torch.softmax(target.logits(torch.tensor(prompt + [a]))[-1] / temperature, -1)
        for b in range(6):
            p3 = torch.softmax(target.logits(torch.tensor(prompt + [a, b]))[-1] / temperature, -1)
            for c in range(6):
                expected[(a, b, c)] = float(p1[a] * p2[b] * p3[c]) * n
    observed = {}
    accepted_nodes = 0
    for s in range(n):
        out = generate(target, drafter, prompt, max_new_tokens=3, mode=mode, budget=budget,
                       temperature=temperature, seed=s)
        key = tuple(out.tokens)
        observed[key] = observed.get(key, 0) + 1
        accepted_nodes += out.acceptance_lengths[0] > 1
    p = chi2_pvalue(observed, expected)
    assert p > 1e-3, f"{mode}/{budget}: chi-square p = {p:.2e}"
    if mode == "ddtree" and budget == 8:
        assert accepted_nodes > n // 10, "too few accepted tree nodes for the test to mean anything"


def test_chi2_detects_a_wrong_distribution():
    """The chi-square helper above can fail: a biased sample is rejected."""
    expected = {k: 250.0 for k in range(8)}
    biased = {k: (400 if k == 0 else 200) for k in range(8)}
    assert chi2_pvalue(biased, expected) < 1e-6
    assert chi2_pvalue({k: 250 for k in range(8)}, expected) > 0.99


def test_sampler_top_k_and_top_p():
    from reference.decode import sample
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, 1.0, 1.0, 2, g)) for _ in range(200)}
    assert draws == {0, 1}
    draws = {int(sample(logits, 1.0, 0.5, 0, g)) for _ in range(200)}
    assert draws == {0}                                  # p(0) = 0.64 > 0.5: the nucleus is one token
    assert int(sample(logits, 0.0, 1.0, 0, None)) == 0


# ---- bad input ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_ids=[]), "empty"),
    (dict(prompt_ids=[1, 99]), "outside the vocabulary"),
    (dict(prompt_ids=[-1]), "outside the vocabulary"),
    (dict(budget=-1), "budget"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=600), "max_position_embeddings"),
    (dict(mode="beam"), "mode"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(stop_token_ids=[1000]), "stop_token_ids"),
])
def test_generate_rejects_bad_input(pair, kwargs, match):
    target, drafter = pair
    args = dict(prompt_ids=[1, 2, 3], max_new_tokens=4, mode="ddtree", budget=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        generate(target, drafter, args.pop("prompt_ids"), **args)


def test_generate_rejects_missing_or_foreign_drafter(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, None, [1, 2], mode="ddtree")
    other, _ = make_pair(1)
    with pytest.raises(ValueError, match="different target"):
        generate(other, drafter, [1, 2], mode="chain")
