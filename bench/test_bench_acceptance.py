"""Acceptance report of the trained pair: mean tau for chain and ddtree budgets, and the distinct routed
experts each verify touches per MoE layer (what decides the budget on a MoE target).

    pytest bench/test_bench_acceptance.py --benchmark-json=bench/results/acceptance.json -s

Held-out prompts: for each domain, ACCEPT_PROMPTS windows of 48 tokens cut from held-out documents at seeded
offsets; 128 new tokens each, greedy, reference decoder in float32. Writes bench/results/acceptance.{json,md,png}
(the committed report) and puts the numbers in benchmark.extra_info.
"""
import json
import os
import time

import pytest
import torch

from reference import generate, load_drafter, load_target
from reference.target import Int4Linear, MoE

ROOT = os.path.join(os.path.dirname(__file__), "..")
PAIR = os.path.join(ROOT, "fixtures", "trained")
RESULTS = os.path.join(os.path.dirname(__file__), "results")
BUDGETS = [4, 8, 16, 32, 64, 128]
PROMPTS = int(os.environ.get("ACCEPT_PROMPTS", 32))
NEW = int(os.environ.get("ACCEPT_NEW_TOKENS", 128))


def heldout_prompts(tok, domain, n, length=48, seed=0):
    """n prompts of `length` tokens cut at seeded offsets from the held-out documents of `domain` (rebuilt by
    fixtures/trained/corpus.py into .data/)."""
    path = os.path.join(PAIR, ".data", f"{domain}.heldout.json")
    if not os.path.exists(path):
        pytest.skip(f"{path} missing: run fixtures/trained/corpus.py (the held-out split is rebuilt from it)")
    docs = [d for d in json.load(open(path)).values()]
    g = torch.Generator().manual_seed(seed)
    prompts = []
    while len(prompts) < n:
        ids = tok.encode(docs[int(torch.randint(0, len(docs), (1,), generator=g))]).ids
        if len(ids) < length + 1:
            continue
        start = int(torch.randint(0, len(ids) - length, (1,), generator=g))
        prompts.append(ids[start:start + length])
    return prompts


class ExpertCounter:
    """Distinct routed experts per target forward per MoE layer (forward hooks on the routers)."""

    def __init__(self, target):
        self.calls = []
        self.layers = [m.gate for m in target.modules() if isinstance(m, MoE)]
        self.hooks = [g.register_forward_hook(self.hook) for g in self.layers]

    def hook(self, module, inputs, output):
        self.calls.append(int(output[0].unique().numel()))

    def per_forward(self):
        """[forward][MoE layer] distinct expert counts, in call order (the prefill is the first forward)."""
        return [self.calls[i:i + len(self.layers)] for i in range(0, len(self.calls), len(self.layers))]

    def close(self):
        for h in self.hooks:
            h.remove()


def run_sweep(target, drafter, prompts):
    # "ar" is left out: its verify is one token, so it touches exactly num_experts_per_tok experts per layer.
    configs = [("chain", None)] + [("ddtree", b) for b in BUDGETS]
    rows = []
    for mode, budget in configs:
        for domain, plist in prompts.items():
            counter = ExpertCounter(target)
            lengths, experts, t0, tokens = [], [], time.perf_counter(), 0
            for p in plist:
                counter.calls.clear()
                out = generate(target, drafter, p, max_new_tokens=NEW, mode=mode, budget=budget)
                lengths += out.acceptance_lengths
                tokens += len(out.tokens)
                experts += [c for fwd in counter.per_forward()[1:] for c in fwd]      # verifies only
            counter.close()
            rows.append({"mode": mode, "budget": budget, "domain": domain, "prompts": len(plist),
                         "rounds": len(lengths), "mean_tau": sum(lengths) / len(lengths),
                         "distinct_experts_per_verify_layer": sum(experts) / len(experts),
                         "cpu_tokens_per_s": tokens / (time.perf_counter() - t0)})
            print(f"{mode:6s} {str(budget):>4s} {domain:5s} tau {rows[-1]['mean_tau']:.3f} "
                  f"experts {rows[-1]['distinct_experts_per_verify_layer']:.2f} "
                  f"{rows[-1]['cpu_tokens_per_s']:.1f} tok/s", flush=True)
    return rows


def reading(rows, depth: int, n_experts: int) -> str:
    """The report's reading, derived from the rows (so it cannot go stale when the pair is retrained)."""
    out = []
    for domain in sorted({r["domain"] for r in rows}):
        chain = next(r["mean_tau"] for r in rows if r["domain"] == domain and r["mode"] == "chain")
        dd = sorted((r for r in rows if r["domain"] == domain and r["mode"] == "ddtree"), key=lambda r: r["budget"])
        taus = [r["mean_tau"] for r in dd]
        grows = all(b > a for a, b in zip(taus, taus[1:]))
        beat = [r["budget"] for r in dd if r["mean_tau"] > chain]
        below = [f"{r['budget']} ({r['mean_tau']:.2f})" for r in dd if r["mean_tau"] <= chain]
        exp = [r["distinct_experts_per_verify_layer"] for r in dd]
        out.append(f"{domain}: tau {'grows with' if grows else 'does not grow monotonically with'} the budget "
                   f"({taus[0]:.2f} at {dd[0]['budget']} to {taus[-1]:.2f} at {dd[-1]['budget']}, chain {chain:.2f}); "
                   + (f"budgets {', '.join(map(str, beat))} beat the chain" if beat else "no budget beats the chain")
                   + (f", budget {', '.join(below)} does not" if below else "")
                   + f"; distinct experts per verify per layer {exp[0]:.1f} -> {exp[-1]:.1f} of {n_experts}.")
    return ("\nReading (computed from the rows above): " + " ".join(out) + f" A budget below the draft depth "
            f"(L = {depth}) has fewer nodes than the {depth}-node chain, so it cannot accept a run longer than its "
            "budget; on a MoE target a wider verify touches more experts, which is what decides the budget.\n")


def write_report(rows, info, n_experts, depth):
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "acceptance.json"), "w") as f:
        json.dump({"provenance": info, "new_tokens": NEW, "prompts_per_domain": PROMPTS, "rows": rows}, f,
                  indent=1)
    lines = ["| mode | budget | domain | mean tau | distinct experts / verify / layer | CPU tokens/s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['budget'] or '-'} | {r['domain']} | {r['mean_tau']:.3f} | "
                     f"{r['distinct_experts_per_verify_layer']:.2f} of {n_experts} | {r['cpu_tokens_per_s']:.1f} |")
    with open(os.path.join(RESULTS, "acceptance.md"), "w") as f:
        f.write(f"Trained pair, {PROMPTS} held-out prompts per domain, {NEW} new tokens, greedy, reference "
                f"float32 on {info.get('cpu_count')} CPU cores (commit {info.get('commit')}).\n\n")
        f.write("\n".join(lines) + "\n")
        f.write(reading(rows, depth, n_experts))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax2 = ax.twinx()
    for domain, style in (("code", "-"), ("plays", "--")):
        dd = [r for r in rows if r["domain"] == domain and r["mode"] == "ddtree"]
        ch = [r for r in rows if r["domain"] == domain and r["mode"] == "chain"][0]
        ax.plot([r["budget"] for r in dd], [r["mean_tau"] for r in dd], "o" + style, color="C0",
                label=f"ddtree tau ({domain})")
        ax.axhline(ch["mean_tau"], color="C2", linestyle=style, label=f"chain tau ({domain})")
        ax2.plot([r["budget"] for r in dd], [r["distinct_experts_per_verify_layer"] for r in dd], "s" + style,
                 color="C3", label=f"distinct experts ({domain})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("DDTree budget (nodes)")
    ax.set_ylabel("mean tau (tokens per round)", color="C0")
    ax2.set_ylabel(f"distinct routed experts per verify per layer (of {n_experts})", color="C3")
    ax2.set_ylim(0, n_experts)
    fig.legend(loc="lower right", fontsize=7, bbox_to_anchor=(0.88, 0.15))
    ax.set_title("Trained tiny pair: acceptance and expert traffic vs budget")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "acceptance.png"), dpi=120)


def cache_dequantized_experts(target):
    """Dequantize every INT4 expert once instead of at every use: the same float32 weights bit for bit
    (dequantization is deterministic), about 1.5x faster decoding on a 2-core CPU."""
    for mod in target.modules():
        if isinstance(mod, Int4Linear):
            w = mod.dequantized(torch.float32)
            mod.forward = lambda x, w=w: torch.nn.functional.linear(x, w)


def test_acceptance_report(benchmark, provenance):
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(PAIR, "target", "tokenizer.json"))
    target = load_target(os.path.join(PAIR, "target"), dtype=torch.float32)
    cache_dequantized_experts(target)
    drafter = load_drafter(os.path.join(PAIR, "drafter"), target=target)
    prompts = {d: heldout_prompts(tok, d, PROMPTS) for d in ("code", "plays")}
    rows = benchmark.pedantic(run_sweep, args=(target, drafter, prompts), rounds=1, iterations=1)
    benchmark.extra_info["rows"] = rows
    write_report(rows, dict(provenance), target.cfg.n_routed_experts, drafter.block_size - 1)
    for domain in prompts:
        chain = next(r for r in rows if r["domain"] == domain and r["mode"] == "chain")["mean_tau"]
        taus = [r["mean_tau"] for r in rows if r["domain"] == domain and r["mode"] == "ddtree"]
        print(f"{domain}: chain {chain:.3f}, ddtree {' '.join(f'{t:.3f}' for t in taus)}")
