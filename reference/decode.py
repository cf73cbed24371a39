"""The DDTree decode loop, one named function per stage (ARCHITECTURE.md):

    draft -> build_tree -> compile_tree -> verify -> follow -> commit

State between rounds: the committed tokens (their rows in the target's latent cache), the pending bonus token
(emitted, not yet run through the target) and the drafter's context (keys/values of the committed tokens'
target features). Modes: "ar" (plain decoding through the verify path: a root-only tree), "chain" (linear
DFlash: the drafter's argmax chain, verified causally) and "ddtree" (the best-first tree of `budget` nodes).

Counting follows DFlash/DDTree: the first token comes from the prefill; every round then emits its accepted
drafts plus a new bonus, and `acceptance_lengths` holds that count per round (accepted drafts + 1), cut at
max_new_tokens and at a stop token. Near the end the draft block shrinks to the tokens still allowed
(as `dflash_generate` does), so no node is ever placed past max_new_tokens.

Sampling (temperature > 0) is lossless: every verify row is sampled from the target's own distribution given
that node's true prefix, and the walk only follows rows whose prefix was itself accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .drafter import DraftContext, Drafter
from .target import LatentCache, Target
from .tree import CompiledTree, Tree, build_tree, compile_tree, follow_verified_tree

__all__ = ["generate", "GenerateOutput", "RoundTrace", "DecodeState", "MODES", "sample", "sampling_probs",
           "prefill", "draft", "chain_tree", "verify", "commit"]

MODES = ("ar", "chain", "ddtree")


@dataclass
class RoundTrace:
    """What one round did, for stepping through a run (generate(..., trace=True))."""
    start: int                        # committed tokens before the round (prompt included)
    tree: Tree
    compiled: CompiledTree
    target_choices: list              # the target's token at every verify row
    accepted: list                    # accepted node indices, root first
    bonus: int                        # the next bonus token
    emitted: list                     # tokens this round emitted (accepted drafts + bonus, after cuts)


@dataclass
class GenerateOutput:
    tokens: list                      # new tokens only (at most max_new_tokens)
    acceptance_lengths: list          # tokens emitted per round, bonus counted
    trace: Optional[list] = None      # RoundTrace per round when requested

    @property
    def mean_acceptance(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


@dataclass
class DecodeState:
    cache: LatentCache                # target latent rows of the committed tokens
    context: Optional[DraftContext]   # drafter context (None in "ar" mode)
    start: int                        # committed tokens = cache rows
    bonus: int                        # pending token: emitted, its KV not yet computed
    emitted: list = field(default_factory=list)


# ---- sampling ------------------------------------------------------------------------------------------------

def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """float64 [n, V]: softmax(logits / T) restricted to the top_k tokens and the top_p nucleus, per row."""
    scores = logits.double() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, -1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p            # the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return probs


def sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
           generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token per row of logits [n, V]: argmax at temperature 0, else a draw from sampling_probs."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = sampling_probs(logits, temperature, top_p, top_k)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


# ---- stages --------------------------------------------------------------------------------------------------

def _features(target_out, layer_ids: Sequence[int]) -> torch.Tensor:
    return torch.cat([target_out.hidden[i] for i in layer_ids], -1)         # [T, n_f * D]


def prefill(target: Target, drafter: Optional[Drafter], prompt: torch.Tensor, sampler) -> DecodeState:
    """Run the prompt causally, sample the first token, seed the drafter context with the prompt features."""
    cache = target.new_cache()
    layer_ids = drafter.target_layer_ids if drafter is not None else ()
    out = target.forward(prompt, cache=cache, hidden_layers=layer_ids)
    context = None
    if drafter is not None:
        context = drafter.new_context()
        drafter.extend_context(context, _features(out, layer_ids))
    first = int(sampler(out.logits[-1:])[0])
    return DecodeState(cache=cache, context=context, start=prompt.numel(), bonus=first, emitted=[first])


def draft(drafter: Drafter, state: DecodeState, block_size: int) -> torch.Tensor:
    """Per-position draft logits [block_size - 1, V] for positions start+1 .. start+block_size-1."""
    return drafter(state.context, state.bonus, block_size)


def chain_tree(draft_logits: torch.Tensor) -> Tree:
    """Linear DFlash: the argmax token at every depth, each the child of the previous."""
    depth = draft_logits.shape[0]
    lp = torch.log_softmax(draft_logits.double(), -1)
    tokens = lp.argmax(-1)
    dev = draft_logits.device
    return Tree(tokens=tokens, depths=torch.arange(1, depth + 1, device=dev),
                parents=torch.arange(depth, device=dev),
                scores=lp.gather(-1, tokens[:, None]).squeeze(-1).cumsum(0))


def verify(target: Target, state: DecodeState, compiled: CompiledTree, layer_ids: Sequence[int]):
    """Target forward over the root + nodes with tree visibility; writes their rows at slots start.. .
    Returns logits [n+1, V] and the drafter features [n+1, F] of every row."""
    out = target.forward(compiled.ids, positions=compiled.positions, cache=state.cache,
                         visibility=compiled.attention_visibility(), hidden_layers=layer_ids)
    feats = _features(out, layer_ids) if layer_ids else None
    return out.logits, feats


def commit(state: DecodeState, drafter: Optional[Drafter], accepted: list, features, bonus: int) -> None:
    """Compact the target cache to the accepted path (rows start + accepted[j] -> slot start + j), append the
    accepted rows' features to the drafter context, and move on to the new bonus."""
    state.cache.compact(state.start, accepted)
    if drafter is not None:
        drafter.extend_context(state.context, features[torch.as_tensor(accepted, device=features.device)])
    state.start += len(accepted)
    state.bonus = bonus


# ---- the loop ------------------------------------------------------------------------------------------------

def _check_args(target, drafter, prompt_ids, max_new_tokens, mode, budget, temperature, top_p, top_k,
                stop_token_ids):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "ar" and drafter is None:
        raise ValueError(f"mode={mode!r} needs a drafter (load_drafter(path, target=target))")
    if drafter is not None and drafter.target is not target:
        raise ValueError("the drafter is attached to a different target; load it with load_drafter(path, "
                         "target=this_target)")
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if prompt.numel() == 0:
        raise ValueError("prompt_ids is empty: give at least one token")
    vocab = target.cfg.vocab_size
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        bad = [int(t) for t in prompt if not 0 <= int(t) < vocab][:5]
        raise ValueError(f"prompt_ids {bad} outside the vocabulary 0..{vocab - 1}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    limit = target.cfg.max_position_embeddings
    if prompt.numel() + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt.numel()}) + max_new_tokens ({max_new_tokens}) exceeds the target's "
                         f"max_position_embeddings {limit}")
    if budget is not None and (not isinstance(budget, int) or budget < 0):
        raise ValueError(f"budget must be a non-negative int, got {budget!r}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError("temperature and top_k must be >= 0 and top_p in (0, 1]")
    stops = set(int(t) for t in (stop_token_ids or ()))
    if any(not 0 <= t < vocab for t in stops):
        raise ValueError(f"stop_token_ids {sorted(stops)} outside the vocabulary 0..{vocab - 1}")
    return prompt.to(target.device), stops


@torch.no_grad()
def generate(target: Target, drafter: Optional[Drafter], prompt_ids, max_new_tokens: int = 128,
             mode: str = "ddtree", budget: Optional[int] = None, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: Optional[int] = None, stop_token_ids=None, trace: bool = False,
             on_tokens=None) -> GenerateOutput:
    """Decode up to `max_new_tokens` new tokens after `prompt_ids` (see the module docstring).

    budget: DDTree node budget (non-root nodes; default L = block_size - 1); ignored by "ar" and "chain".
    seed: seeds the sampler (temperature > 0). trace: keep a RoundTrace per round.
    on_tokens: optional callback(list[int]) receiving the tokens as each round emits them (streaming).
    """
    prompt, stops = _check_args(target, drafter, prompt_ids, max_new_tokens, mode, budget, temperature, top_p,
                                top_k, stop_token_ids)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def sampler(logits):
        return sample(logits, temperature, top_p, top_k, gen)

    layer_ids = drafter.target_layer_ids if mode != "ar" else ()
    state = prefill(target, drafter if mode != "ar" else None, prompt, sampler)
    if on_tokens:
        on_tokens(list(state.emitted))
    rounds, traces = [], [] if trace else None
    while len(state.emitted) < max_new_tokens and state.emitted[-1] not in stops:
        remaining = max_new_tokens - len(state.emitted)
        if mode == "ar":
            tree = build_tree(torch.zeros(0, target.cfg.vocab_size, device=target.device), 0)   # root only
        else:
            block = min(drafter.block_size, remaining + 1)
            logits_d = draft(drafter, state, block)                           # [block-1, V]
            tree = chain_tree(logits_d) if mode == "chain" else \
                build_tree(logits_d, drafter.block_size - 1 if budget is None else budget)
        compiled = compile_tree(tree, state.bonus, state.start)
        logits, feats = verify(target, state, compiled, layer_ids)
        choices = sampler(logits)
        accepted, bonus = follow_verified_tree(compiled, choices)
        new = [int(compiled.ids[i]) for i in accepted[1:]] + [int(bonus)]
        new = new[:remaining]
        for j, tok in enumerate(new):
            if tok in stops:
                new = new[:j + 1]
                break
        commit(state, drafter if mode != "ar" else None, accepted, feats, int(bonus))
        state.emitted += new
        rounds.append(len(new))
        if on_tokens:
            on_tokens(new)
        if traces is not None:
            traces.append(RoundTrace(start=state.start - len(accepted), tree=tree, compiled=compiled,
                                     target_choices=[int(c) for c in choices], accepted=list(accepted),
                                     bonus=int(bonus), emitted=new))
    return GenerateOutput(tokens=state.emitted, acceptance_lengths=rounds, trace=traces)
