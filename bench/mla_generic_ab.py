"""The generic (tiny-fixture) MLA kernel against an earlier build of it, same process, same inputs: microseconds
per call at the trained pair's attention shape (H = 4, C = 64, R = 16) and the tiny-random one (H = 4, C = 16,
R = 8), T = 1 .. 257 tree rows, prefixes 256 and 1024.

    python bench/mla_generic_ab.py --old OLD.cu [--out DIR]     (DIR/mla_generic_ab.{json,md}; prints the table)

OLD.cu is an earlier optimized/kernels/mla_attention.cu whose generic kernel is `mla_generic` with one warp per
query row (grid ceil(M/4), block 128), e.g. `git show 608b51b:optimized/kernels/mla_attention.cu`. Both outputs are
checked against each other (max abs difference, bf16 outputs of two fp32 kernels) before anything is timed.
Timing: 20 launches captured in one CUDA graph, median over 15 replays, per launch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]
sys.path.append(os.path.join(HERE, "..", "conformance"))      # mla_cases; bench's conftest comes first

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mla_cases as mc  # noqa: E402
from optimized import mla_attention as mla  # noqa: E402
from conftest import provenance_info  # noqa: E402

SHAPES = [(h, c, r, t, p) for (h, c, r) in ((4, 64, 16), (4, 16, 8)) for p in (256, 1024)
          for t in (1, 17, 33, 65, 129, 257)]
LAUNCHES, REPLAYS = 20, 15


def old_kernel(path: str):
    import cupy
    cc = torch.cuda.get_device_capability()
    opts = ("-std=c++17",) + (("-arch=sm_90a",) if cc == (9, 0) else ())
    return cupy.RawModule(code=open(path).read(), options=opts).get_function("mla_generic")


def launch_old(fn, case, mask, out):
    t, h, c = case.q_lat.shape
    r, s = case.q_pe.shape[2], case.latent.shape[0]
    ptr = lambda x: np.uint64(x.data_ptr())                                      # noqa: E731
    with mla._cupy_stream(torch.cuda.current_stream().cuda_stream, case.q_lat.device.index):
        fn(((t * h + 3) // 4, 1, 1), (128, 1, 1),
           (ptr(case.q_lat), ptr(case.q_pe), ptr(case.latent), ptr(mask), ptr(out), np.int32(t),
            np.int32(h), np.int32(c), np.int32(r), np.int32(s - t), np.int32(s), np.int32(mask.shape[1]),
            np.float32(case.scale * mla._LOG2E), np.uint64(0)))


def time_us(call) -> float:
    """us per launch: LAUNCHES launches captured in one CUDA graph, median of REPLAYS replays (mla_cases)."""
    return mc.time_graph([call] * LAUNCHES, reps=REPLAYS) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--out", default=os.environ.get("DDTREE_BENCH_OUT"))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    old = old_kernel(args.old)
    rows = []
    for h, c, r, t, p in SHAPES:
        case = mc.make_case(t, h, p, c=c, r=r, seed=t + p)
        pl = mla.plan_for(case.q_lat, case.q_pe, case.latent)
        assert pl.backend == "simt", pl
        new_out, old_out = torch.empty_like(case.q_lat), torch.empty_like(case.q_lat)
        mask = case.tree_mask                                      # packed once, outside the timed graphs
        new_call = lambda: mla.tree_attention(case.q_lat, case.q_pe, case.latent, mask, case.scale,  # noqa: E731
                                              out=new_out)
        old_call = lambda: launch_old(old, case, mask, old_out)                                     # noqa: E731
        new_call()
        old_call()
        torch.cuda.synchronize()
        diff = (new_out.float() - old_out.float()).abs().max().item()
        scale = old_out.float().abs().max().item()
        assert diff <= 0.02 * scale, f"H={h} C={c} T={t} P={p}: outputs differ by {diff} (scale {scale})"
        rows.append(dict(h=h, c=c, r=r, t=t, prefix=p, kernel=pl.kernel, old_us=time_us(old_call),
                         new_us=time_us(new_call), max_abs_diff=diff))
        print(f"H={h} C={c} R={r} T={t:4d} P={p:5d}  old {rows[-1]['old_us']:7.1f} us  new "
              f"{rows[-1]['new_us']:6.1f} us", flush=True)
    prov = provenance_info()
    md = [f"# Generic MLA kernel (tiny fixtures), old vs new on {prov.get('gpu', '?')}", "",
          f"commit {prov.get('commit', '?')}; old = `mla_generic` (a warp per query row), new = "
          f"`mla_generic_c*` (a block per row, a lane per key). us per call, {LAUNCHES} launches per CUDA graph, "
          f"median of {REPLAYS} replays.", "",
          "| H | C | R | T | prefix | old us | new us | old / new |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    md += [f"| {x['h']} | {x['c']} | {x['r']} | {x['t']} | {x['prefix']} | {x['old_us']:.1f} | {x['new_us']:.1f} | "
           f"{x['old_us'] / x['new_us']:.1f} |" for x in rows]
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mla_generic_ab.json"), "w") as f:
            json.dump(dict(provenance=prov, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "mla_generic_ab.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
