"""The engine's speed goals (issue 8) as conformance checks, GPU only (`speed` + `gpu` markers). Judged by ratios
measured in the same run, never by absolute times:

  trained pair   optimized ddtree tokens/s >= 2.5x optimized ar and >= 1.3x optimized chain (best budget of
                 16 / 32 / 64 / 128; the 8 golden prompts x 128 tokens; a warm-up pass first, so graphs are
                 captured, then the median of 3 timed passes)
  K2.6 widths    a verify round (budget 32, prefix 4096, 3 layers: 1 dense + 2 MoE, random weights) within 1.3x
                 of the sum of its kernels' floors (optimized.synthetic.verify_floor with the copy bandwidth and bf16
                 matmul rate measured on this card in the same run; distinct experts measured)
The goals not yet met carry xfail marks (strict=False, raises=AssertionError) whose reasons quote the last
measurements, as the tree and MLA speed tests do: they still run and print their ratio, an XPASS shows when a goal
is reached, and any other error (a crash, the wrong backend: pytest.fail) fails the test instead of hiding in it.
"""
import json
import os
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.speed]
HERE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "trained")


def tokens_per_second(fn, prompts, passes: int = 3):
    """New tokens / wall seconds over all prompts: the median of `passes` timed passes after a warm-up pass."""
    for p in prompts:                                              # warm-up: captures, builds
        fn(p)
    rates = []
    for _ in range(passes):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = sum(len(fn(p).tokens) for p in prompts)
        torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t0))
    return sorted(rates)[passes // 2]


@pytest.fixture(scope="module")
def trained_rates():
    """(ar, chain, best ddtree) tokens/s on the trained pair, measured once for the two ratio checks."""
    import optimized
    target = optimized.load_target(os.path.join(HERE, "target"))
    drafter = optimized.load_drafter(os.path.join(HERE, "drafter"), target=target)
    cases = json.load(open(os.path.join(HERE, "golden.json")))["cases"]
    prompts = [c["prompt_ids"] for c in cases]                           # 4 code, 4 plays

    def rate(mode, budget=None):
        return tokens_per_second(lambda p: optimized.generate(target, drafter, p, max_new_tokens=128, mode=mode,
                                                              budget=budget), prompts)

    ar, chain = rate("ar"), rate("chain")
    best = max(rate("ddtree", b) for b in (16, 32, 64, 128))
    out = optimized.generate(target, drafter, prompts[0], max_new_tokens=8, budget=16)
    assert out.backend == "cuda" and out.graphs >= 1, f"ran on backend {out.backend!r} with {out.graphs} graphs"
    print(f"tokens/s: ar {ar:.0f}, chain {chain:.0f}, best ddtree {best:.0f}: {best / ar:.2f}x ar, "
          f"{best / chain:.2f}x chain")
    return ar, chain, best


def test_trained_pair_ddtree_over_ar(trained_rates):
    ar, _, best = trained_rates
    assert best >= 2.5 * ar, f"ddtree {best:.0f} tokens/s is {best / ar:.2f}x ar (goal 2.5x)"


CHAIN_NOT_MET = ("issue 8 goal not met: best ddtree 1.10-1.17x chain (goal 1.3x) in this test in engine runs 6-11 "
                 "(H200, 2026-12-03) and 1.07-1.19x in runs 12-15 (H100, 2026-12-06): the tau ratio is 1.24 at "
                 "budget 32 and 1.35-1.43 at 64-256, where 1.3x would leave a ddtree round 0.02-0.05 ms above "
                 "chain's 0.52 ms (it is 0.10-0.34 ms above); bench/results/engine_notes.md, run 15")


@pytest.mark.xfail(reason=CHAIN_NOT_MET, strict=False, raises=AssertionError)
def test_trained_pair_ddtree_over_chain(trained_rates):
    _, chain, best = trained_rates
    assert best >= 1.3 * chain, f"ddtree {best:.0f} tokens/s is {best / chain:.2f}x chain (goal 1.3x)"


VERIFY_NOT_MET = ("issue 8 goal not yet shown on the H200: this 3-layer K2.6-width verify measured 1.31-1.42x its "
                  "floor (goal 1.3x) in engine runs 6-11 (2026-12-03; 1.33x at ebf1fbc) against the H200's nominal "
                  "ceilings. With the ceilings measured on the card that runs (since run 15) it passed on an H100: "
                  "1.13x and 1.11x (run 15); not yet run that way on an H200; bench/results/engine_notes.md")


@pytest.mark.xfail(reason=VERIFY_NOT_MET, strict=False, raises=AssertionError)
def test_k26_verify_within_floor():
    from optimized.engine import Engine, RoundTiming
    from optimized.synthetic import distinct_experts, k26_engine_parts, verify_floor
    prefix, budget = 4096, 32
    target, drafter, moe = k26_engine_parts(3, "cuda", draft_layers=1)
    eng = Engine(target, drafter, moe_weights=moe, max_seq_len=prefix + 64, stage_timing=True)
    if eng.backend != "cuda":                        # not an AssertionError: the goal's xfail must not hide it
        pytest.fail(f"the engine runs on backend {eng.backend!r}, not the suite's CUDA kernels")
    prompt = torch.randint(0, target.cfg.vocab_size - 8, (prefix,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    eng.generate(prompt, max_new_tokens=9, mode="ddtree", budget=budget, timing=RoundTiming())    # capture
    timing = RoundTiming()
    eng.generate(prompt, max_new_tokens=9, mode="ddtree", budget=budget, timing=timing)
    _, t = eng.round_key("ddtree", budget, 1, prefix)
    from test_moe_kernels import copy_bandwidth, matmul_peak
    bw, peak = copy_bandwidth(), matmul_peak()           # this card's ceilings, measured in this run
    floor = verify_floor(eng, t, distinct_experts(eng, prompt, "ddtree", budget, t), prefix, bw, peak)
    floor = floor["total"] * 1e3
    verify = timing.per_round()["verify"]
    print(f"K2.6 widths, 3 layers, T={t}, prefix {prefix}: verify {verify:.3f} ms, floor {floor:.3f} ms "
          f"(ceilings measured here: copy {bw / 1e12:.2f} TB/s, bf16 {peak / 1e12:.0f} TFLOP/s), "
          f"ratio {verify / floor:.2f}")
    assert verify <= 1.3 * floor, f"verify {verify:.3f} ms is {verify / floor:.2f}x its floor (goal 1.3x)"
