"""A few GPU tree builds (draft logits [L, V = 163,840] -> Tree) for a profiler; argv: L budget kind [beam]
(default 15 256 draftlike; beam: Config.beam above list_max, "threshold" also sets list_max = 0), e.g.

    ncu --kernel-name regex:'topk|beam' --launch-skip 10 --launch-count 10 \\
        --metrics gpu__time_duration.sum python bench/tree_profile.py 15 256 draftlike

(one build is 3 launches: topk_stats, topk_filter, beam; ncu fixes the SM clock at base.) For
stall reasons by source line, build the kernels with line info and collect the source counters:

    DDTREE_NUMBA_LINEINFO=1 ncu --kernel-name regex:topk_filter --launch-skip 5 --launch-count 1 --set full \
        --import-source yes -o tree_hist python bench/tree_profile.py 15 256 normal"""
import dataclasses
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "conformance")]
from optimized import tree_numba as opt  # noqa: E402
from test_tree_numba import logits  # noqa: E402

depth = int(sys.argv[1]) if len(sys.argv) > 1 else 15
budget = int(sys.argv[2]) if len(sys.argv) > 2 else 256
kind = sys.argv[3] if len(sys.argv) > 3 else "draftlike"
beam = sys.argv[4] if len(sys.argv) > 4 else "tree"
cfg = opt.DEFAULT_CONFIG if beam == "tree" else dataclasses.replace(opt.DEFAULT_CONFIG, list_max=0, beam=beam)
x = logits(kind, depth, 163_840, depth * 7 + budget, device="cuda")
for _ in range(4):
    tree = opt.build_tree(x, budget, config=cfg)
torch.cuda.synchronize()
print("ok", opt.backend(), tree.n, int(tree.depths.max()))
