"""The engine on the trained pair with each tree-kernel choice (issue 5 -> issue 8): tree_beam alone
(Config.list_max = 0), the default (the warp-list beam up to budget LIST_DEFAULT) and the warp-list beam up to its
largest budget, one Engine each in the same process, same prompts. Every choice must give the same tokens (the
trees are equal by conformance); the A/B is tokens/s and the tree stage's device ms per round.

    python bench/engine_tree_ab.py [--out DIR]      (writes DIR/engine_tree_ab.{json,md}; prints the table)

tokens/s: the 8 golden prompts x 128 new tokens, greedy, CUDA graphs, median of 3 passes after a warm-up pass
(prefill included). Stage ms: one more pass over prompt 0 on an engine with one graph per stage.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

import torch  # noqa: E402

import optimized  # noqa: E402
from optimized import tree_numba  # noqa: E402
from optimized.engine import Engine, RoundTiming  # noqa: E402
from conftest import provenance_info  # noqa: E402
from test_bench_engine import HERE as PAIR, NEW, prompts, run_all  # noqa: E402

MODES = [("chain", None)] + [("ddtree", b) for b in (16, 32, 64, 128)]


def choices() -> dict:
    base = tree_numba.DEFAULT_CONFIG
    return {"default": base,
            "tree_beam": dataclasses.replace(base, list_max=0),
            "list": dataclasses.replace(base, list_max=tree_numba.LIST_BMAX)}


def timed_pass(engine, ps, mode, budget):
    return run_all(lambda p: engine.generate(p, max_new_tokens=NEW, mode=mode, budget=budget), ps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("DDTREE_BENCH_OUT"))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    target = optimized.load_target(os.path.join(PAIR, "target"))
    drafter = optimized.load_drafter(os.path.join(PAIR, "drafter"), target=target)
    ps = prompts()
    rows, tokens_of, moe = [], {}, None
    for name, cfg in choices().items():
        eng = Engine(target, drafter, tree_config=cfg, moe_weights=moe)
        staged = Engine(target, drafter, tree_config=cfg, moe_weights=eng.moe_weights, stage_timing=True)
        moe = eng.moe_weights
        assert eng.backend == "cuda"
        for mode, budget in MODES:
            timed_pass(eng, ps, mode, budget)                          # graphs, kernel builds
            secs, outs = [], None
            for _ in range(3):
                s, outs = timed_pass(eng, ps, mode, budget)
                secs.append(s)
            toks = [o.tokens for o in outs]
            ref = tokens_of.setdefault((mode, budget), toks)
            same = toks == ref
            lengths = [x for o in outs for x in o.acceptance_lengths]
            timing = RoundTiming()
            staged.generate(ps[0], max_new_tokens=NEW, mode=mode, budget=budget, timing=RoundTiming())
            staged.generate(ps[0], max_new_tokens=NEW, mode=mode, budget=budget, timing=timing)
            n = sum(len(t) for t in toks)
            row = dict(tree=name, mode=mode, budget=budget, tokens=n, seconds=statistics.median(secs),
                       tokens_per_s=n / statistics.median(secs), tau=sum(lengths) / len(lengths),
                       same_tokens_as_default=same, stage_ms_per_round=timing.per_round(),
                       list_max=cfg.list_max)
            rows.append(row)
            st = row["stage_ms_per_round"]
            print(f"{name:10s} {mode:6s} {str(budget):>4s} {row['tokens_per_s']:7.0f} tok/s tau {row['tau']:.2f} "
                  f"tree {st['tree']:.3f} ms verify {st['verify']:.3f} same={same}", flush=True)
    info = provenance_info()
    lines = [f"# Engine tree-kernel A/B on {info.get('gpu', '?')} (commit {info.get('commit', '?')})", "",
             "Trained pair, 8 golden prompts x 128 tokens, greedy, CUDA graphs; tokens/s median of 3 passes; tree and "
             "verify: device ms per round (stage graphs, prompt 0).", "",
             "| mode | budget | " + " | ".join(f"{c} tok/s | {c} tree ms" for c in choices()) + " | same tokens |",
             "| --- | --- | " + " | ".join("--- | ---" for _ in choices()) + " | --- |"]
    for mode, budget in MODES:
        rs = [r for r in rows if r["mode"] == mode and r["budget"] == budget]
        cells = " | ".join(f"{r['tokens_per_s']:.0f} | {r['stage_ms_per_round']['tree']:.3f}" for r in rs)
        lines.append(f"| {mode} | {budget if budget else '-'} | {cells} | "
                     f"{all(r['same_tokens_as_default'] for r in rs)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "engine_tree_ab.json"), "w") as f:
            json.dump({"provenance": info, "results": rows}, f, indent=1)
        with open(os.path.join(args.out, "engine_tree_ab.md"), "w") as f:
            f.write(text)
    bad = [(r["tree"], r["mode"], r["budget"]) for r in rows if not r["same_tokens_as_default"]]
    if bad:
        raise SystemExit(f"tokens differ from the default tree path: {bad}")


if __name__ == "__main__":
    main()
