"""Probe: where the GPU tree build's time goes, per kernel and per timer. For each (kind, L, budget) it times
torch.amax over the logits (a one-kernel read of the same bytes), the top-K's two launches alone and together,
the beam, compile_tree and the whole build_tree, with both timers the project uses:
  single  one call between CUDA events after a spin kernel (the tree bench's `device` column)
  graph   20 calls captured in one CUDA graph, median of 15 replays, per call (the A/B scripts' rule)
The difference between the two is the per-call launch and event overhead that a kernel boundary costs.
Usage (GPU): python bench/topk_probe.py [--out FILE.json]"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, ".."), os.path.join(HERE, "..", "conformance")]
from conftest import graph_us, print_table, save_rows  # noqa: E402
from optimized import tree_numba as opt  # noqa: E402
from test_tree_numba import event_median, logits  # noqa: E402
from reference import tree as ref  # noqa: E402

CASES = [("normal", 7, 16), ("normal", 15, 16), ("normal", 15, 256), ("draftlike", 15, 256), ("normal", 15, 1024)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for kind, depth, budget in CASES:
        x = logits(kind, depth, 163_840, 7 * depth + budget, device="cuda")
        cfg = opt.DEFAULT_CONFIG
        k = min(budget, x.shape[1])
        tree = opt.build_tree(x, budget)
        ws = opt._workspace(x.device, depth, x.shape[1], k, budget, cfg)
        xa = opt._arr(x)
        a = ws.a
        grid = (ws.parts, depth)
        s = lambda: opt._stream(x.device)   # noqa: E731  (the current stream when called: graph capture sees it)

        def stats():
            opt.topk_stats[grid, cfg.topk_threads, s()](xa, x.shape[1], ws.chunk, k, a["part_m"], a["part_s"],
                                                        a["lse"], a["hist"], a["done"], a["sel"])

        def filt():
            opt.topk_filter[grid, cfg.topk_threads, s()](xa, x.shape[1], ws.chunk, k, a["lse"], a["sel"],
                                                         a["counters"], a["cand"], a["top_lp"], a["top_id"])

        outs = [torch.empty(budget, dtype=t, device="cuda") for t in (torch.long,) * 3 + (torch.float64,)]
        fns = {
            "amax": lambda: torch.amax(x, dim=1),
            "stats": stats,
            "filter": filt,
            "topk": lambda: (stats(), filt()),
            "beam": lambda: opt._beam_stage(k, budget, ws, cfg, s(), *outs),
            "compile": lambda: opt.compile_tree(tree, 1, 100),
            "build": lambda: opt.build_tree(x, budget),
            "build+compile": lambda: opt.compile_tree(opt.build_tree(x, budget), 1, 100),
        }
        stats()
        filt()
        torch.cuda.synchronize()
        want_lp, want_id = ref.ranked_candidates(x.cpu(), k)
        same = bool(torch.equal(ws.top_id.cpu(), want_id) and torch.equal(ws.top_lp.cpu(), want_lp))
        row = dict(kind=kind, L=depth, budget=budget, same_as_reference=same, threads=opt.TOPK_T, parts=ws.parts,
                   chunk=ws.chunk, depth_max=int(tree.depths.max()))
        for name, fn in fns.items():
            row[f"{name}_single"] = round(event_median(fn, ahead=True) * 1e6, 1)
            row[f"{name}_graph"] = round(graph_us(fn), 1)
        rows.append(row)
    names = ["amax", "stats", "filter", "topk", "beam", "compile", "build", "build+compile"]
    print_table("us: single call (events) / per call in a 20-call graph",
                ["kind", "L", "B", "T", "parts", "exact"] + names,
                [[r["kind"], r["L"], r["budget"], r["threads"], r["parts"], r["same_as_reference"]]
                 + [f'{r[n + "_single"]} / {r[n + "_graph"]}' for n in names] for r in rows])
    meta = dict(device=torch.cuda.get_device_name(), commit=os.environ.get("DDTREE_COMMIT", "?"))
    save_rows(args.out, meta, rows)


if __name__ == "__main__":
    main()
