"""The optimized engine on the trained pair (issue 8): tokens/s and tau for ar, chain, ddtree budgets 4..256 and
budget="auto", optimized (cuda backend, CUDA graphs, bf16) against the reference decoder (bf16 on the same GPU),
plus the per-round stage split (draft / tree / verify / commit) from one graph per stage.

Prompts: the 8 golden prompts (4 code, 4 plays), 128 new tokens each, greedy, no stop tokens. Every config is
warmed up once over all prompts (graph capture, kernel builds), then timed over all prompts: tokens/s = new
tokens / wall seconds of the generate calls (prefill included, as a user sees it). The reference is timed on
the first 2 prompts only (it runs eagerly in Python: slow by design).

    pytest bench/test_bench_engine.py --benchmark-json=out.json        (DDTREE_BENCH_OUT=dir writes
    engine_trained.{json,md,png} there)
Goals (asserted in conformance/test_engine_speed.py on a GPU): ddtree >= 2.5x ar, >= 1.3x chain.
"""
import json
import os
import time

import pytest
import torch

HERE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "trained")
CONFIGS = [("ar", None), ("chain", None)] + [("ddtree", b) for b in (4, 8, 16, 32, 64, 128, 256)] + \
    [("ddtree", "auto")]
NEW = 128
ROWS: list = []
BATCH_ROWS: list = []

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def pair():
    import optimized
    target = optimized.load_target(os.path.join(HERE, "target"))
    return target, optimized.load_drafter(os.path.join(HERE, "drafter"), target=target)


def prompts():
    return [c["prompt_ids"] for c in json.load(open(os.path.join(HERE, "golden.json")))["cases"]]


def run_all(fn, ps):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = [fn(p) for p in ps]
    torch.cuda.synchronize()
    return time.perf_counter() - t0, outs


@pytest.mark.parametrize("mode,budget", CONFIGS, ids=[f"{m}-{b}" for m, b in CONFIGS])
def test_engine_tokens_per_second(benchmark, provenance, pair, mode, budget):
    import optimized
    import reference
    target, drafter = pair
    ps = prompts()

    def opt(p):
        return optimized.generate(target, drafter, p, max_new_tokens=NEW, mode=mode, budget=budget)

    run_all(opt, ps)                                                         # capture graphs, build kernels
    _, outs = benchmark.pedantic(lambda: run_all(opt, ps), rounds=3, iterations=1)
    seconds = benchmark.stats.stats.median
    tokens = sum(len(o.tokens) for o in outs)
    lengths = [x for o in outs for x in o.acceptance_lengths]
    row = dict(mode=mode, budget=budget, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
               tau=sum(lengths) / len(lengths), backend=outs[0].backend, graphs=outs[0].graphs)
    timing = optimized.RoundTiming()
    if budget != "auto":
        optimized.generate(target, drafter, ps[0], max_new_tokens=NEW, mode=mode, budget=budget,
                           timing=optimized.RoundTiming())                  # capture the per-stage graphs
        optimized.generate(target, drafter, ps[0], max_new_tokens=NEW, mode=mode, budget=budget, timing=timing)
        row["stage_ms_per_round"] = timing.per_round()
    # Where the wall time goes outside the rounds' device time: the prefill (+ first token) of every prompt,
    # timed alone (median of 3 passes), and what is left per round (host work between graph replays).
    pre = sorted(run_all(lambda p: optimized.generate(target, drafter, p, max_new_tokens=1, mode=mode,
                                                      budget=budget), ps)[0] for _ in range(3))[1]
    row["prefill_ms_per_prompt"] = pre / len(ps) * 1e3
    if "stage_ms_per_round" in row:
        device = sum(v for k, v in row["stage_ms_per_round"].items() if k != "host")
        row["untimed_host_ms_per_round"] = ((seconds - pre) * 1e3 - len(lengths) * device) / len(lengths)
    ref_ps = ps[:2]
    rmode = "ddtree" if budget == "auto" else mode
    rbudget = 32 if budget == "auto" else budget
    rsec, routs = run_all(lambda p: reference.generate(target, drafter, p, max_new_tokens=NEW, mode=rmode,
                                                       budget=rbudget), ref_ps)
    row["reference_tokens_per_s"] = sum(len(o.tokens) for o in routs) / rsec
    row["speedup_vs_reference"] = row["tokens_per_s"] / row["reference_tokens_per_s"]
    benchmark.extra_info.update({k: v for k, v in row.items() if k != "stage_ms_per_round"})
    ROWS.append(row)


@pytest.mark.parametrize("requests", [1, 2, 4, 8])
def test_engine_batched_throughput(benchmark, provenance, pair, requests):
    """Aggregate tokens/s of ddtree budget 32 over all 8 golden prompts, decoded `requests` at a time (so every
    row does the same work and tau is the same up to bf16 near-ties)."""
    from optimized.engine import Engine
    target, drafter = pair
    ps = prompts()
    eng = Engine(target, drafter, max_seq_len=512, max_requests=requests)

    def run():
        return [o for i in range(0, len(ps), requests)
                for o in eng.generate_batch(ps[i:i + requests], max_new_tokens=NEW, mode="ddtree", budget=32)]
    run()                                                                          # capture
    outs = benchmark.pedantic(run, rounds=3, iterations=1)
    seconds = benchmark.stats.stats.median
    tokens = sum(len(o.tokens) for o in outs)
    row = dict(mode="ddtree-batch", budget=32, requests=requests, tokens=tokens, seconds=seconds,
               tokens_per_s=tokens / seconds, tau=sum(sum(o.acceptance_lengths) for o in outs) /
               sum(len(o.acceptance_lengths) for o in outs))
    benchmark.extra_info.update(row)
    BATCH_ROWS.append(row)


def test_write_report(provenance, bench_out):
    """Summary JSON/markdown/PNG of the rows above (runs last in this file)."""
    out = bench_out
    if not ROWS:
        pytest.skip("no rows: the report follows this file's bench tests")
    ar = next(r for r in ROWS if r["mode"] == "ar")["tokens_per_s"]
    chain = next(r for r in ROWS if r["mode"] == "chain")["tokens_per_s"]
    for r in ROWS:
        r["x_ar"], r["x_chain"] = r["tokens_per_s"] / ar, r["tokens_per_s"] / chain
    info = dict(provenance)
    with open(os.path.join(out, "engine_trained.json"), "w") as f:
        json.dump({"provenance": info, "new_tokens": NEW, "prompts": len(prompts()), "results": ROWS,
                   "batched": BATCH_ROWS}, f, indent=1)
    lines = [f"# Optimized engine on the trained pair ({info.get('gpu', '?')}, commit {info.get('commit', '?')})",
             "", f"8 golden prompts x {NEW} new tokens, greedy, bf16; tokens/s = new tokens / wall time of the "
             "generate calls (prefill included). Stage times: device ms per round, one CUDA graph per stage.", "",
             "Prefill: prompt prefill + first token, ms per prompt (timed alone); host*: wall time per round left "
             "after the prefill and the rounds' device time (graph mode, no stage timing; stage times are those of the "
             "first prompt, so host* is an estimate).", "",
             "| mode | budget | tokens/s | x ar | x chain | tau | reference tokens/s | x reference | draft | tree | "
             "verify | commit | host | prefill | host* |", "|" + " --- |" * 15]
    for r in ROWS:
        st = r.get("stage_ms_per_round", {})
        cell = lambda k: f"{st[k]:.3f}" if k in st else "-"                          # noqa: E731
        lines.append(f"| {r['mode']} | {r['budget'] if r['budget'] is not None else '-'} | {r['tokens_per_s']:.0f} | "
                     f"{r['x_ar']:.2f} | {r['x_chain']:.2f} | {r['tau']:.2f} | {r['reference_tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_reference']:.0f} | {cell('draft')} | {cell('tree')} | {cell('verify')} | "
                     f"{cell('commit')} | {cell('host')} | {r['prefill_ms_per_prompt']:.2f} | "
                     f"{'%.3f' % r['untimed_host_ms_per_round'] if 'untimed_host_ms_per_round' in r else '-'} |")
    if BATCH_ROWS:
        lines += ["", "Several requests per round (generate_batch, ddtree budget 32, the 8 prompts decoded `requests` at "
                  "a time): aggregate tokens/s", "",
                  "| requests | tokens/s | tau |", "| --- | --- | --- |"]
        lines += [f"| {r['requests']} | {r['tokens_per_s']:.0f} | {r['tau']:.2f} |" for r in BATCH_ROWS]
    open(os.path.join(out, "engine_trained.md"), "w").write("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dd = [r for r in ROWS if r["mode"] == "ddtree" and r["budget"] != "auto"]
    auto = next((r for r in ROWS if r["budget"] == "auto"), None)
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r["budget"] for r in dd]
    ax[0].plot(xs, [r["tokens_per_s"] for r in dd], "o-", label="ddtree (optimized)")
    ax[0].axhline(ar, color="gray", ls="--", label="ar (optimized)")
    ax[0].axhline(chain, color="tab:orange", ls=":", label="chain (optimized)")
    if auto:
        ax[0].axhline(auto["tokens_per_s"], color="tab:green", ls="-.", label="ddtree budget=auto")
    ax[0].set(xscale="log", xlabel="budget (tree nodes)", ylabel="tokens/s", title="throughput, concurrency 1")
    ax[0].legend()
    ax[1].plot(xs, [r["tau"] for r in dd], "o-", label="ddtree")
    ax[1].axhline(next(r for r in ROWS if r["mode"] == "chain")["tau"], color="tab:orange", ls=":", label="chain")
    ax[1].set(xscale="log", xlabel="budget (tree nodes)", ylabel="tau (tokens per round)", title="acceptance")
    ax[1].legend()
    fig.suptitle(f"trained pair, {info.get('gpu', '?')}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "engine_trained.png"), dpi=110)
