"""Decode's (T = 1) timeline, block by block: the pair kernel built with -DMLA_TRACE=1 stamps %globaltimer (and
clock64) in every block at entry, when Q has landed, when its pair loop is done and when its partial is stored;
mla_combine stamps each block's entry and exit. Kernel and merge run as one CUDA graph (as the engine runs them),
replayed several times; the stamps of the last replay are read back. Says where the fixed per-call cost sits:
launch skew, the prologue, the loop, the partial write, the gap to the merge, the merge.

python bench/mla_decode_timeline.py [OUT.json] [PREFIX ...]     (repository root, an sm_90 GPU; default 8k 32k 128k)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "conformance")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mla_cases as mc  # noqa: E402
from mla_trace import build, launcher, read_global  # noqa: E402  (bench/, the script's folder)


def timeline(mod, prefix: int, replays: int = 10) -> dict:
    case = mc.make_case(1, 64, prefix, seed=prefix)
    run, pl, out = launcher(mod, None, case, None, merge=True)
    if pl.kernel != "mla_wgmma_pair" or pl.splits < 2 or pl.grid[0] != 1:
        raise SystemExit(f"P={prefix}: the plan is {pl}; this probe reads a split pair kernel over one row tile")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    mc.check_policy(out, mc.reference_f64(case), mc.reference_bf16(case), f"traced P={prefix}")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    e = read_global(mod, "mla_edges", (256, 8), np.uint64)[:pl.splits].astype(np.int64)
    mg = read_global(mod, "mla_merge_edges", (256, 2), np.uint64).astype(np.int64)
    t0 = e[:, 0].min()
    us = lambda x: (x - t0) / 1e3  # noqa: E731
    med = lambda x: float(np.median(x))  # noqa: E731
    ns = np.diff(np.unique(e[:, :4].ravel()))
    row = dict(prefix=prefix, splits=pl.splits, tiles_per_block=pl.chunk_keys // 64,
               timer_step_ns=int(ns[ns > 0].min()) if (ns > 0).any() else None,
               entry_us=dict(first=0.0, median=med(us(e[:, 0])), last=float(us(e[:, 0]).max())),
               prologue_us=dict(median=med((e[:, 1] - e[:, 0]) / 1e3), max=float((e[:, 1] - e[:, 0]).max() / 1e3)),
               loop_us=dict(median=med((e[:, 2] - e[:, 1]) / 1e3), max=float((e[:, 2] - e[:, 1]).max() / 1e3)),
               store_us=dict(median=med((e[:, 3] - e[:, 2]) / 1e3), max=float((e[:, 3] - e[:, 2]).max() / 1e3)),
               prologue_cycles=med(e[:, 5] - e[:, 4]), loop_cycles=med(e[:, 6] - e[:, 5]),
               store_cycles=med(e[:, 7] - e[:, 6]),
               kernel_end_us=dict(median=med(us(e[:, 3])), last=float(us(e[:, 3]).max())),
               merge_first_entry_us=float(us(mg[:, 0]).min()), merge_last_exit_us=float(us(mg[:, 1]).max()),
               merge_block_us=med((mg[:, 1] - mg[:, 0]) / 1e3))
    return row


def main(argv) -> None:
    out = argv[0] if argv and argv[0].endswith(".json") else None
    prefixes = [int(a) for a in argv[1 if out else 0:]] or [8192, 32768, 131072]
    mod = build(["MLA_TRACE=1"])
    rows = []
    print(f"{torch.cuda.get_device_name(0)}; T = 1, H = 64; us from the first block's entry (last of 10 replays)")
    for prefix in prefixes:
        r = timeline(mod, prefix)
        rows.append(r)
        print(f"P={prefix:6d} splits={r['splits']:3d} ({r['tiles_per_block']} tiles a block, timer step "
              f"{r['timer_step_ns']} ns): entries 0..{r['entry_us']['last']:.1f} (median "
              f"{r['entry_us']['median']:.1f}); per block: prologue {r['prologue_us']['median']:.1f} (max "
              f"{r['prologue_us']['max']:.1f}), loop {r['loop_us']['median']:.1f} (max {r['loop_us']['max']:.1f}), "
              f"store {r['store_us']['median']:.1f} (max {r['store_us']['max']:.1f}); last block done "
              f"{r['kernel_end_us']['last']:.1f}; merge {r['merge_first_entry_us']:.1f}..{r['merge_last_exit_us']:.1f}"
              f" (a block {r['merge_block_us']:.1f})", flush=True)
    if out:
        Path(out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(0), rows=rows), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
