"""The routed-expert kernels' variants at small and large expert shapes: every compiled (NT, U, XB, S), fused
(one launch) and two launches, against `pick_variant`'s choice, to set its policy for tiny experts (the trained
pair's D 256, F 192, 16 experts top-4) without moving K2.6's (D 7168, F 2048, 384 experts top-8).

    python bench/moe_variant_ab.py [--out FILE.json] [--shapes trained,k26] [--tokens 5,9]

Routing: the tokens' top-k experts drawn uniformly without replacement (seeded). Each case: 20 calls of
`moe_routed` captured in one CUDA graph, median of 15 replays, microseconds per call. Prints a table: the
policy's time, the best variant's and which one.
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]
sys.path.append(os.path.join(HERE, "..", "conformance"))      # mla_cases

import torch  # noqa: E402

from conftest import graph_us, print_table, provenance_info, save_rows  # noqa: E402
from optimized import moe as moe_k  # noqa: E402
from optimized.synthetic import random_moe_weights  # noqa: E402

SHAPES = {"trained": dict(hidden_size=256, moe_intermediate_size=192, n_routed_experts=16, top_k=4,
                          tokens=(1, 8, 17, 33, 65, 129, 257)),
          "k26": dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=384, top_k=8,
                      tokens=(1, 17, 65))}


def routing(t: int, e: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int64)
    w = torch.rand(t, k, generator=gen)
    return idx.cuda(), (w / w.sum(-1, keepdim=True)).cuda()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="trained,k26")
    ap.add_argument("--tokens", default=None, help="comma-separated T for every shape (default: each shape's list)")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    rows = []
    for name in args.shapes.split(","):
        s = SHAPES[name]
        cfg = SimpleNamespace(hidden_size=s["hidden_size"], moe_intermediate_size=s["moe_intermediate_size"],
                              n_routed_experts=s["n_routed_experts"], n_shared_experts=0,
                              quantization_config=SimpleNamespace(group_size=32))
        wts = random_moe_weights(cfg, "cuda", seed=1, shared=False)
        for t in tokens or s["tokens"]:
            x = (torch.randn(t, s["hidden_size"], device="cuda") * 0.5).to(torch.bfloat16)
            idx, w = routing(t, s["n_routed_experts"], s["top_k"], seed=t)
            pairs = idx.numel()
            times = {}
            for v in moe_k.GEMM_VARIANTS:
                for fused in (False, True):
                    if fused and v[3] != 1:
                        continue
                    times[f"{v}{' fused' if fused else ''}"] = graph_us(
                        lambda v=v, fused=fused: moe_k.moe_routed(x, idx, w, wts, variant=v, fused=fused))
            policy = graph_us(lambda: moe_k.moe_routed(x, idx, w, wts))
            best = min(times, key=times.get)
            rows.append(dict(shape=name, tokens=t, pairs=pairs, policy_us=round(policy, 2),
                             policy_variant=str(moe_k.pick_variant(t, s["top_k"], s["n_routed_experts"], True,
                                                                  s["hidden_size"] * s["moe_intermediate_size"])),
                             policy_fused=pairs >= moe_k.fused_min_pairs(wts), best=best,
                             best_us=round(times[best], 2), variants={k: round(v, 2) for k, v in times.items()}))
            print(f"{name} T={t}: policy {policy:.1f} us, best {best} {times[best]:.1f} us", flush=True)
    meta = dict(provenance_info(), fused_min_pairs=moe_k.FUSED_MIN_PAIRS, fused_min_pairs_large=moe_k.FUSED_MIN_PAIRS_LARGE)
    save_rows(args.out, meta, rows)
    print_table(f"\nrouted experts, us per call ({meta['gpu']}); policy = pick_variant + fused_min_pairs",
                ["shape", "T", "pairs", "policy", "policy us", "best", "best us"],
                [(r["shape"], r["tokens"], r["pairs"], r["policy_variant"] + (" fused" if r["policy_fused"] else ""),
                  r["policy_us"], r["best"], r["best_us"]) for r in rows])


if __name__ == "__main__":
    main()
