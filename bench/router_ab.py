"""The router GEMM's two paths at the engine's shapes: moe_router_gemm (fp32 SIMT, token passes over grid z)
against cuBLAS's fp32 GEMM (x.float() then F.linear), to set optimized.moe.ROUTER_KERNEL_MAX_T.

    python bench/router_ab.py [--out FILE.json]

Each path: 20 calls captured in one CUDA graph, median of 15 replays, microseconds per call. Prints a table.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]
sys.path.append(os.path.join(HERE, "..", "conformance"))      # mla_cases

import torch  # noqa: E402

from conftest import graph_us, print_table, provenance_info, save_rows  # noqa: E402
from optimized import moe as moe_k  # noqa: E402

SHAPES = {"K2.6 (E 384, D 7168)": (384, 7168), "trained pair (E 16, D 256)": (16, 256)}
TOKENS = (1, 17, 33, 65, 129, 257)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name, (e, d) in SHAPES.items():
        w = torch.randn(e, d, device="cuda") * d ** -0.5
        for t in TOKENS:
            x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
            k = graph_us(lambda: moe_k.router_parts(x, w, path="kernel"))
            c = graph_us(lambda: moe_k.router_parts(x, w, path="cublas"))
            rows.append({"shape": name, "experts": e, "hidden": d, "tokens": t, "kernel_us": round(k, 2),
                         "cublas_us": round(c, 2), "policy": moe_k.router_path(x, w)})
    meta = dict(provenance_info(), router_kernel_max_t=moe_k.ROUTER_KERNEL_MAX_T,
                router_small_w=moe_k.ROUTER_SMALL_W)     # provenance: set DDTREE_COMMIT where .git is stale
    save_rows(args.out, meta, rows)
    print_table(f"router GEMM, us per call ({meta['gpu']}), policy = the path the engine takes",
                ["shape", "T", "kernel", "cuBLAS", "policy"],
                [(r["shape"], r["tokens"], r["kernel_us"], r["cublas_us"], r["policy"]) for r in rows])


if __name__ == "__main__":
    main()
