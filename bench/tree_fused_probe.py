"""Tuning probe for the one-launch top-K (topk_fused): its device time against the two-launch top-K at V = 163,840,
with the values per thread set by DDTREE_TOPK_FUSED_EPT (read at import). Checks each result against
reference.tree.ranked_candidates. Prints one line per case and writes $DDTREE_BENCH_OUT/fused_probe_ept<E>.json.

    DDTREE_TOPK_FUSED_EPT=32 python bench/tree_fused_probe.py"""
import dataclasses
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "conformance")]
from optimized import tree_numba as opt  # noqa: E402
from optimized.kernels import tree_topk  # noqa: E402
from reference import tree as ref  # noqa: E402
from test_tree_numba import event_median, logits  # noqa: E402

VOCAB = 163_840
assert opt.backend() == "cuda"
cfg = opt.DEFAULT_CONFIG
fcfg = dataclasses.replace(cfg, fused_max=opt.CAP // 2)
rows = []
for kind in ("normal", "draftlike"):
    for depth in (7, 15):
        for budget in (16, 32, 64):
            x = logits(kind, depth, VOCAB, depth * 7 + budget, device="cuda")
            k = min(budget, VOCAB)
            xa, s = opt._arr(x), opt._stream(x.device)
            opt.build_tree(x, budget, config=fcfg)
            fws = opt._workspace(x.device, depth, VOCAB, k, budget, fcfg)
            opt.build_tree(x, budget, config=cfg)
            ws = opt._workspace(x.device, depth, VOCAB, k, budget, cfg)
            two = event_median(lambda: opt._topk_stage(xa, VOCAB, k, ws, cfg, s), ahead=True)
            row = dict(kind=kind, depth=depth, budget=budget, ept=tree_topk.FEPT, parts=fws.fused_parts,
                       fused=fws.fused, two_launch_us=two * 1e6, fused_us=None, same=None)
            if fws.fused:
                row["fused_us"] = event_median(lambda: opt._topk_stage(xa, VOCAB, k, fws, fcfg, s), ahead=True) * 1e6
                lp, ids = ref.ranked_candidates(x.cpu(), k)
                row["same"] = bool(torch.equal(fws.top_id.cpu(), ids) and torch.equal(fws.top_lp.cpu(), lp))
            rows.append(row)
            f = "-" if row["fused_us"] is None else f"{row['fused_us']:.1f}"
            print(f"EPT {tree_topk.FEPT:2d} {kind:9s} L={depth:2d} B={budget:3d} parts {fws.fused_parts:3d} "
                  f"two-launch {row['two_launch_us']:6.1f} us  fused {f:>6s} us  same {row['same']}", flush=True)
out = os.environ.get("DDTREE_BENCH_OUT")
if out:
    with open(os.path.join(out, f"fused_probe_ept{tree_topk.FEPT}.json"), "w") as fh:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)
