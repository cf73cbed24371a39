"""Where does a fast decoder depart from the reference? A round-by-round comparison of two traced runs.

    from optimized.debug import compare_runs
    cmp = compare_runs(engine, ref_target, ref_drafter, prompt_ids, max_new_tokens=64, mode="ddtree", budget=32)
    print(cmp)                     # "no divergence in 17 rounds", or the first stage that differs

Both runs are traced: `Engine.generate(..., trace=True)` (EngineRoundTrace per round) and
`reference.generate(..., trace=True)` (RoundTrace per round). Per round the stages are compared in the order
they run, and the first difference is reported with the round, the stage, the tree row and both values
("prefill" when the first token already differs, "rounds" when one run has more rounds):

    start    the committed length before the round
    tree     the rows of the compiled tree: token ids and parents, row by row (root first)
    verify   the target's choice at each row
    follow   the accepted rows and the bonus token
    commit   the tokens the round emitted

A difference in `tree` on a model whose drafter runs in another precision is often harmless (the tokens are the
target's: a different tree changes acceptance, not the output). A difference in `verify` gets the reference's
own top-1/top-2 logit margin at that row, from a fresh reference forward over the row's context (prompt, the
tokens emitted before the round, the row's path): a margin within the precision of the fast path is a near-tie,
a large one is a bug.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

STAGES = ("start", "tree", "verify", "follow", "commit")


@dataclass
class Divergence:
    round: int                       # 0-based round index
    stage: str                       # one of STAGES, or "rounds" (one run has more rounds than the other)
    row: Optional[int]               # tree row (verify / tree), else None
    expected: object                 # the reference's value
    actual: object                   # the fast decoder's value
    margin: Optional[float] = None   # verify: the reference's top-1 minus top-2 logit at that row

    def __str__(self) -> str:
        where = f"round {self.round}, stage {self.stage}" + (f", row {self.row}" if self.row is not None else "")
        text = f"first divergence at {where}: reference {self.expected!r}, fast {self.actual!r}"
        if self.margin is not None:
            text += f"; reference top-1/top-2 margin there {self.margin:.4g}"
        return text


@dataclass
class Comparison:
    divergence: Optional[Divergence]
    rounds: int                                  # rounds compared (the shorter run's)
    fast: object = field(repr=False, default=None)        # the fast decoder's output (with .trace)
    reference: object = field(repr=False, default=None)   # the reference's output (with .trace)

    def __str__(self) -> str:
        return str(self.divergence) if self.divergence else f"no divergence in {self.rounds} rounds"


def _rows(rt) -> tuple[list, list]:
    """(ids, parents) of a round's tree rows, root first: from a reference RoundTrace or an EngineRoundTrace."""
    if hasattr(rt, "compiled"):
        return rt.compiled.ids.tolist(), rt.compiled.parents.tolist()
    return list(rt.ids), list(rt.parents)


def _path(parents: Sequence[int], ids: Sequence[int], row: int) -> list:
    """Token ids from the root's child down to `row` (empty for the root)."""
    out = []
    while row > 0:
        out.append(int(ids[row]))
        row = int(parents[row])
    return out[::-1]


def _first_diff(a: Sequence, b: Sequence) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _at(seq: Sequence, row: int):
    return seq[row] if row < len(seq) else "no row"


def compare_traces(fast: Sequence, expected: Sequence, first_token: int, target=None,
                   prompt_ids=None) -> tuple[Optional[Divergence], int]:
    """(first Divergence or None, rounds compared) between a fast trace and the reference trace (either may be
    a list of reference RoundTrace or of EngineRoundTrace: two reference runs compare too). first_token:
    the token both runs emitted from the prefill (the root of round 0). With `target` (the reference target)
    and `prompt_ids`, a verify divergence gets the reference's margin at that row."""
    emitted = [int(first_token)]
    for i, (f, e) in enumerate(zip(fast, expected)):
        if e.start != f.start:
            return Divergence(i, "start", None, e.start, f.start), i + 1
        ids, parents = _rows(e)
        want, got = list(zip(ids, parents)), list(zip(*_rows(f)))
        row = _first_diff(want, got)
        if row is not None:
            return Divergence(i, "tree", row, _at(want, row), _at(got, row)), i + 1
        row = _first_diff(list(e.target_choices), list(f.target_choices))
        if row is not None:
            margin = None
            if target is not None and prompt_ids is not None and row < len(ids):
                margin = reference_margin(target, list(prompt_ids) + emitted + _path(parents, ids, row))
            return Divergence(i, "verify", row, _at(e.target_choices, row), _at(f.target_choices, row),
                              margin), i + 1
        for stage, want, got in (("follow", (list(e.accepted), e.bonus), (list(f.accepted), f.bonus)),
                                 ("commit", list(e.emitted), list(f.emitted))):
            if want != got:
                return Divergence(i, stage, None, want, got), i + 1
        emitted += list(e.emitted)
    if len(fast) != len(expected):
        n = min(len(fast), len(expected))
        return Divergence(n, "rounds", None, len(expected), len(fast)), n
    return None, len(fast)


@torch.no_grad()
def reference_margin(target, tokens: Sequence[int]) -> float:
    """The reference target's top-1 minus top-2 logit after `tokens` (the choice of the row they lead to)."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=target.device)
    top = target.logits(ids)[-1].double().topk(2).values
    return float(top[0] - top[1])


def compare_runs(engine, ref_target, ref_drafter, prompt_ids, max_new_tokens: int = 64, mode: str = "ddtree",
                 budget=None, **kw) -> Comparison:
    """Run `engine` (an optimized.engine.Engine, either backend) and reference.generate on the same prompt, both
    traced, and compare them round by round (greedy unless kw says otherwise)."""
    import reference
    fast = engine.generate(prompt_ids, max_new_tokens=max_new_tokens, mode=mode, budget=budget, trace=True, **kw)
    ref = reference.generate(ref_target, ref_drafter, prompt_ids, max_new_tokens=max_new_tokens, mode=mode,
                             budget=budget, trace=True, **kw)
    if fast.tokens[:1] != ref.tokens[:1]:
        margin = reference_margin(ref_target, list(prompt_ids))
        return Comparison(Divergence(-1, "prefill", None, ref.tokens[0], fast.tokens[0], margin), 0, fast, ref)
    div, rounds = compare_traces(fast.trace, ref.trace, ref.tokens[0], ref_target, prompt_ids)
    return Comparison(div, rounds, fast, ref)
