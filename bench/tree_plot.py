"""Plot a tree bench result (bench/test_bench_tree.py's tree_<date>.json): the whole path's device time against the
budget with the goal, and the beams alone (the default config's beam stage, with the two-level selection on trees at
most 2 deep; tree_beam, one depth per step; the warp-list beam, one node per step; the threshold beam, one enumeration
level per step).

    python bench/tree_plot.py bench/results/tree_run12/tree_2026-12-06.json [out.png]   (default: beside the JSON)
"""
from __future__ import annotations

import json
import os
import sys


def plot(path: str, out: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        doc = json.load(f)
    rows, info = doc["results"], doc["provenance"]
    if not rows:
        raise SystemExit(f"{path}: no result rows")
    out = out or os.path.splitext(path)[0] + ".png"
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {("normal", 7): ("tab:blue", "--"), ("normal", 15): ("tab:blue", "-"),
              ("draftlike", 7): ("tab:red", "--"), ("draftlike", 15): ("tab:red", "-")}
    for (kind, depth), (color, ls) in styles.items():
        rs = sorted((r for r in rows if r["kind"] == kind and r["depth"] == depth), key=lambda r: r["budget"])
        if not rs:
            continue
        b = [r["budget"] for r in rs]
        ax[0].plot(b, [r["device_us"] for r in rs], color=color, ls=ls, marker="o", label=f"{kind}, L = {depth}")
        ax[1].plot(b, [r["beam_device_us"] for r in rs], color=color, ls=ls, marker="o",
                   label=f"tree_beam, {kind}, L = {depth}")
        lb = [(r["budget"], r["beam_list_device_us"]) for r in rs if r.get("beam_list_device_us") is not None]
        if lb:
            ax[1].plot(*zip(*lb), color=color, ls=ls, marker="s", mfc="white", alpha=0.8,
                       label=f"list beam, {kind}, L = {depth}")
        db = [(r["budget"], r["beam_default_device_us"]) for r in rs if r.get("beam_default_device_us") is not None]
        if db:
            ax[1].plot(*zip(*db), color=color, ls=ls, marker="D", ms=4, lw=2.2, alpha=0.6,
                       label=f"default beam stage, {kind}, L = {depth}")
        tb = [(r["budget"], r["beam_thresh_device_us"]) for r in rs if r.get("beam_thresh_device_us") is not None]
        if tb:
            ax[1].plot(*zip(*tb), color=color, ls=ls, marker="^", alpha=0.8,
                       label=f"threshold beam, {kind}, L = {depth}")
    budgets = sorted({r["budget"] for r in rows})
    ax[0].step(budgets, [40 if b <= 256 else 100 for b in budgets], where="post", color="k", lw=1, label="goal")
    ax[0].set(xscale="log", yscale="log", xlabel="budget", ylabel="device us (median)",
              title="logits -> compiled tree (default path)")
    ax[1].set(xscale="log", yscale="log", xlabel="budget", ylabel="device us (median)", title="the beam alone")
    ax[0].set_xticks(budgets, [str(b) for b in budgets])
    ax[1].set_xticks(budgets, [str(b) for b in budgets])
    ax[0].legend(fontsize=7)
    ax[1].legend(fontsize=6, ncol=2, loc="upper left")
    fig.suptitle(f"Tree path, V = 163,840, {info.get('gpu', '?')}, commit {info.get('commit', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(plot(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
