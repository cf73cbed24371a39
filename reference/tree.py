"""DDTree tree stages: build_tree -> compile_tree -> follow_verified_tree (ddtree-spec §2.2-2.6).

Dimension letters:
    L  draft depth (positions drafted after the root; tree depth 1..L)
    V  vocabulary
    K  candidates per depth, min(budget, V)
    n  drafted (non-root) nodes in the tree; rows of the verify block are n + 1 (root first)
    S  committed prefix length (`start`)

Node 0 is the root (the pending bonus token); nodes 1..n are drafted, numbered in pop order.

Log-probs (reproducible bit for bit by a GPU kernel):
    x   = draft_logits.float()                                        # [L, V]
    lp  = (x.double() - logsumexp(x.double())).float()                # fp32; fp64 first so that ulp-level
                                                                      #   reduction-order differences almost
                                                                      #   never change the fp32 result
    lp  = max(round_half_even(lp * 2^28) / 2^28, -2^21) + 0.0         # onto a 2^-28 grid, floor -2^21
The grid step changes only |lp| < 2^-4 (larger fp32 values are on it already); the floor only affects
probabilities below e^-2097152 (and -inf logits, i.e. masked tokens). Together they make every score below an
exact float64 sum (at most 15 terms, each a multiple of 2^-28 below 2^21 in magnitude: 53 bits suffice), so
the tree depends on no addition order and the sorted-matrix properties used by the GPU beam hold exactly.
"+ 0.0" turns -0.0 into +0.0 so that the two compare (and sort) as one value.

Ranks and scores:
    rank of a token at depth d = its position after sorting depth d by (lp descending, token id ascending)
    (torch.topk does not promise that order for ties, so it is sorted explicitly); only ranks < K are used.
    A node is identified by its rank tuple (r_1, ..., r_d); its score is the float64 sum of its path's lp,
    parent score + own lp, in depth order (exact, see above).

The tree (tie-breaking, what a GPU kernel must reproduce): order all prefixes by
    (score descending, rank tuple ascending lexicographically, a proper prefix before its extensions);
the tree is the first `budget` prefixes in this order and node i is the i-th of them. This is a total order
in which a parent precedes its children (score non-increasing as lp <= 0, and its tuple is a prefix) and a
sibling precedes its next sibling, so the set is prefix-closed and is exactly what a best-first heap over
rank tuples pops (spec §2.2): score ties between parent and child (lp exactly 0) and between siblings
(equal logits) are broken by the rank tuple. The heap below is the readable definition.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

LP_GRID = 2.0 ** -28        # log-probs are multiples of this
LP_FLOOR = -(2.0 ** 21)     # and no smaller than this


@dataclass(frozen=True)
class Tree:
    """Best-first draft tree; node 0 (the root) is implicit, entry i describes node i + 1."""
    tokens: torch.Tensor    # int64 [n]    token of node i+1
    depths: torch.Tensor    # int64 [n]    depth of node i+1, 1..L
    parents: torch.Tensor   # int64 [n]    parent of node i+1, in 0..i (0 = root)
    scores: torch.Tensor    # float64 [n]  prefix log-prob of node i+1 (non-increasing)

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class CompiledTree:
    """Verify inputs for n + 1 rows: the root then the nodes in index order (spec §2.3-2.4)."""
    ids: torch.Tensor         # int64 [n+1]        root token then node tokens
    positions: torch.Tensor   # int64 [n+1]        start + depth (depth-based RoPE: siblings share one)
    parents: torch.Tensor     # int64 [n+1]        root: -1
    depths: torch.Tensor      # int64 [n+1]        root: 0
    visibility: torch.Tensor  # bool [n+1, n+1]    vis[i, j]: j is i or an ancestor of i
    start: int                # S, the cache slot of the root row

    @property
    def n(self) -> int:
        return int(self.ids.shape[0]) - 1

    def attention_visibility(self) -> torch.Tensor:
        """bool [n+1, S+n+1]: every row sees the whole committed prefix, then its ancestor chain."""
        rows = self.ids.shape[0]
        prefix = torch.ones(rows, self.start, dtype=torch.bool, device=self.visibility.device)
        return torch.cat([prefix, self.visibility], dim=1)


def draft_log_probs(draft_logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-probs [L, V] on the 2^-28 grid (module docstring); the values every tree stage uses."""
    x = draft_logits.float().double()                                              # [L, V]
    lp = (x - torch.logsumexp(x, dim=-1, keepdim=True)).float().double()           # fp32 values, as fp64
    lp = torch.round(lp.clamp(min=LP_FLOOR) / LP_GRID) * LP_GRID                   # exact ops; half-even
    return (lp.clamp(min=LP_FLOOR) + 0.0).float()                                  # [L, V]


def ranked_candidates(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k per depth by (lp descending, token id ascending): (lp [L, k] fp32, token ids [L, k] int64)."""
    lp = draft_log_probs(draft_logits)                                             # [L, V]
    # A stable descending sort keeps equal values in index order: lower token id first.
    top_lp, top_id = torch.sort(lp, dim=-1, descending=True, stable=True)          # [L, V]
    return top_lp[:, :k].contiguous(), top_id[:, :k].contiguous()


def check_build_args(draft_logits, budget, values: bool = True) -> None:
    """ValueError naming the argument for bad build_tree input; `values` also scans for NaN/+inf (a host sync)."""
    if not isinstance(draft_logits, torch.Tensor) or draft_logits.dim() != 2:
        shape = tuple(draft_logits.shape) if isinstance(draft_logits, torch.Tensor) else type(draft_logits)
        raise ValueError(f"draft_logits must be a 2-D tensor [L, V], got {shape}")
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be a floating tensor, got {draft_logits.dtype}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be a non-negative int, got {budget!r}")
    if draft_logits.shape[0] > 0 and draft_logits.shape[1] == 0:
        raise ValueError("draft_logits has an empty vocabulary (V = 0)")
    if values and draft_logits.numel() and budget > 0:
        x = draft_logits.float()
        if torch.isnan(x).any() or torch.isposinf(x).any():
            raise ValueError("draft_logits contains NaN or +inf")
        if (x == float("-inf")).all(dim=-1).any():
            raise ValueError("draft_logits has a row that is -inf everywhere (no token is possible)")


def node_count(depth: int, k: int, budget: int) -> int:
    """Nodes build_tree returns for L = depth, k candidates per depth: min(budget, sum_{d=1..L} k^d)."""
    total, level = 0, 1
    for _ in range(depth):
        level *= k
        total += level
        if total >= budget:
            return budget
    return total


def build_tree(draft_logits: torch.Tensor, budget: int) -> Tree:
    """The `budget` most probable prefixes under the product of per-depth marginals (spec §2.1-2.2).

    draft_logits: [L, V] any float dtype, any device. Returns a Tree on the same device; the order and the
    tie-breaking are those of the module docstring. budget 0 or L == 0 gives a root-only tree.
    """
    check_build_args(draft_logits, budget)
    device = draft_logits.device
    depth, vocab = draft_logits.shape
    if budget == 0 or depth == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return Tree(empty, empty.clone(), empty.clone(), torch.zeros(0, dtype=torch.float64, device=device))
    k = min(budget, vocab)
    top_lp, top_id = ranked_candidates(draft_logits, k)                            # [L, K]
    lp = top_lp.double().cpu().tolist()     # Python floats are fp64: the scores below are exact sums
    ids = top_id.cpu().tolist()

    # Heap entries: (-score, rank tuple, parent node, depth, score). The rank tuple decides exact score ties;
    # tuples are distinct, so the comparison never reaches the later fields.
    heap = [(-lp[0][0], (0,), 0, 1, lp[0][0])]
    tokens, depths, parents, scores = [], [], [], []
    while heap and len(tokens) < budget:
        _, ranks, parent, d, score = heapq.heappop(heap)
        node = len(tokens) + 1
        tokens.append(ids[d - 1][ranks[-1]])
        depths.append(d)
        parents.append(parent)
        scores.append(score)
        if ranks[-1] + 1 < k:           # next sibling: recomputed as parent score + own lp (not incremented)
            parent_score = scores[parent - 1] if parent else 0.0
            r = ranks[-1] + 1
            sibling = parent_score + lp[d - 1][r]
            heapq.heappush(heap, (-sibling, ranks[:-1] + (r,), parent, d, sibling))
        if d < depth:                   # first child: rank 0 one level deeper
            child = score + lp[d][0]
            heapq.heappush(heap, (-child, ranks + (0,), node, d + 1, child))
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return Tree(tokens=as_long(tokens), depths=as_long(depths), parents=as_long(parents),
                scores=torch.tensor(scores, dtype=torch.float64, device=device))


def compile_tree(tree: Tree, root_token: int, start: int) -> CompiledTree:
    """Verify inputs: ids [root, tokens], positions start + depth, parents, depths, ancestor visibility."""
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")
    n = tree.n
    device = tree.tokens.device
    ids = torch.cat([torch.tensor([int(root_token)], device=device), tree.tokens.long()])      # [n+1]
    depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depths.long()])  # [n+1]
    parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=device), tree.parents.long()])
    vis = torch.zeros(n + 1, n + 1, dtype=torch.bool)                                # [n+1, n+1]
    vis[0, 0] = True
    par = parents.tolist()
    for i in range(1, n + 1):
        if not 0 <= par[i] < i:
            raise ValueError(f"tree.parents[{i - 1}] = {par[i]} is not an earlier node (0..{i - 1})")
        vis[i, :i] = vis[par[i], :i]    # the parent's chain (par[i] < i, so its row is final)
        vis[i, i] = True
    return CompiledTree(ids=ids, positions=depths + start, parents=parents, depths=depths,
                        visibility=vis.to(device), start=start)


def follow_verified_tree(compiled: CompiledTree, target_choices: torch.Tensor) -> tuple[list[int], int]:
    """Acceptance walk (spec §2.6): from the root, step to the child whose token equals the target's choice
    at the current row. Returns (accepted node indices, starting with 0; the next bonus token)."""
    rows = compiled.ids.shape[0]
    if target_choices.shape != (rows,):
        raise ValueError(f"target_choices must have shape ({rows},) (one per tree row), "
                         f"got {tuple(target_choices.shape)}")
    ids, par, choice = compiled.ids.tolist(), compiled.parents.tolist(), target_choices.tolist()
    child = [dict() for _ in range(rows)]     # child[node][token] -> node; sibling tokens are distinct
    for i in range(1, rows):
        child[par[i]][ids[i]] = i
    accepted, cur = [0], 0
    while choice[cur] in child[cur]:
        cur = child[cur][choice[cur]]
        accepted.append(cur)
    return accepted, int(choice[cur])
