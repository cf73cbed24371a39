"""reference/tree.py: invariants of ddtree-spec §2.11 items 1-9, optimality against brute force, the worked
example of §2.2, tie-heavy drafts, the acceptance walk, and input validation.

`draft_kinds` makes tie-heavy logits on purpose: integer logits (equal log-probs across tokens and depths),
all-equal rows, one-hot peaked rows (fp32 log-prob exactly 0, so a child ties its parent) and masked (-inf)
tokens. Tensors come from seeded generators; hypothesis draws shapes, budget, kind and seed.
"""
import itertools
import math

import pytest
import torch
from hypothesis import example, given, strategies as st

from reference.tree import (LP_FLOOR, LP_GRID, CompiledTree, Tree, build_tree, compile_tree, draft_log_probs,
                            follow_verified_tree, ranked_candidates)

KINDS = ("normal", "integer", "equal", "peaked", "masked", "wide")


def draft_logits(kind: str, depth: int, vocab: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """[L, V] draft logits of a given flavour from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(depth, vocab, generator=g) * 3
    if kind == "integer":                 # few distinct values: ties within and across depths
        x = torch.randint(0, 3, (depth, vocab), generator=g).float()
    elif kind == "equal":                 # every token equally likely; rows identical
        x = torch.zeros(depth, vocab)
    elif kind == "peaked":                # one-hot rows: lp == 0 exactly for the peak, the rest tie far below
        x = torch.zeros(depth, vocab)
        x[torch.arange(depth), torch.randint(0, vocab, (depth,), generator=g)] = 200.0
    elif kind == "masked":                # masked vocabulary: -inf logits (at least one token stays finite)
        x[torch.rand(depth, vocab, generator=g) < 0.5] = float("-inf")
        x[:, 0] = 1.0
    elif kind == "wide":                  # a huge logit range: exercises the -2^21 floor
        x = x * 1e6
    big = torch.finfo(dtype).max / 2
    return x.double().clamp(-big, big).to(dtype)   # finite in the target dtype (-inf stays -inf)


# ---- independent checkers ---------------------------------------------------------------------------------

def brute_force(logits: torch.Tensor, budget: int):
    """All prefixes over the full vocabulary, sorted by (score desc, rank tuple asc); the first `budget`.
    Ranks come from an independent Python sort; scores are accumulated in depth order as Python floats."""
    lp = draft_log_probs(logits).double().tolist()
    depth, vocab = len(lp), len(lp[0]) if lp else 0
    order = [sorted(range(vocab), key=lambda t, d=d: (-lp[d][t], t)) for d in range(depth)]
    prefixes = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(vocab), repeat=d):
            score = 0.0
            for j, r in enumerate(ranks):
                score = score + lp[j][order[j][r]]
            prefixes.append((-score, ranks))
    prefixes.sort()
    return [(ranks, tuple(order[j][r] for j, r in enumerate(ranks)), -neg) for neg, ranks in prefixes[:budget]]


def rank_tuples(tree: Tree, logits: torch.Tensor):
    """Rank tuple of every node (None for the root), from the tokens and the independent per-depth ranking."""
    lp = draft_log_probs(logits).double().tolist()
    vocab = len(lp[0])
    rank_of = [{t: r for r, t in enumerate(sorted(range(vocab), key=lambda t, d=d: (-lp[d][t], t)))}
               for d in range(len(lp))]
    tuples = [()]
    for tok, dep, par in zip(tree.tokens.tolist(), tree.depths.tolist(), tree.parents.tolist()):
        tuples.append(tuples[par] + (rank_of[dep - 1][tok],))
    return tuples, lp, rank_of


def assert_invariants(tree: Tree, logits: torch.Tensor, budget: int) -> None:
    """ddtree-spec §2.11 items 1-6 for any size: count, parent order, depths, siblings, top-K, scores."""
    depth, vocab = logits.shape
    k = min(budget, vocab)
    n = tree.n
    expected_n = min(budget, sum(k ** d for d in range(1, depth + 1))) if depth else 0
    assert n == expected_n, f"node count {n} != min(B, sum K^d) = {expected_n}"
    assert tree.tokens.dtype == tree.depths.dtype == tree.parents.dtype == torch.long
    assert tree.scores.dtype == torch.float64
    tok, dep, par, score = (tree.tokens.tolist(), tree.depths.tolist(), tree.parents.tolist(),
                            tree.scores.tolist())
    node_depth = [0] + dep
    top_lp, top_id = ranked_candidates(logits, max(k, 1))
    seen = set()
    for i in range(1, n + 1):
        p = par[i - 1]
        assert 0 <= p < i, f"node {i}: parent {p} not an earlier node"              # also prefix-closed
        assert node_depth[i] == node_depth[p] + 1, f"node {i}: depth {node_depth[i]} != parent depth + 1"
        assert 1 <= node_depth[i] <= depth
        assert (p, tok[i - 1]) not in seen, f"node {i}: sibling token {tok[i - 1]} repeated under {p}"
        seen.add((p, tok[i - 1]))
        assert tok[i - 1] in top_id[node_depth[i] - 1].tolist(), f"node {i}: token not in its depth's top-K"
        if i > 1:
            assert score[i - 1] <= score[i - 2], f"scores increase at node {i}"
    # Scores are exact depth-order sums of the grid log-probs.
    lp = draft_log_probs(logits).double()
    for i in range(1, n + 1):
        s, j = 0.0, i
        path = []
        while j:
            path.append(lp[node_depth[j] - 1, tok[j - 1]].item())
            j = par[j - 1]
        for v in reversed(path):
            s = s + v
        assert s == score[i - 1], f"node {i}: score {score[i - 1]!r} != depth-order sum {s!r}"
        assert math.fsum(path) == s, f"node {i}: the float64 sum is not exact"


def assert_best_first(tree: Tree, logits: torch.Tensor, budget: int) -> None:
    """Optimality certificate for any size: pop order strictly increasing in (−score, rank tuple) and every
    frontier prefix (first child or next sibling of a node, not in the tree) after the last node."""
    tuples, lp, rank_of = rank_tuples(tree, logits)
    depth, vocab = logits.shape
    k = min(budget, vocab)
    order_of = [sorted(rank_of[d], key=rank_of[d].get) for d in range(depth)]
    score = {(): 0.0}
    keys = []
    for t, s in zip(tuples[1:], tree.scores.tolist()):
        score[t] = s
        keys.append((-s, t))
    assert keys == sorted(keys) and len(set(keys)) == len(keys), "nodes not in (score desc, rank tuple) order"
    in_tree = set(tuples)
    if tree.n < budget or not keys:
        return
    last = keys[-1]

    def key(t):
        s = score[t[:-1]] + lp[len(t) - 1][order_of[len(t) - 1][t[-1]]]
        return (-s, t)
    for t in tuples:
        cands = []
        if len(t) < depth:
            cands.append(t + (0,))
        if t and t[-1] + 1 < k:
            cands.append(t[:-1] + (t[-1] + 1,))
        for c in cands:
            if c not in in_tree:
                assert key(c) > last, f"frontier prefix {c} beats the last node {last[1]}"


# ---- construction ------------------------------------------------------------------------------------------

@given(kind=st.sampled_from(KINDS), depth=st.integers(1, 4), vocab=st.integers(1, 5), budget=st.integers(0, 40),
       seed=st.integers(0, 2 ** 31 - 1))
@example(kind="peaked", depth=3, vocab=3, budget=7, seed=0)
@example(kind="equal", depth=3, vocab=4, budget=30, seed=0)
@example(kind="integer", depth=4, vocab=2, budget=40, seed=1)
def test_matches_brute_force(kind, depth, vocab, budget, seed):
    """Node set AND order equal the brute-force first-B prefixes; hence the sum of prefix probabilities is the
    top-B optimum (spec §2.11 item 5)."""
    x = draft_logits(kind, depth, vocab, seed)
    tree = build_tree(x, budget)
    assert_invariants(tree, x, budget)
    best = brute_force(x, budget)
    tuples, _, _ = rank_tuples(tree, x)
    assert tuples[1:] == [b[0] for b in best], f"order differs:\n tree  {tuples[1:]}\n brute {[b[0] for b in best]}"
    assert tree.tokens.tolist() == [b[1][-1] for b in best]
    assert tree.scores.tolist() == [b[2] for b in best]
    mass = sum(math.exp(s) for s in tree.scores.tolist())
    assert math.isclose(mass, sum(math.exp(b[2]) for b in best), rel_tol=1e-12, abs_tol=1e-300)


@given(kind=st.sampled_from(KINDS), depth=st.integers(1, 15), vocab=st.integers(1, 300),
       budget=st.integers(0, 300), seed=st.integers(0, 2 ** 31 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
@example(kind="peaked", depth=15, vocab=300, budget=300, seed=3, dtype=torch.float32)
@example(kind="equal", depth=15, vocab=7, budget=300, seed=0, dtype=torch.bfloat16)
def test_invariants_and_certificate(kind, depth, vocab, budget, seed, dtype):
    """Items 1-6 at larger shapes, and the best-first certificate (the tree is the optimum)."""
    x = draft_logits(kind, depth, vocab, seed, dtype)
    tree = build_tree(x, budget)
    assert_invariants(tree, x, budget)
    assert_best_first(tree, x, budget)


def test_worked_example():
    """ddtree-spec §2.2: L=3, V=4, B=6; pop order, tokens, probabilities, objective and verify inputs."""
    q = torch.tensor([[.70, .20, .06, .04], [.50, .40, .06, .04], [.90, .05, .03, .02]])
    tree = build_tree(q.log(), 6)
    assert tree.tokens.tolist() == [0, 0, 0, 1, 0, 1]          # A A A B A B
    assert tree.parents.tolist() == [0, 1, 2, 1, 4, 0]
    assert tree.depths.tolist() == [1, 2, 3, 2, 3, 1]
    probs = tree.scores.exp().tolist()
    for p, e in zip(probs, [.700, .350, .315, .280, .252, .200]):
        assert math.isclose(p, e, rel_tol=1e-6)
    assert math.isclose(sum(probs), 2.097, rel_tol=1e-6)
    c = compile_tree(tree, root_token=7, start=10)
    assert c.ids.tolist() == [7, 0, 0, 0, 1, 0, 1]
    assert c.positions.tolist() == [10, 11, 12, 13, 12, 13, 11]
    rows = ["1000000", "1100000", "1110000", "1111000", "1100100", "1100110", "1000001"]
    assert ["".join(str(int(v)) for v in r) for r in c.visibility.tolist()] == rows


def test_tie_order_parent_before_child_and_siblings_by_token():
    """One-hot rows: lp(peak) is exactly 0, so the whole peak chain has score 0 and is popped by depth; the
    tied off-peak tokens (all equal) follow in token-id order."""
    x = torch.zeros(3, 4)
    x[:, 2] = 200.0
    lp = draft_log_probs(x)
    assert lp[0, 2].item() == 0.0 and lp[0, 0].item() == lp[0, 1].item() == lp[0, 3].item()
    tree = build_tree(x, 7)
    assert tree.tokens.tolist()[:3] == [2, 2, 2] and tree.parents.tolist()[:3] == [0, 1, 2]
    assert tree.scores.tolist()[:3] == [0.0, 0.0, 0.0]
    # Then everything at -200 ties; rank tuples decide: (0, 0, 1) < (0, 0, 2) < (0, 0, 3) < (0, 1) < ... < (1,)
    # so the depth-3 off-peak tokens come first, in token order (0, 1, 3), then depth 2.
    assert tree.depths.tolist()[3:] == [3, 3, 3, 2] and tree.tokens.tolist()[3:] == [0, 1, 3, 0]
    assert tree.parents.tolist()[3:] == [2, 2, 2, 1]
    equal = build_tree(torch.zeros(2, 5), 5)                  # all tied: depth 1 in token order first
    assert equal.tokens.tolist() == [0, 1, 2, 3, 4] and equal.depths.tolist() == [1] * 5


def test_log_probs_on_grid():
    x = draft_logits("wide", 3, 50, 0)
    lp = draft_log_probs(x).double()
    assert lp.dtype == torch.float64 and (lp <= 0).all() and (lp >= LP_FLOOR).all()
    assert (torch.round(lp / LP_GRID) * LP_GRID == lp).all()
    # p = 1 - 9e-27: the fp32 log-prob -8.7e-27 lies below half a grid step and becomes exactly 0
    assert draft_log_probs(torch.tensor([[0.0, 60.0]])).tolist()[0][1] == 0.0


@pytest.mark.parametrize("budget", [0, 1, 3, 7, 50])
def test_top1_is_the_argmax_chain(budget):
    """Item 9: with one candidate per depth (each row cut to its argmax) the tree is the DFlash chain
    truncated to min(B, L)."""
    x = draft_logits("normal", 7, 30, budget)
    top = x.argmax(-1)
    tree = build_tree(x.gather(1, top[:, None]), budget)
    n = min(budget, 7)
    assert tree.n == n
    assert tree.parents.tolist() == list(range(n)) and tree.depths.tolist() == list(range(1, n + 1))
    assert tree.tokens.tolist() == [0] * n                  # column 0 of the cut rows = the argmax token
    assert top[tree.depths - 1].tolist() == x.argmax(-1)[:n].tolist()


def test_budget_zero_and_empty_depth_give_root_only():
    for x, b in [(torch.randn(4, 9), 0), (torch.zeros(0, 9), 5), (torch.zeros(0, 9), 0)]:
        tree = build_tree(x, b)
        assert tree.n == 0 and tree.scores.dtype == torch.float64
        c = compile_tree(tree, 3, 17)
        assert c.ids.tolist() == [3] and c.positions.tolist() == [17] and c.parents.tolist() == [-1]
        assert c.visibility.tolist() == [[True]]
        assert follow_verified_tree(c, torch.tensor([5])) == ([0], 5)


def test_budget_at_least_vocab():
    x = draft_logits("normal", 2, 3, 1)
    for budget in (3, 4, 12, 1000):
        tree = build_tree(x, budget)
        assert tree.n == min(budget, 3 + 9)
        assert_best_first(tree, x, budget)


# ---- compile -------------------------------------------------------------------------------------------------

@given(kind=st.sampled_from(KINDS), depth=st.integers(1, 6), vocab=st.integers(1, 40), budget=st.integers(0, 80),
       seed=st.integers(0, 2 ** 31 - 1), start=st.integers(0, 50))
def test_compile_visibility_and_positions(kind, depth, vocab, budget, seed, start):
    """Items 7-8: vis is the ancestor-chain indicator (lower-triangular, true diagonal, row 0 = [1, 0, ...]);
    positions = start + depth; attention_visibility adds the whole prefix."""
    tree = build_tree(draft_logits(kind, depth, vocab, seed), budget)
    c = compile_tree(tree, root_token=11, start=start)
    n = tree.n
    assert c.ids.tolist() == [11] + tree.tokens.tolist()
    assert c.depths.tolist() == [0] + tree.depths.tolist()
    assert c.parents.tolist() == [-1] + tree.parents.tolist()
    assert c.positions.tolist() == [start + d for d in c.depths.tolist()]
    vis = c.visibility
    assert vis.shape == (n + 1, n + 1) and vis.dtype == torch.bool
    par = c.parents.tolist()
    for i in range(n + 1):
        chain, j = {i}, i
        while j > 0:
            j = par[j]
            chain.add(j)
        assert [bool(v) for v in vis[i]] == [j in chain for j in range(n + 1)], f"row {i}"
    att = c.attention_visibility()
    assert att.shape == (n + 1, start + n + 1) and att[:, :start].all() and (att[:, start:] == vis).all()


def test_compile_rejects_bad_parents_and_start():
    tree = Tree(torch.tensor([1, 2]), torch.tensor([1, 2]), torch.tensor([0, 2]), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="parents"):
        compile_tree(tree, 0, 0)
    with pytest.raises(ValueError, match="start"):
        compile_tree(build_tree(torch.randn(2, 3), 2), 0, -1)


# ---- follow --------------------------------------------------------------------------------------------------

def _example_compiled() -> CompiledTree:
    q = torch.tensor([[.70, .20, .06, .04], [.50, .40, .06, .04], [.90, .05, .03, .02]])
    return compile_tree(build_tree(q.log(), 6), root_token=9, start=0)   # ids [9, A, A, A, B, A, B]


@pytest.mark.parametrize("choices, accepted, bonus", [
    ([3, 0, 0, 0, 0, 0, 0], [0], 3),                 # root choice not drafted: only the root, bonus 3
    ([0, 0, 0, 2, 0, 0, 0], [0, 1, 2, 3], 2),        # A A A accepted, bonus from row 3
    ([0, 1, 9, 9, 0, 3, 9], [0, 1, 4, 5], 3),        # A then B (node 4) then A (node 5), bonus from row 5
    ([1, 9, 9, 9, 9, 9, 2], [0, 6], 2),              # depth-1 B is node 6
    ([0, 1, 9, 9, 1, 9, 9], [0, 1, 4], 1),           # B's child B was not drafted
])
def test_follow_handcrafted(choices, accepted, bonus):
    assert follow_verified_tree(_example_compiled(), torch.tensor(choices)) == (accepted, bonus)


@given(kind=st.sampled_from(KINDS), depth=st.integers(1, 5), vocab=st.integers(1, 6), budget=st.integers(0, 40),
       seed=st.integers(0, 2 ** 31 - 1))
def test_follow_accepts_a_path(kind, depth, vocab, budget, seed):
    """Every accepted node is the child of the previous one carrying the previous row's choice; the walk
    stops exactly where no child carries the choice (items of spec §2.6)."""
    tree = build_tree(draft_logits(kind, depth, vocab, seed), budget)
    c = compile_tree(tree, 0, 0)
    choices = torch.randint(0, vocab, (tree.n + 1,), generator=torch.Generator().manual_seed(seed))
    acc, bonus = follow_verified_tree(c, choices)
    ids, par = c.ids.tolist(), c.parents.tolist()
    assert acc[0] == 0 and 1 <= len(acc) <= depth + 1 and acc == sorted(acc)
    for a, b in zip(acc, acc[1:]):
        assert par[b] == a and ids[b] == int(choices[a])
    last = acc[-1]
    assert bonus == int(choices[last])
    assert all(not (par[j] == last and ids[j] == bonus) for j in range(1, tree.n + 1))


def test_follow_rejects_wrong_shape():
    with pytest.raises(ValueError, match="target_choices"):
        follow_verified_tree(_example_compiled(), torch.zeros(3, dtype=torch.long))


# ---- validation ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("logits, budget, match", [
    (torch.randn(3, 4), -1, "budget"),
    (torch.randn(3, 4), 2.0, "budget"),
    (torch.randn(3, 4), True, "budget"),
    (torch.randn(4), 3, "2-D"),
    (torch.randn(2, 3, 4), 3, "2-D"),
    (torch.ones(3, 4, dtype=torch.long), 3, "floating"),
    (torch.tensor([[0.0, float("nan")]]), 3, "NaN"),
    (torch.tensor([[0.0, float("inf")]]), 3, "inf"),
    (torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]]), 3, "-inf everywhere"),
    (torch.zeros(2, 0), 3, "empty vocabulary"),
])
def test_build_rejects_bad_input(logits, budget, match):
    with pytest.raises(ValueError, match=match):
        build_tree(logits, budget)
