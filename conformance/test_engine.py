"""The optimized engine (optimized.engine, optimized.generate) against the reference decoder.

CPU (CI): the engine's round logic (static buffers, gather-then-write commit, the drafter over a masked static
context, bucketed lengths, the tail block) through the "torch" backend in float64 equals reference.generate
token for token AND round for round (acceptance lengths), for ar/chain/ddtree over hypothesis-drawn seeds and
budgets, and with sampling (the torch backend draws with the reference's sampler and generator).

GPU (marked gpu): the "cuda" backend (Numba tree kernels, CuPy MLA + INT4 MoE, CUDA graphs, bf16) on the trained
pair's golden prompts. bf16 cannot equal the float32 reference everywhere, so every token the engine emits is
checked teacher-forced: the float32 reference, run over the prompt and the engine's own tokens, must rank the
engine's token first, or within NEAR_TIE_BF16 of its first (a near-tie proven by the reference's own
top-1/top-2 margin); such ties are counted and reported. Graph replays equal eager runs exactly; ddtree equals
ar (same policy); a capture that fails raises.
"""
import json
import os
import warnings

import pytest
import torch
from hypothesis import example, given, strategies as st

import optimized
import reference
from optimized.engine import Engine, GraphCaptureError, RoundTiming, node_count
from reference.factory import random_drafter, random_target, tiny_config, tiny_drafter_config

HERE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "trained")
VOCAB = 8
# Teacher-forced allowance for the bf16 engine against the float32 reference, in logits. The trained pair's
# bf16 reference differs from its float32 run by up to ~0.1 logit (test_bf16_error_scale measures it in the
# same session and checks this bound covers it); a token is a near-tie only below this margin.
NEAR_TIE_BF16 = 0.25


def make_pair(seed=0, vocab=VOCAB, block_size=8, **overrides):
    cfg = tiny_config(vocab_size=vocab, **overrides)
    target = random_target(cfg, seed=seed, dtype=torch.float64)
    return target, random_drafter(tiny_drafter_config(cfg, block_size=block_size), target, seed=seed + 100,
                                  dtype=torch.float64)


@pytest.fixture(scope="module")
def pair():
    return make_pair(0)


def prompt_for(seed, n=5, vocab=VOCAB):
    return torch.randint(0, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- CPU: the torch backend equals the reference round for round ---------------------------------------------

@given(seed=st.integers(0, 1000), mode=st.sampled_from(["ar", "chain", "ddtree"]),
       budget=st.sampled_from([None, 0, 1, 3, 7, 8, 12, 40, 100]), new=st.integers(1, 30))
@example(seed=0, mode="ddtree", budget=100, new=30)
@example(seed=1, mode="ddtree", budget=12, new=3)         # the tail block (depth < block_size - 1)
def test_torch_backend_equals_reference(pair, seed, mode, budget, new):
    target, drafter = pair
    prompt = prompt_for(seed)
    ref = reference.generate(target, drafter, prompt, max_new_tokens=new, mode=mode, budget=budget)
    out = optimized.generate(target, drafter, prompt, max_new_tokens=new, mode=mode, budget=budget,
                             backend="torch", max_seq_len=64)
    assert out.backend == "torch"
    assert out.tokens == ref.tokens, f"{mode}/{budget}: tokens differ"
    assert out.acceptance_lengths == ref.acceptance_lengths, f"{mode}/{budget}: rounds differ"


def test_torch_backend_accepts_several_tokens(pair):
    """The equality above is not vacuous: rounds accept more than the bonus, across bucket boundaries."""
    target, drafter = pair
    out = optimized.generate(target, drafter, prompt_for(3, n=250), max_new_tokens=40, mode="ddtree", budget=40,
                             backend="torch", max_seq_len=300)
    ref = reference.generate(target, drafter, prompt_for(3, n=250), max_new_tokens=40, mode="ddtree", budget=40)
    assert out.tokens == ref.tokens and out.acceptance_lengths == ref.acceptance_lengths
    assert max(out.acceptance_lengths) >= 3


def test_torch_backend_prefill_chunks_and_sampling():
    """A prompt longer than one verify block (1024 rows) is prefilled in chunks; sampling uses the reference's
    sampler with the same generator, so sampled runs match too."""
    target, drafter = make_pair(1, vocab=16, max_position_embeddings=1400)
    prompt = prompt_for(5, n=1100, vocab=16)
    for kw in (dict(), dict(temperature=0.8, top_p=0.9, seed=7)):
        ref = reference.generate(target, drafter, prompt, max_new_tokens=12, mode="ddtree", budget=10, **kw)
        out = optimized.generate(target, drafter, prompt, max_new_tokens=12, mode="ddtree", budget=10,
                                 backend="torch", max_seq_len=1200, **kw)
        assert out.tokens == ref.tokens and out.acceptance_lengths == ref.acceptance_lengths, kw


def test_stop_tokens_and_max_new_tokens(pair):
    target, drafter = pair
    prompt = prompt_for(2)
    ref = reference.generate(target, drafter, prompt, max_new_tokens=25, mode="ddtree", budget=12)
    stop = ref.tokens[6]
    for new, stops in ((25, [stop]), (4, None)):
        r = reference.generate(target, drafter, prompt, max_new_tokens=new, mode="ddtree", budget=12,
                               stop_token_ids=stops)
        o = optimized.generate(target, drafter, prompt, max_new_tokens=new, mode="ddtree", budget=12,
                               stop_token_ids=stops, backend="torch", max_seq_len=64)
        assert o.tokens == r.tokens and o.acceptance_lengths == r.acceptance_lengths
    assert o.tokens == ref.tokens[:4]


def test_engine_rejects_bad_input(pair):
    target, drafter = pair
    eng = Engine(target, drafter, backend="torch", max_seq_len=32)
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.generate(prompt_for(0, n=20), max_new_tokens=20)
    with pytest.raises(ValueError, match="budget 1025"):
        eng.generate(prompt_for(0), max_new_tokens=4, budget=1025)
    with pytest.raises(ValueError, match="trace"):
        eng.generate(prompt_for(0), max_new_tokens=4, trace=True)
    with pytest.raises(ValueError, match="backend must be one of"):
        Engine(target, drafter, backend="triton")
    with pytest.raises(ValueError, match="backend='cuda' needs the target on a CUDA device"):
        Engine(target, drafter, backend="cuda")
    other_target, other_drafter = make_pair(1)
    with pytest.raises(ValueError, match="different target"):
        Engine(target, other_drafter, backend="torch")


def test_node_count_matches_the_reference_tree():
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for budget in (0, 1, 5, 6, 7, 30, 36, 100, 10_000):
        for depth in range(0, 6):
            tree = reference.build_tree(logits[:depth], budget)
            assert tree.n == node_count(depth, min(budget, 6), budget), (depth, budget)


# ---- GPU: the cuda backend on the trained pair ------------------------------------------------------------------

def golden():
    return json.load(open(os.path.join(HERE, "golden.json")))


@pytest.fixture(scope="module")
def gpu_pairs():
    bf = optimized.load_target(os.path.join(HERE, "target"))
    bf_d = optimized.load_drafter(os.path.join(HERE, "drafter"), target=bf)
    f32 = reference.load_target(os.path.join(HERE, "target"), dtype=torch.float32, device="cuda")
    return (bf, bf_d), f32


def teacher_forced_check(f32_target, prompt, tokens, what):
    """Every emitted token is the float32 reference's top-1 given the same prefix, or within NEAR_TIE_BF16 of
    it. Returns the number of near-ties."""
    ids = torch.tensor(prompt + tokens[:-1], device="cuda")
    logits = f32_target.logits(ids)[len(prompt) - 1:].double()                 # row i predicts tokens[i]
    tok = torch.tensor(tokens, device="cuda")
    best = logits.max(-1).values
    gap = best - logits.gather(1, tok[:, None]).squeeze(1)
    ties = int((gap > 0).sum())
    worst = int(gap.argmax())
    assert float(gap.max()) < NEAR_TIE_BF16, (
        f"{what}: token {worst} ({tokens[worst]}) is {float(gap[worst]):.4f} logits below the float32 reference's "
        f"top-1 {int(logits[worst].argmax())}: not a near-tie (< {NEAR_TIE_BF16})")
    return ties


@pytest.mark.gpu
def test_bf16_error_scale(gpu_pairs):
    """NEAR_TIE_BF16 is an honest bound: it covers the bf16 reference's own logit error (with 2x headroom)."""
    (bf, _), f32 = gpu_pairs
    worst = 0.0
    for case in golden()["cases"][:8]:
        ids = torch.tensor(case["prompt_ids"] + case["tokens"], device="cuda")
        worst = max(worst, float((bf.logits(ids).double() - f32.logits(ids).double()).abs().max()))
    print(f"bf16 reference vs float32: max |logit error| {worst:.4f} (NEAR_TIE_BF16 = {NEAR_TIE_BF16})")
    assert 0 < worst and 2 * worst <= NEAR_TIE_BF16


@pytest.mark.gpu
@pytest.mark.parametrize("mode,budget", [("ar", None), ("chain", None), ("ddtree", 4), ("ddtree", 16),
                                         ("ddtree", 64), ("ddtree", 256)])
def test_cuda_engine_matches_reference_on_golden_prompts(gpu_pairs, mode, budget):
    (bf, bf_d), f32 = gpu_pairs
    g = golden()
    ties = exact = 0
    taus = []
    for j, case in enumerate(g["cases"]):
        out = optimized.generate(bf, bf_d, case["prompt_ids"], max_new_tokens=g["max_new_tokens"], mode=mode,
                                 budget=budget)
        assert out.backend == "cuda" and out.graphs >= 1
        assert len(out.tokens) == g["max_new_tokens"] or out.tokens[-1] in f32.cfg.eos_token_id
        ties += teacher_forced_check(f32, case["prompt_ids"], out.tokens, f"{mode}/{budget} case {j}")
        exact += out.tokens == case["tokens"]
        taus += out.acceptance_lengths
    print(f"{mode}/{budget}: {exact}/{len(g['cases'])} cases equal the float32 golden tokens exactly; "
          f"{ties} bf16 near-tie token(s); mean tau {sum(taus) / len(taus):.3f}")
    if ties:
        warnings.warn(f"{mode}/{budget}: {ties} near-tie token(s) (reference margin < {NEAR_TIE_BF16})")
    assert exact >= len(g["cases"]) // 2, "most golden cases should match exactly; bf16 ties are the exception"


@pytest.mark.gpu
def test_cuda_graphs_equal_eager_and_ddtree_equals_ar(gpu_pairs):
    (bf, bf_d), f32 = gpu_pairs
    g = golden()
    ties = 0
    for case in g["cases"][:6]:
        p, n = case["prompt_ids"], g["max_new_tokens"]
        graph = optimized.generate(bf, bf_d, p, max_new_tokens=n, mode="ddtree", budget=32)
        eager = optimized.generate(bf, bf_d, p, max_new_tokens=n, mode="ddtree", budget=32, eager=True)
        assert eager.graphs == 0 and graph.graphs >= 1
        assert graph.tokens == eager.tokens and graph.acceptance_lengths == eager.acceptance_lengths
        ar = optimized.generate(bf, bf_d, p, max_new_tokens=n, mode="ar")
        if ar.tokens != graph.tokens:            # different verify shapes may flip a bf16 near-tie
            ties += teacher_forced_check(f32, p, ar.tokens, "ar") + teacher_forced_check(f32, p, graph.tokens, "dd")
    print(f"optimized ddtree vs optimized ar: {ties} near-tie token(s)")


@pytest.mark.gpu
def test_stage_timing_and_budget_1024(gpu_pairs):
    (bf, bf_d), _ = gpu_pairs
    case = golden()["cases"][0]
    timing = RoundTiming()
    out = optimized.generate(bf, bf_d, case["prompt_ids"], max_new_tokens=32, mode="ddtree", budget=1024,
                             timing=timing)
    plain = optimized.generate(bf, bf_d, case["prompt_ids"], max_new_tokens=32, mode="ddtree", budget=1024)
    assert out.tokens == plain.tokens and timing.rounds == len(out.acceptance_lengths)
    assert all(getattr(timing, s) > 0 for s in ("draft", "tree", "verify", "commit"))


@pytest.mark.gpu
def test_failed_capture_raises(gpu_pairs):
    """A stage that synchronises (illegal while capturing) makes capture fail: GraphCaptureError, no fallback."""
    (bf, bf_d), _ = gpu_pairs
    eng = Engine(bf, bf_d, max_seq_len=512)
    orig = eng._stage_tree

    def syncing(r, key):
        orig(r, key)
        int(r.ids.sum())                          # a host read inside the captured region

    eng._stage_tree = syncing
    case = golden()["cases"][0]
    with pytest.raises(GraphCaptureError, match="capture of the round"):
        eng.generate(case["prompt_ids"], max_new_tokens=8, mode="ddtree", budget=8)
