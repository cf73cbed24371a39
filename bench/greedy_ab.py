"""The greedy choice at the engine's shapes: optimized.greedy.argmax_rows against torch.argmax(-1) on bf16 logits
(the trained pair's V = 4,096 and K2.6's 163,840; rows = 1 / 17 / 65 verify rows).

    python bench/greedy_ab.py [--out FILE.json]

Each: 20 calls captured in one CUDA graph, median of 15 replays, microseconds per call; the floor is the logits'
bytes at the copy bandwidth measured in the same run. Prints a table.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]
sys.path.append(os.path.join(HERE, "..", "conformance"))      # mla_cases, test_moe_kernels

import torch  # noqa: E402

from conftest import graph_us, print_table, provenance_info, save_rows  # noqa: E402
from optimized.greedy import argmax_rows  # noqa: E402
from test_moe_kernels import copy_bandwidth  # noqa: E402

SHAPES = [(1, 4096), (17, 4096), (129, 4096), (1, 163840), (17, 163840), (65, 163840)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows = []
    for r, v in SHAPES:
        x = torch.randn(r, v, device="cuda").to(torch.bfloat16)
        assert torch.equal(argmax_rows(x), x.argmax(-1))
        ours = graph_us(lambda: argmax_rows(x))
        ref = graph_us(lambda: x.argmax(-1))
        rows.append(dict(rows=r, vocab=v, ours_us=round(ours, 2), torch_us=round(ref, 2),
                         floor_us=round(x.numel() * 2 / bw * 1e6, 2)))
    meta = dict(provenance_info(), copy_tbps=bw / 1e12)
    save_rows(args.out, meta, rows)
    print_table(f"greedy argmax, bf16, us per call ({meta['gpu']}, copy {bw / 1e12:.2f} TB/s)",
                ["rows", "V", "argmax_rows", "torch.argmax", "bytes floor"],
                [(r["rows"], r["vocab"], r["ours_us"], r["torch_us"], r["floor_us"]) for r in rows])


if __name__ == "__main__":
    main()
