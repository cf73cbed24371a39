"""optimized.debug: the round-by-round comparison that points at the first stage where a fast decoder departs
from the reference, and the engine's own trace (Engine.generate(..., trace=True)).

GPU (marked gpu): the trace read from the captured graphs equals an eager run's.
CPU: the torch-backend engine in float64 traces the same rounds as the reference (no divergence, ar / chain /
ddtree, greedy and with stop tokens cutting a round); faults injected into one stage of one round (a tree row
changed, a target choice changed, an accepted row dropped) are reported at exactly that round and stage, and a
changed target choice comes with the reference's own top-1/top-2 margin at that row, recomputed independently
here.
"""
import pytest
import torch
from hypothesis import given, strategies as st

import reference
from optimized.debug import Divergence, compare_runs, compare_traces, reference_margin
from optimized.engine import Engine
from reference.factory import random_drafter, random_target, tiny_config, tiny_drafter_config

VOCAB = 8


@pytest.fixture(scope="module")
def pair():
    cfg = tiny_config(vocab_size=VOCAB)
    target = random_target(cfg, seed=3, dtype=torch.float64)
    return target, random_drafter(tiny_drafter_config(cfg), target, seed=103, dtype=torch.float64)


def prompt(seed, n=6):
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@given(seed=st.integers(0, 500), mode=st.sampled_from(["ar", "chain", "ddtree"]),
       budget=st.sampled_from([None, 2, 9, 30]), stop=st.sampled_from([None, 3]))
def test_engine_trace_equals_the_reference_trace(pair, seed, mode, budget, stop):
    target, drafter = pair
    eng = Engine(target, drafter, backend="torch", max_seq_len=64)
    cmp = compare_runs(eng, target, drafter, prompt(seed), max_new_tokens=24, mode=mode, budget=budget,
                       stop_token_ids=None if stop is None else [stop])
    assert cmp.divergence is None, str(cmp)
    assert cmp.rounds == len(cmp.reference.trace) == len(cmp.fast.trace)
    assert cmp.rounds >= 1 or cmp.reference.tokens == [stop]                # the prefill's token may stop it
    for f, r in zip(cmp.fast.trace, cmp.reference.trace):       # the fields compared are filled, not empty
        assert len(f.ids) == len(f.parents) == len(f.target_choices) == r.compiled.ids.numel()
        assert f.accepted[0] == 0 and f.emitted == r.emitted


def fault_engine(pair, stage, at_round):
    """A torch-backend engine whose `stage` is wrong in round `at_round` (0-based) only."""
    target, drafter = pair
    eng = Engine(target, drafter, backend="torch", max_seq_len=64)
    calls = {"n": 0}
    if stage == "tree":
        build = eng.ops.build_tree

        def build_tree(logits, budget):
            tree = build(logits, budget)
            calls["n"] += 1
            if calls["n"] == at_round + 1:                  # change the token of the first node (row 1)
                tree.tokens[0] = (tree.tokens[0] + 1) % VOCAB
            return tree
        eng.ops.build_tree = build_tree
    elif stage == "verify":
        choose = eng._choose

        def _choose(logits):
            out = choose(logits)
            calls["n"] += 1
            if calls["n"] == at_round + 2:                  # call 1 picks the prefill's first token
                out = out.clone()
                out[0] = (out[0] + 1) % VOCAB
            return out
        eng._choose = _choose
    elif stage == "follow":
        follow = eng.ops.follow

        def follow_(ids, parents, choices):
            acc, length, bonus = follow(ids, parents, choices)
            calls["n"] += 1
            if calls["n"] == at_round + 1 and int(length) > 1:   # drop the last accepted row
                k = int(length) - 1
                bonus = ids[acc[k]].reshape(bonus.shape)
                acc = acc.clone()
                acc[k] = -1
                length = length - 1
            return acc, length, bonus
        eng.ops.follow = follow_
    return eng


@pytest.mark.parametrize("stage", ["tree", "verify", "follow"])
def test_an_injected_fault_is_reported_at_its_round_and_stage(pair, stage):
    target, drafter = pair
    for seed in range(40):                         # a prompt whose round 1 accepts a draft token (for follow)
        ref = reference.generate(target, drafter, prompt(seed), max_new_tokens=24, mode="ddtree", budget=9)
        if len(ref.acceptance_lengths) > 2 and ref.acceptance_lengths[1] > 1:
            break
    else:
        pytest.fail("no prompt accepts a draft token in round 1")
    cmp = compare_runs(fault_engine(pair, stage, 1), target, drafter, prompt(seed), max_new_tokens=24,
                       mode="ddtree", budget=9)
    d = cmp.divergence
    assert isinstance(d, Divergence) and d.round == 1 and d.stage == stage, str(cmp)
    if stage == "tree":
        assert d.row == 1 and d.expected != d.actual
    if stage == "verify":
        ref1 = cmp.reference.trace[1]
        assert d.row == 0 and d.expected == ref1.target_choices[0] and d.actual == (d.expected + 1) % VOCAB
        before = prompt(seed) + cmp.reference.tokens[:1] + cmp.reference.trace[0].emitted
        logits = target.logits(torch.tensor(before))[-1]
        top = logits.topk(2).values
        assert d.margin == pytest.approx(float(top[0] - top[1]), rel=1e-12) and d.margin > 0
    if stage == "follow":
        assert d.expected[0][:-1] == d.actual[0] and d.expected != d.actual


def test_round_count_and_prefill_differences_are_reported(pair):
    target, drafter = pair
    ref = reference.generate(target, drafter, prompt(1), max_new_tokens=16, mode="chain", trace=True)
    div, rounds = compare_traces(ref.trace[:-1], ref.trace, ref.tokens[0])
    assert div.stage == "rounds" and div.expected == len(ref.trace) and div.actual == len(ref.trace) - 1
    assert rounds == len(ref.trace) - 1
    eng = Engine(target, drafter, backend="torch", max_seq_len=64)
    choose = eng._choose
    eng._choose = lambda logits: (choose(logits) + 1) % VOCAB if logits.shape[0] == 1 else choose(logits)
    cmp = compare_runs(eng, target, drafter, prompt(1), max_new_tokens=8, mode="ar")
    assert cmp.divergence.stage == "prefill" and cmp.divergence.margin == pytest.approx(
        reference_margin(target, prompt(1)))


def test_cli_compare_on_the_trained_pair():
    import os
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(__file__), "..")
    pair_dir = os.path.join(root, "fixtures", "trained")
    args = [sys.executable, "-m", "optimized", "compare", "--target", os.path.join(pair_dir, "target"),
            "--drafter", os.path.join(pair_dir, "drafter"), "--prompt", "Enter the King and Queen, with Lords.",
            "--mode", "ddtree", "--budget", "16", "--max-new-tokens", "24", "--backend", "torch", "--device", "cpu",
            "--dtype", "float32"]
    r = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert "identical" in r.stdout and "no divergence in" in r.stdout, r.stdout


@pytest.mark.gpu
def test_cuda_trace_under_graphs_equals_eager():
    """The trace read back from the captured round's tensors (graph mode) equals an eager run's, round for round;
    the comparison with the bf16 reference decoder on the same GPU is printed (its first difference, if any, is
    normally a tree built from slightly different bf16 draft logits: harmless for the tokens)."""
    import json
    import os
    import optimized
    here = os.path.join(os.path.dirname(__file__), "..", "fixtures", "trained")
    target = optimized.load_target(os.path.join(here, "target"))
    drafter = optimized.load_drafter(os.path.join(here, "drafter"), target=target)
    prompt_ids = json.load(open(os.path.join(here, "golden.json")))["cases"][4]["prompt_ids"]
    graphs = Engine(target, drafter, max_seq_len=256)
    eager = Engine(target, drafter, max_seq_len=256, eager=True)
    assert graphs.backend == eager.backend == "cuda"
    g = graphs.generate(prompt_ids, max_new_tokens=48, mode="ddtree", budget=16, trace=True)
    e = eager.generate(prompt_ids, max_new_tokens=48, mode="ddtree", budget=16, trace=True)
    assert graphs.graph_count > 0 and eager.graph_count == 0
    div, rounds = compare_traces(g.trace, e.trace, e.tokens[0])
    assert div is None and rounds == len(e.trace) > 0, str(div)
    ref_t = reference.load_target(os.path.join(here, "target"), dtype=torch.bfloat16, device="cuda")
    ref_d = reference.load_drafter(os.path.join(here, "drafter"), target=ref_t)
    print("engine vs bf16 reference:", compare_runs(graphs, ref_t, ref_d, prompt_ids, max_new_tokens=48,
                                                     mode="ddtree", budget=16))
