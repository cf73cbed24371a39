"""Tree path on the GPU (issue 5): draft logits [L, V] on the device -> compiled tree on the device, by the
Numba kernels (optimized/tree_numba.py) against the reference path on the same device logits (torch sort,
copy to host, Python heap, copy back; reference/tree.py). V = 163,840; L = 7 and 15; budgets 16..1024; two
kinds of logits: "normal" (N(0, 3^2): flat, shallow trees) and "draftlike" (one favourite per depth with top-1
probability ~0.6..0.995: deep trees, the beam runs every depth).

Times (CUDA events, warm-up, median of 100; extra_info, microseconds):
  eager_us   launches as a synchronous caller issues them (Numba's per-launch CPU cost included)
  topk_device_us, beam_device_us, compile_device_us: the stages alone (device execution); beam: tree_beam's
             (Config.shallow off); beam_default_device_us: the default config's beam stage (above budget 32 the
             two-level selection, tree_shallow.py, where the tree is at most 2 deep, and the segment selection,
             tree_segment.py, in the same launch up to budget 256, in its own launch above, declining trees at
             most 2 deep; default_same_tree: the same tree as tree_beam's)
  beam_list_device_us, device_list_us: the warp-list beam (tree_list.py, Config.list_max) alone, and the whole
             path with it, at budgets up to LIST_BMAX (list_same_tree: it built the same tree)
  device_us  the default path (DEFAULT_CONFIG: the list beam up to budget LIST_DEFAULT), device execution only:
             a spin kernel is queued first so the CPU has issued every launch before the GPU starts (the
             engine's case: the CPU runs ahead of the GPU)
  graph_us   one replay of the path captured in a CUDA graph (graph_error says why when capture fails)
  reference_us, ratio_* = reference / ours; goal_us: <= 40 us at budget <= 256, <= 100 us at 1024.
Floor: reading the fp32 logits once is 9.8 MB / 4.24 TB/s = 2.3 us at L = 15 (1.1 us at L = 7); the path is
latency bound (four dependent launches: two top-K passes, the single-block beam, compile), not bandwidth bound.

    pytest bench/test_bench_tree.py --benchmark-only --benchmark-json=out.json     (DDTREE_BENCH_OUT=dir also
    writes tree_<date>.json, .md and .png there)
"""
import dataclasses
import datetime
import json
import os

import pytest
import torch

from test_tree_numba import device_path, event_median, graph_median, logits, reference_path_time, same_tree

VOCAB = 163_840
ROWS: list = []


def _write_summary(info: dict) -> None:
    from optimized.tree_numba import LIST_DEFAULT
    from tree_plot import plot
    out = os.environ.get("DDTREE_BENCH_OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    day = datetime.date.today().isoformat()
    with open(os.path.join(out, f"tree_{day}.json"), "w") as f:
        json.dump({"provenance": info, "results": ROWS}, f, indent=1)
    lines = [f"# Tree path on {info.get('gpu', '?')} ({day}, commit {info.get('commit', '?')})", "",
             "V = 163,840; draft logits on the device -> compiled tree on the device. Microseconds (median).",
             f"`device`: the default path (up to budget {LIST_DEFAULT} one warp: tree_beam's body on trees at most 2 "
             "deep, else the warp-list beam; above: the two-level selection on trees at most 2 deep up to budget "
             "256, the segment selection (in its own launch above 256, where it leaves trees at most 2 deep to "
             "tree_beam), then tree_beam); `beam (default)`: its beam stage alone; "
             "`beam`: tree_beam alone; `beam (list)` and `device (list)`: the warp-list beam alone and the whole path with it "
             "(budgets <= 256); `beam (thr)` and `device (thr)`: the threshold beam alone and the whole path with it "
             "(budgets <= 512; rounds: its enumerations).",
             "", "| logits | L | budget | tree depth | device | top-K | beam (default) | beam | compile | beam (list) "
             "| device (list) | beam (thr) | device (thr) | rounds | eager | graph | reference | ratio (device) | goal |",
             "| --- " * 19 + "|"]
    us = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in ROWS:
        graph = f"{r['graph_us']:.1f}" if r["graph_us"] is not None else "failed"
        same = "" if r["list_same_tree"] in (None, True) else " (DIFFERENT TREE)"
        tsame = "" if r["thresh_same_tree"] in (None, True) else " (DIFFERENT TREE)"
        dsame = "" if r["default_same_tree"] else " (DIFFERENT TREE)"
        lines.append(f"| {r['kind']} | {r['depth']} | {r['budget']} | {r['tree_depth']} | {r['device_us']:.1f} | {r['topk_device_us']:.1f} | "
                     f"{r['beam_default_device_us']:.1f}{dsame} | {r['beam_device_us']:.1f} | {r['compile_device_us']:.1f} | {us(r['beam_list_device_us'])}{same} | "
                     f"{us(r['device_list_us'])} | {us(r['beam_thresh_device_us'])}{tsame} | {us(r['device_thresh_us'])} | "
                     f"{r['thresh_rounds'] if r['thresh_rounds'] is not None else '-'} | {r['eager_us']:.1f} | {graph} | "
                     f"{r['reference_us']:.0f} | {r['ratio_device']:.0f}x | {r['goal_us']} |")
    with open(os.path.join(out, f"tree_{day}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(os.path.join(out, f"tree_{day}.json"))                 # tree_<day>.png beside the JSON


@pytest.mark.parametrize("kind", ["normal", "draftlike"])
@pytest.mark.parametrize("depth", [7, 15])
@pytest.mark.parametrize("budget", [16, 64, 256, 1024])
def test_tree_device_path(benchmark, provenance, depth, budget, kind):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from optimized import tree_numba as opt
    assert opt.backend() == "cuda"
    info = dict(provenance)                      # provenance only, before the row is added
    x = logits(kind, depth, VOCAB, depth * 7 + budget, device="cuda")
    fn = device_path(opt, x, budget)
    eager = event_median(fn)
    device = event_median(fn, ahead=True)
    build_only = event_median(lambda: opt.build_tree(x, budget), ahead=True)
    k = min(budget, VOCAB)                       # per-stage device times (the workspace build_tree used)
    xa, s, cfg = opt._arr(x.float().contiguous()), opt._stream(x.device), opt.DEFAULT_CONFIG
    ws = opt._workspace(x.device, depth, VOCAB, k, budget, cfg)
    outs = [torch.empty(budget, dtype=dt, device="cuda") for dt in (torch.long,) * 3 + (torch.float64,)]
    topk = event_median(lambda: opt._topk_stage(xa, VOCAB, k, ws, cfg, s), ahead=True)
    beam_default = event_median(lambda: opt._beam_stage(k, budget, ws, cfg, s, *outs), ahead=True)
    bcfg = dataclasses.replace(cfg, list_max=0, shallow=False)  # tree_beam alone
    beam = event_median(lambda: opt._beam_stage(k, budget, ws, bcfg, s, *outs), ahead=True)
    tree = opt.build_tree(x, budget, config=bcfg)
    default_same = same_tree(opt.build_tree(x, budget), tree)
    compile_ = event_median(lambda: opt.compile_tree(tree, 0, 1000), ahead=True)
    list_beam = list_device = list_same = None
    if budget <= opt.LIST_BMAX:                  # the warp-list beam on the same top-K, and the path with it
        lcfg = dataclasses.replace(cfg, list_max=opt.LIST_BMAX, shallow=False)
        list_beam = event_median(lambda: opt._beam_stage(k, budget, ws, lcfg, s, *outs), ahead=True)
        list_device = event_median(device_path(opt, x, budget, config=lcfg), ahead=True)
        lt = opt.build_tree(x, budget, config=lcfg)
        list_same = same_tree(lt, tree)
    thresh_beam = thresh_device = thresh_same = None
    thresh_stats = [None] * 5
    if budget <= opt.BMAX_THRESH:                # the threshold beam (its own workspace), and the path with it
        tcfg = dataclasses.replace(cfg, list_max=0, beam="threshold")
        tt = opt.build_tree(x, budget, config=tcfg)
        wst = opt._workspace(x.device, depth, VOCAB, k, budget, tcfg)
        thresh_beam = event_median(lambda: opt._beam_stage(k, budget, wst, tcfg, s, *outs), ahead=True)
        thresh_device = event_median(device_path(opt, x, budget, config=tcfg), ahead=True)
        thresh_same = same_tree(tt, tree)
        thresh_stats = wst.thresh_stats.tolist()
    graph, graph_error = None, None
    try:
        graph = graph_median(fn)
    except Exception as e:  # recorded, not hidden: the JSON says why
        graph_error = f"{type(e).__name__}: {e}"[:300]
    reference = reference_path_time(x, budget)

    def run():
        fn()
        torch.cuda.synchronize()
    benchmark.pedantic(run, rounds=30, warmup_rounds=3)
    row = dict(kind=kind, depth=depth, budget=budget, vocab=VOCAB, tree_depth=int(tree.depths.max()), eager_us=eager * 1e6, device_us=device * 1e6,
               build_device_us=build_only * 1e6, topk_device_us=topk * 1e6, beam_device_us=beam * 1e6,
               beam_default_device_us=beam_default * 1e6, default_same_tree=default_same,
               compile_device_us=compile_ * 1e6,
               beam_list_device_us=None if list_beam is None else list_beam * 1e6,
               device_list_us=None if list_device is None else list_device * 1e6, list_same_tree=list_same,
               beam_thresh_device_us=None if thresh_beam is None else thresh_beam * 1e6,
               device_thresh_us=None if thresh_device is None else thresh_device * 1e6,
               thresh_same_tree=thresh_same, thresh_rounds=thresh_stats[0], thresh_tuple_thresholds=thresh_stats[1],
               thresh_nodes=thresh_stats[2], thresh_levels=thresh_stats[3], thresh_routes=thresh_stats[4],
               graph_us=None if graph is None else graph * 1e6,
               graph_error=graph_error, reference_us=reference * 1e6, ratio_eager=reference / eager,
               ratio_device=reference / device, ratio_graph=None if graph is None else reference / graph,
               goal_us=40 if budget <= 256 else 100, floor_us=depth * VOCAB * 4 / 4.24e12 * 1e6,
               topk_threads=opt.TOPK_T)
    benchmark.extra_info.update(row)
    ROWS.append(row)
    _write_summary(info)
