"""Probe: what each part of the two top-K launches costs, by taking it out. Each variant is
optimized/kernels/tree_topk.py with one part removed (a source patch, loaded as its own module; the served code is not
touched), launched on the tree bench's logits exactly as tree_numba._topk_stage launches the real kernels, and timed
per call in a 20-call CUDA graph (bench/conftest.graph_us). The variants compute wrong answers on purpose: only
their times mean anything, and the real kernels' output is checked against the reference once per case.

    stats   the served topk_stats              filter    the served topk_filter (after a served topk_stats)
    s_empty returns at entry (launch + ramp)    f_empty   returns at entry
    s_loop  only the load / max / exp /         f_notail  no last-block select and sort (the last block only
            histogram loop (returns after it)             resets the counters and the histogram)
    s_nohist  no shared histogram atomics      f_nofence no threadfence before the last-block count
    s_noexp   no fp64 exp (s += x)
    s_noflush no flush of the histogram to global memory
The filter reads the histograms stats leaves and its last block zeroes them, so every filter variant is timed
after the served stats in one graph, less the served stats alone.

Usage (GPU): python bench/topk_ablate.py [--out FILE.json]"""
import argparse
import importlib.util
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, ".."), os.path.join(HERE, "..", "conformance")]
from conftest import graph_us, print_table, save_rows  # noqa: E402
from optimized import tree_numba as opt  # noqa: E402
from test_tree_numba import logits  # noqa: E402
from topk_probe import topk_exact, topk_launches  # noqa: E402

SRC = os.path.join(HERE, "..", "optimized", "kernels", "tree_topk.py")
CASES = [("normal", 7, 16), ("normal", 15, 16), ("normal", 15, 256), ("normal", 15, 1024)]

_STATS_ENTRY = "    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x\n    T = cuda.blockDim.x if SIM else TOPK_T\n    wm ="
_FILTER_ENTRY = "    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x\n    T = cuda.blockDim.x if SIM else TOPK_T\n    lane = tid % WARP\n"
PATCHES = {
    "s_empty": [(_STATS_ENTRY, _STATS_ENTRY.replace("    wm =", "    if row >= 0:\n        return\n    wm ="))],
    "s_loop": [("    bm, bs = block_partial(m, s, wm, ws, fbuf)",
                "    if s < -1.0:\n        part_s[row, p] = s + sh[tid]\n    return\n"
                "    bm, bs = block_partial(m, s, wm, ws, fbuf)")],
    "s_nohist": [("            cuda.atomic.add(sh, b, 1)\n", "            sh[NB] = b\n")],
    "s_noexp": [("            s *= exp_le0(m - mn, tab) if m > -math.inf else 0.0\n", "            s *= 0.5\n"),
                ("                s += exp_le0(np.float64(vals[j]) - mn, tab)", "                s += np.float64(vals[j])")],
    "s_noflush": [("            cuda.atomic.add(hist, (row, i), c)\n", "            sh[NB] = c\n")],
    "f_empty": [(_FILTER_ENTRY, _FILTER_ENTRY + "    if row >= 0:\n        return\n")],
    "f_notail": [("    n = np.int64(counters[row, 0])\n    if whole or n > CAP",
                  "    if tid == 0:\n        counters[row, 0] = 0\n        counters[row, 1] = 0\n    return\n"
                  "    n = np.int64(counters[row, 0])\n    if whole or n > CAP")],
    "f_nofence": [("    cuda.threadfence()\n    cuda.syncthreads()\n    if tid == 0:\n        last = cuda.atomic.add(counters",
                   "    cuda.syncthreads()\n    if tid == 0:\n        last = cuda.atomic.add(counters")],
}


def variant(name: str):
    """tree_topk with PATCHES[name] applied (each pattern must match exactly once), as its own module."""
    text = open(SRC).read()
    for old, new in PATCHES[name]:
        if text.count(old) != 1:
            raise RuntimeError(f"{name}: pattern found {text.count(old)} times, expected once: {old[:60]!r}")
        text = text.replace(old, new)
    modname = f"optimized.kernels.tree_topk_{name}"
    spec = importlib.util.spec_from_loader(modname, loader=None, origin=SRC)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "optimized.kernels"
    mod.__file__ = SRC
    sys.modules[modname] = mod
    exec(compile(text, f"<{modname}>", "exec"), mod.__dict__)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    mods = {name: variant(name) for name in PATCHES}
    rows = []
    for kind, depth, budget in CASES:
        x = logits(kind, depth, 163_840, 7 * depth + budget, device="cuda")
        k = min(budget, x.shape[1])
        ws, stats, filt = topk_launches(x, budget)
        stats()
        filt()
        exact = topk_exact(ws, x, k)
        row = dict(kind=kind, L=depth, budget=budget, parts=ws.parts, chunk=ws.chunk,
                   threads=opt.DEFAULT_CONFIG.topk_threads, exact=exact,
                   stats=round(graph_us(stats), 2))
        ws.hist.zero_()             # stats alone added into the histograms that only the filter zeroes
        row["topk"] = round(graph_us(lambda: (stats(), filt())), 2)
        row["filter"] = round(row["topk"] - row["stats"], 2)
        for name, mod in mods.items():
            if name.startswith("s_"):
                row[name] = round(graph_us(lambda m=mod: stats(m)), 2)
            else:
                row[name] = round(graph_us(lambda m=mod: (stats(), filt(m))) - row["stats"], 2)
            ws.hist.zero_()         # a variant may leave the histograms (f_empty: never zeroed) dirty
            ws.counters.zero_()
        # the ablations leave the workspace's counters and histogram dirty: a fresh one for the next case
        opt._workspaces.clear()
        rows.append(row)
        print(row, flush=True)
    names = ["stats"] + [n for n in PATCHES if n.startswith("s_")] + ["filter"] + [n for n in PATCHES if n.startswith("f_")] + ["topk"]
    print_table("us per call in a 20-call graph (each variant removes one part; see the docstring)",
                ["kind", "L", "B", "parts", "exact"] + names,
                [[r["kind"], r["L"], r["budget"], r["parts"], r["exact"]] + [r[n] for n in names] for r in rows])
    meta = dict(device=torch.cuda.get_device_name(), commit=os.environ.get("DDTREE_COMMIT", "?"), torch=torch.__version__)
    save_rows(args.out, meta, rows)


if __name__ == "__main__":
    main()
