"""A few routed MoE calls at K2.6 shapes (16 experts held) for a profiler, T from argv (default 1), e.g.

    ncu --kernel-name regex:moe_int4_gemm --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        --section WarpStateStats --section SchedulerStats --section Occupancy python bench/moe_profile.py 1

(ncu fixes the SM clock at base, 1.35 GHz on the H200, unless given --clock-control none.)"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "conformance")]
import optimized.moe as moe_k  # noqa: E402
from test_moe_kernels import k26_random_layer  # noqa: E402

layer = k26_random_layer("cuda", n_experts=16)
w, cfg = layer["weights"], layer["cfg"]
x = torch.randn(int(sys.argv[1]) if len(sys.argv) > 1 else 1, cfg.hidden_size, device="cuda").to(torch.bfloat16)
idx, wt = moe_k.router(x, w, cfg)
for _ in range(3):
    moe_k.moe_routed(x, idx, wt, w)
torch.cuda.synchronize()
print("ok", idx.tolist())
