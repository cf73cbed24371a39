"""A/B of the beams' block size (GPU): tree_beam and the threshold beam alone, each in blocks of 32 threads up to the
budget rounded up to a power of two, on the tree bench's logits (V = 163,840; normal and draft-like; L = 7 / 15;
budgets 16 / 64 / 256). Both beams are latency-bound at small budgets (run 17's ncu: two warps, 7.2 stall cycles an
instruction), so one warp, with no barrier across warps, may beat the budget-sized block.

    python bench/beam_threads_probe.py [out.json]      -> a table on stdout; every tree checked against the default
"""
import dataclasses
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "conformance")]
from optimized import tree_numba as opt  # noqa: E402
from test_tree_numba import event_median, logits, same_tree  # noqa: E402

VOCAB = 163_840


def main(out_path=None):
    assert opt.backend() == "cuda", "needs a CUDA GPU"
    rows = []
    print("| logits | L | budget | beam | threads | us | same tree |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in ("normal", "draftlike"):
        for depth in (7, 15):
            for budget in (16, 64, 256):
                x = logits(kind, depth, VOCAB, depth * 7 + budget, device="cuda")
                k = min(budget, VOCAB)
                ref = opt.build_tree(x, budget)
                outs = [torch.empty(budget, dtype=dt, device="cuda") for dt in (torch.long,) * 3 + (torch.float64,)]
                s = opt._stream(x.device)
                for beam in ("tree", "threshold"):
                    threads = 32
                    while threads <= max(32, 1 << (budget - 1).bit_length()):
                        cfg = dataclasses.replace(opt.DEFAULT_CONFIG, list_max=0, beam=beam, beam_threads=threads)
                        tree = opt.build_tree(x, budget, config=cfg)
                        same = same_tree(tree, ref)
                        ws = opt._workspace(x.device, depth, VOCAB, k, budget, cfg)
                        us = event_median(lambda: opt._beam_stage(k, budget, ws, cfg, s, *outs), ahead=True) * 1e6
                        rows.append(dict(kind=kind, depth=depth, budget=budget, beam=beam, threads=threads,
                                         beam_us=us, same_tree=same, tree_depth=int(ref.depths.max())))
                        print(f"| {kind} | {depth} | {budget} | {beam} | {threads} | {us:.1f} | {same} |", flush=True)
                        threads *= 2
    if out_path:
        meta = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                    commit=os.environ.get("DDTREE_COMMIT", ""))
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(provenance=meta, rows=rows), f, indent=1)
        os.replace(tmp, out_path)
    bad = [r for r in rows if not r["same_tree"]]
    if bad:
        raise SystemExit(f"{len(bad)} builds differ from the default tree: {bad[:3]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
