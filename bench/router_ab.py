"""The router GEMM's two paths at the engine's shapes: moe_router_gemm (fp32 SIMT, token passes over grid z)
against cuBLAS's fp32 GEMM (x.float() then F.linear), to set optimized.moe.ROUTER_KERNEL_MAX_T.

    python bench/router_ab.py [--out FILE.json]

Each path: 20 calls captured in one CUDA graph, median of 15 replays, microseconds per call. Prints a table.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from optimized import moe as moe_k

SHAPES = {"K2.6 (E 384, D 7168)": (384, 7168), "trained pair (E 16, D 256)": (16, 256)}
TOKENS = (1, 17, 33, 65, 129, 257)


def time_us(fn, calls: int = 20, reps: int = 15) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name, (e, d) in SHAPES.items():
        w = torch.randn(e, d, device="cuda") * d ** -0.5
        for t in TOKENS:
            x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
            k = time_us(lambda: moe_k.router_parts(x, w, path="kernel"))
            c = time_us(lambda: moe_k.router_parts(x, w, path="cublas"))
            rows.append({"shape": name, "experts": e, "hidden": d, "tokens": t, "kernel_us": round(k, 2),
                         "cublas_us": round(c, 2), "policy": moe_k.router_path(x, w)})
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "router_kernel_max_t": moe_k.ROUTER_KERNEL_MAX_T}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"router GEMM, us per call ({meta['gpu']}), policy = the path the engine takes")
    print("| shape | T | kernel | cuBLAS | policy |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['tokens']} | {r['kernel_us']} | {r['cublas_us']} | {r['policy']} |")


if __name__ == "__main__":
    main()
