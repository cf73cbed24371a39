"""moe_router_gemm against an earlier build of it, same process, same inputs: the partial logits must be the same
bits (the reduce-scatter keeps the butterfly's pairing), then microseconds per call at K2.6's router (384 x 7168)
and the trained pair's (16 x 256), T = 1 .. 32 (the tokens the kernel serves).

    python bench/router_ab.py --old OLD.cu [--out DIR]     (DIR/router_ab.{json,md}; prints the table)

OLD.cu: an earlier optimized/kernels/moe_route.cu, e.g. `git show 3ad03dc:optimized/kernels/moe_route.cu`.
Timing: 20 launches captured in one CUDA graph, median over 15 replays, per launch (conformance/mla_cases).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]
sys.path.append(os.path.join(HERE, "..", "conformance"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mla_cases as mc  # noqa: E402
from optimized import moe  # noqa: E402
from optimized.cuda_launch import launch, ptr  # noqa: E402
from conftest import provenance_info  # noqa: E402

SHAPES = [(e, d, t) for (e, d) in ((384, 7168), (16, 256)) for t in (1, 4, 9, 16, 17, 32)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--out", default=os.environ.get("DDTREE_BENCH_OUT"))
    args = ap.parse_args()
    import cupy
    old = cupy.RawModule(code=open(args.old).read(), options=("-std=c++17",)).get_function("moe_router_gemm")
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for e, d, t in SHAPES:
        g = torch.Generator().manual_seed(e + t)
        x = torch.randn(t, d, generator=g).to(torch.bfloat16).cuda()
        w = (torch.randn(e, d, generator=g) * d ** -0.5).cuda()
        assert moe.router_path(x, w) == "kernel"
        old_parts = torch.empty(moe.ROUTER_RK, t, e, dtype=torch.float32, device=dev)
        grid = (-(-e // moe.ROUTER_EG), moe.ROUTER_RK)

        def old_call():
            launch(old, dev, grid, (256,), (ptr(x), ptr(w), np.int32(t), np.int32(e), np.int32(d), ptr(old_parts)))

        def new_call():
            return moe.router_parts(x, w)

        old_call()
        new = new_call()
        torch.cuda.synchronize()
        same = torch.equal(new, old_parts)
        assert same, f"E={e} D={d} T={t}: the partial logits differ from the old kernel's ({(new != old_parts).sum()})"
        rows.append(dict(experts=e, hidden=d, tokens=t, same_bits=same,
                         old_us=mc.time_graph([old_call] * 20, reps=15) * 1e6,
                         new_us=mc.time_graph([new_call] * 20, reps=15) * 1e6))
        print(f"E={e} D={d} T={t:3d}  old {rows[-1]['old_us']:6.2f} us  new {rows[-1]['new_us']:6.2f} us", flush=True)
    prov = provenance_info()
    md = [f"# moe_router_gemm, old vs new on {prov.get('gpu', '?')}", "",
          f"commit {prov.get('commit', '?')}; partial logits bit-equal in every case. us per call, 20 launches per "
          "CUDA graph, median of 15 replays.", "",
          "| experts | hidden | T | old us | new us | old / new |", "| --- | --- | --- | --- | --- | --- |"]
    md += [f"| {r['experts']} | {r['hidden']} | {r['tokens']} | {r['old_us']:.2f} | {r['new_us']:.2f} | "
           f"{r['old_us'] / r['new_us']:.2f} |" for r in rows]
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "router_ab.json"), "w") as f:
            json.dump(dict(provenance=prov, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "router_ab.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
