"""Probe: where the GPU tree build's time goes, per kernel and per timer. For each (kind, L, budget) it times
torch.amax over the logits (a one-kernel read of the same bytes), the top-K's first launch alone and both together
(the second, which reads the first's histograms and zeroes them, as the difference),
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


def topk_launches(x: torch.Tensor, budget: int):
    """(ws, stats, filt): the two top-K launches of tree_numba._topk_stage on the logits x, each a closure that takes
    the kernels' module (default: the served tree_topk) and launches on the current stream when called (so graph
    capture sees it)."""
    cfg = opt.DEFAULT_CONFIG
    depth, vocab = x.shape
    k = min(budget, vocab)
    ws = opt._workspace(x.device, depth, vocab, k, budget, cfg)
    xa, a, grid, tpb = opt._arr(x), ws.a, (ws.parts, depth), cfg.topk_threads

    def stats(m=opt):
        m.topk_stats[grid, tpb, opt._stream(x.device)](xa, vocab, ws.chunk, a["part_m"], a["part_s"], a["hist"])

    def filt(m=opt):
        m.topk_filter[grid, tpb, opt._stream(x.device)](xa, vocab, ws.chunk, k, a["part_m"], a["part_s"], a["hist"],
                                                        a["counters"], a["cand"], a["top_lp"], a["top_id"])
    return ws, stats, filt


def topk_exact(ws, x: torch.Tensor, k: int) -> bool:
    """The workspace's candidates equal reference.tree.ranked_candidates (after a synchronize)."""
    torch.cuda.synchronize()
    want_lp, want_id = ref.ranked_candidates(x.cpu(), k)
    return bool(torch.equal(ws.top_id.cpu(), want_id) and torch.equal(ws.top_lp.cpu(), want_lp))


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
        ws, stats, filt = topk_launches(x, budget)
        s = lambda: opt._stream(x.device)   # noqa: E731  (the current stream when called: graph capture sees it)

        outs = [torch.empty(budget, dtype=t, device="cuda") for t in (torch.long,) * 3 + (torch.float64,)]
        fns = {
            "amax": lambda: torch.amax(x, dim=1),
            "stats": stats,
            "topk": lambda: (stats(), filt()),
            "beam": lambda: opt._beam_stage(k, budget, ws, cfg, s(), *outs),
            "compile": lambda: opt.compile_tree(tree, 1, 100),
            "build": lambda: opt.build_tree(x, budget),
            "build+compile": lambda: opt.compile_tree(opt.build_tree(x, budget), 1, 100),
        }
        stats()
        filt()
        same = topk_exact(ws, x, k)
        row = dict(kind=kind, L=depth, budget=budget, same_as_reference=same, threads=opt.TOPK_T, parts=ws.parts,
                   chunk=ws.chunk, depth_max=int(tree.depths.max()))
        for name, fn in fns.items():
            row[f"{name}_single"] = round(event_median(fn, ahead=True) * 1e6, 1)
            row[f"{name}_graph"] = round(graph_us(fn), 1)
            if name == "stats":       # stats alone adds into the row histograms that only the filter zeroes
                ws.hist.zero_()
        for timer in ("single", "graph"):   # the filter reads what stats leaves: it is priced as the difference
            row[f"filter_{timer}"] = round(row[f"topk_{timer}"] - row[f"stats_{timer}"], 1)
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
