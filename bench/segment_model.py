"""Host model of a beam that needs no step per depth (a design for issue 5's deep trees; not a kernel yet).

A node is its depth d and its deviations, the depths where its rank tuple is not 0; its score is z[d] plus the
deviations' penalties (lp[i][r] - lp[i][0] <= 0), z[d] the score of the all-rank-0 chain. Draft-like trees are long
chains with short branches: at the tree bench's shapes every node has at most 2 deviations (this script prints
it), so the tree is a set of chain SEGMENTS (a deviation, then rank 0 onward), grown one deviation at a time: 2-3
steps where tree_beam takes one per depth (15).

Exact selection (what the model does, in integers on the 2^-28 grid):
  1. U = the best score of a prefix with D + 1 deviations (rank-1 deviations; a DP over depths). Every node with more
     than D deviations scores <= U. theta = max(U, b - 1), b the B-th best score of the L * K "start" nodes (z[j] +
     lp[j][r]: the chain, and each node one deviation off it at its last depth), a lower bound of the B-th node's
     score (one selection over L * K values, no enumeration).
  2. Enumerate E = nodes with <= D deviations scoring > theta and inside the product bound (a node is preceded by every
     node whose tuple is componentwise <= on each of its prefixes: sum over e <= d of prod_{j <= e} (r_j + 1) <= B),
     segment by segment, a deviation level at a time. If |E| >= B, at least B nodes score > theta >= U, so the first
     B nodes (all > theta) are in E; otherwise decline (another beam runs). No U (L <= D or K = 1): E is every node
     above the start bound.
  3. Rank E by (score descending, rank tuple ascending) and keep the first B. Tuples with <= 2 deviations order by
     their events (a deviation at depth p with rank r, then the end at depth d + 1), each coded in 15 bits: ends
     before deviations, later deviations first, then by rank; so (score, 45-bit code) orders as the reference does.
  With D = 2, after level 1 the B-th best score found so far (when there are >= B nodes) also bounds level 2.

Checked against reference.tree.build_tree on 1,680 rows (7 kinds including the tie-heavy ones, L 1-15, V 2-300,
budgets 1-256): exact on the 1,475 it takes. At the bench's rows (D = 2, all taken) |E| is 16-268 on normal rows up
to budget 256 (1,055-1,063 at 1024) and 16-647 on draft-like ones (2,781 / 6,416 at 1024), with about B segments:
the start bound does most of the work (U alone left 1,940 nodes at draft-like L = 15, budget 256). As a kernel:
the start-bound selection, the DP, two deviation levels (a binary search per parent), one bucket rank of E; about
six barrier phases whatever the depth, where tree_beam takes a merge step per depth (33-245 us on draft-like rows).

    python bench/segment_model.py          (CPU; the bench's logits at V = 163,840; ~1 minute)
"""
from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "conformance")]
import reference.tree as ref  # noqa: E402
from test_tree_numba import assert_same_tree, logits  # noqa: E402

SCALE = 2 ** 28
NONE = -(2 ** 62)


def event_dev(p: int, r: int) -> int:
    return 17 + (16 - p) * 1024 + (r - 1)


def _start_bound(z: list, q: list, budget: int) -> int:
    """A score every one of the first B nodes beats, less one: the B-th best of the L * K nodes that leave the chain
    at most once, at their last depth (z[j] + lp[j][r]: the chain itself for r = 0), when there are B of them (B
    distinct nodes score at least that, so the B-th node does); else NONE."""
    starts = sorted((z[j] + q[j][r] for j in range(len(q)) for r in range(len(q[j]))), reverse=True)
    return starts[budget - 1] - 1 if len(starts) >= budget else NONE


def select(top_lp: torch.Tensor, top_id: torch.Tensor, budget: int, dev_max: int = 2):
    """(tree or None when it declines, |E|, segments)."""
    depth, k = top_lp.shape
    q = [[int(round(float(top_lp[d, r]) * SCALE)) for r in range(k)] for d in range(depth)]
    z = [0] * (depth + 1)
    for d in range(depth):
        z[d + 1] = z[d] + q[d][0]
    u = NONE
    if k >= 2 and depth > dev_max:
        best = [0] + [NONE] * (dev_max + 1)
        for d in range(depth):
            nxt = [NONE] * (dev_max + 2)
            for c in range(dev_max + 2):
                a = best[c] + q[d][0] if best[c] > NONE else NONE
                b = best[c - 1] + q[d][1] if c > 0 and best[c - 1] > NONE else NONE
                nxt[c] = max(a, b)
            best = nxt
            u = max(u, best[dev_max + 1])
    th = [max(u, _start_bound(z, q, budget))]
    nodes: list = []            # (score, code, parent node or -1, depth, rank at that depth)
    segs: list = []             # (start node, first depth, last depth, penalty, multiplier, S at parent, events)

    def add_segment(par, i, r, pen, mult, s_par, events):
        e = i - 1
        while e + 1 <= depth and z[e + 1] + pen > th[0] and s_par + (e + 2 - i) * mult <= budget:
            e += 1
        start = len(nodes)
        for d in range(i, e + 1):
            code = 0
            for x in (events + [d + 1, 0, 0])[:3]:
                code = code << 15 | x
            nodes.append((z[d] + pen, code, start + d - i - 1 if d > i else par, d, r if d == i else 0))
        segs.append((start, i, e, pen, mult, s_par, events))
        return len(segs) - 1

    level = [add_segment(-1, 1, 0, 0, 1, 0, [])] if depth and z[1] > u else []
    for lev in range(1, dev_max + 1):
        items = [(-1, 0, 0, 1, 0, [])] if lev == 1 else []          # (parent, its depth, penalty, mult, S, events)
        if lev > 1 and len(nodes) >= budget:
            th[0] = max(th[0], sorted((nd[0] for nd in nodes), reverse=True)[budget - 1] - 1)
        for sid in level:
            start, i, e, pen, mult, s_par, events = segs[sid]
            items += [(start + d - i, d, pen, mult, s_par + (d - i + 1) * mult, events) for d in range(i, e + 1)]
        level = []
        for par, pd, pen, mult, s, events in items:
            j = pd + 1
            for r in range(1, k if j <= depth else 1):
                if z[pd] + pen + q[j - 1][r] <= th[0] or s + mult * (r + 1) > budget:
                    break
                level.append(add_segment(par, j, r, pen + q[j - 1][r] - q[j - 1][0], mult * (r + 1), s,
                                         events + [event_dev(j, r + 1)]))
    if u != NONE and len(nodes) < budget:
        return None, len(nodes), len(segs)
    order = sorted(range(len(nodes)), key=lambda x: (-nodes[x][0], nodes[x][1]))[:min(budget, len(nodes))]
    pos = {x: i for i, x in enumerate(order)}
    rows = [(int(top_id[nodes[x][3] - 1, nodes[x][4]]), nodes[x][3],
             0 if nodes[x][2] < 0 else pos[nodes[x][2]] + 1, nodes[x][0] / SCALE) for x in order]
    cols = list(zip(*rows)) if rows else [[]] * 4
    tree = ref.Tree(torch.tensor(cols[0], dtype=torch.long), torch.tensor(cols[1], dtype=torch.long),
                    torch.tensor(cols[2], dtype=torch.long), torch.tensor(cols[3], dtype=torch.float64))
    return tree, len(nodes), len(segs)


def deviations(tree: ref.Tree, top_id: torch.Tensor) -> int:
    """The most deviations (nonzero ranks) on any node's path."""
    dev = []
    for i in range(tree.n):
        d, p = int(tree.depths[i]), int(tree.parents[i])
        rank = top_id[d - 1].tolist().index(int(tree.tokens[i]))
        dev.append((dev[p - 1] if p else 0) + (rank > 0))
    return max(dev, default=0)


def main() -> None:
    print("| logits | L | budget | tree depth | max deviations | D | taken | E nodes | segments |")
    print("| --- " * 9 + "|")
    for kind in ("normal", "draftlike"):
        for depth in (7, 15):
            for budget in (16, 64, 256, 1024):
                x = logits(kind, depth, 163_840, depth * 7 + budget)   # the tree bench's rows
                want = ref.build_tree(x, budget)
                top_lp, top_id = ref.ranked_candidates(x, budget)
                for dev_max in (1, 2):
                    tree, n_e, n_s = select(top_lp, top_id, budget, dev_max)
                    if tree is not None:
                        assert_same_tree(tree, want, f"{kind} L={depth} B={budget} D={dev_max}")
                    print(f"| {kind} | {depth} | {budget} | {int(want.depths.max())} | {deviations(want, top_id)} | "
                          f"{dev_max} | {tree is not None} | {n_e} | {n_s} |")


if __name__ == "__main__":
    main()
