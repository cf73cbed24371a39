"""The optimized decode engine: the whole DDTree round on the device, CUDA-graph captured, one host sync a round.

    engine = Engine(target, drafter)                       # reference modules on the GPU in bf16 (load_target)
    out = engine.generate(prompt_ids, max_new_tokens=128, mode="ddtree", budget=32)

State lives in static device buffers sized at construction for R = max_requests requests: the target's latent
cache [layers, R, cap, C+R], the drafter's context keys/values [draft layers, R, cap, G, E], the committed
lengths `start` and the pending bonus tokens (int64 [R] each). A round is the ARCHITECTURE.md stages with no host synchronisation inside:

    draft    drafter([bonus, mask x L]) over the context rows < start                -> logits [L, V]
    tree     build_tree + compile_tree (Numba kernels)                               -> ids, depths, parents, mask bits
    verify   target forward over the T = n + 1 rows at positions start + depth; their latent rows are written
             at slots start..start+T-1; MLA attention (CuPy kernel) reads the prefix and the tree mask with
             S = start + T taken from the device; INT4 MoE (CuPy kernels)             -> logits [T, V], features
    commit   target choices (argmax or a device sample), follow (Numba), then gather-then-write of the
             accepted rows (latent rows and drafter context rows) to start.., start += accepted, new bonus,
             and the emitted tokens into a small output buffer

Every write of a round lands at slots >= start, past the committed prefix, so a round can be replayed over
garbage left by an earlier one: that is what makes warm-up and capture harmless. The host then reads the
output buffer once (one sync) to stream tokens, cut at stop tokens and max_new_tokens.

CUDA graphs: one graph per (requests, mode, budget, draft depth, length bucket); the bucket is the power of two >= 256
covering start + T, so attention work follows the real length while a handful of graphs cover every prefix. The
prefill too: one graph per (request, rows, bucket), each prompt chunk padded to a power of two rows (`_prefill`).
A failed capture raises GraphCaptureError (never a silent eager fallback); `eager=True` runs without graphs.
`stage_timing=True` captures each stage as its own graph and times it with CUDA events (RoundTiming).

Every RMSNorm and RoPE of both models goes through `ops.norm` / `ops.rope`: one CuPy launch each on the cuda
backend (optimized/norm_rope.py; the reference forms them from ~8-10 small kernels), the reference modules on
the torch backend. Dense projections stay in torch (cuBLAS). The drafter's attention on the cuda backend is
optimized/draft_ops.py: q norm + RoPE one launch, every key/value write one launch, attention one launch (the
reference's steps were ~16 launches a layer); the torch backend keeps the reference's steps.

Fewer launches in the target on the cuda backend (this launch-bound engine pays ~2 us each): q (or q_a) and kv_a
as one GEMM; the latent rows (kv_a norm, k_pe RoPE, cat, cache write) in one launch (norm_rope.latent_rows, bit
for bit the separate steps); SwiGLU gate|up as one GEMM plus silu_mul; the residual adds inside the o_proj and
down GEMMs (in-place addmm_, one rounding where the reference rounds the product first) and inside the routed
experts' combine. The packed weights replace the modules' own (those become views), so nothing is stored twice.

Backends (`engine.backend`, asserted by the tests): "cuda" (the suite's kernels, bf16, graphs) and "torch"
(the same round through reference ops: any device and dtype, eager only; it is how the round logic and expert
parallelism are tested on CPU in CI, and the debugging twin of the cuda backend). Neither falls back to the
other: asking for "cuda" without a GPU, CuPy or Numba raises with what to install.

Expert parallelism: pass `group` (a torch.distributed process group) and `experts` (this rank's routed expert
ids). Each MoE layer computes its partial sum over the held experts and ends in one all-reduce; the tree,
acceptance and commit are computed identically on every rank from identical logits, so ranks never disagree.
With budget="auto" the group's rank 0 chooses each round's budget from its own timings and broadcasts it.

Several requests: Engine(..., max_requests=R) sizes every buffer for R requests, and generate_batch(prompts)
decodes them in shared rounds: one drafter forward over all blocks, R tree builds, ONE target forward over all
R x T tree rows (dense layers and the INT4 MoE see R x T tokens at once; attention runs per request over its own
prefix and tree mask), R walks, one commit. There is no requests x budget limit (the SGLang deployment's
batched-GEMM cap): the MoE kernels take any token count, attention is launched per request. A finished request
stops committing (its `active` flag) while the others go on. The tail block follows the request with the most
tokens left, so a batch's greedy tokens equal each request's own run, and only tail-round acceptance counts can
differ from a single-request run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from reference.decode import GenerateOutput, _check_args, chain_tree, sample, sampling_probs
from reference.drafter import Drafter
from reference.target import Target, absorbed_attention as torch_absorbed_attention, apply_rope, rope_cos_sin
from reference.tree import CompiledTree, Tree, build_tree as torch_build_tree, compile_tree as torch_compile_tree, \
    follow_verified_tree as torch_follow, node_count

from .draft_ops import attention_kernel, draft_attention, head_norm_rope, rows_rope, silu_mul, write_keys_values
from .greedy import argmax_rows
from .norm_rope import latent_rows
from .mla_attention import MAX_T, pack_visibility, unpack_visibility

__all__ = ["Engine", "AutoBudget", "GraphCaptureError", "RoundTiming", "BACKENDS", "MIN_BUCKET"]

BACKENDS = ("cuda", "torch")
MIN_BUCKET = 256
MAX_BUDGET = MAX_T - 1          # 1024


class GraphCaptureError(RuntimeError):
    pass


@dataclass
class RoundTiming:
    """Device milliseconds per stage, summed over the rounds of one generate (stage_timing=True)."""
    draft: float = 0.0
    tree: float = 0.0
    verify: float = 0.0
    commit: float = 0.0
    rounds: int = 0
    host: float = 0.0             # wall time of the host loop minus the stages (launch, sync, Python)

    def per_round(self) -> dict:
        n = max(self.rounds, 1)
        return {k: getattr(self, k) / n for k in ("draft", "tree", "verify", "commit", "host")}


class AutoBudget:
    """budget="auto": pick each round's budget from a measured cost model, the candidate with the most expected
    committed tokens per second of round time. Both terms are measured online on this engine (running means
    over the rounds that ran each candidate: tokens committed, bonus counted, and the wall time from launch to
    the round's sync, graph captures excluded), so the choice tracks the drafter's current acceptance and the
    target's real verify cost (which grows with the distinct experts a bigger tree touches). Every candidate is
    tried `warmup` times first; afterwards the best ratio is taken, with one exploratory round in `explore`."""

    def __init__(self, candidates: Sequence[int] = (4, 8, 16, 32, 64, 128), warmup: int = 2, explore: int = 16,
                 decay: float = 0.9):
        self.candidates = tuple(candidates)
        self.warmup, self.explore, self.decay = warmup, explore, decay
        self.tokens = {b: 0.0 for b in self.candidates}
        self.seconds = {b: 0.0 for b in self.candidates}
        self.count = {b: 0 for b in self.candidates}
        self.rounds = 0
        self.history: list = []

    def choose(self) -> int:
        self.rounds += 1
        for b in self.candidates:
            if self.count[b] < self.warmup:
                return b
        if self.rounds % self.explore == 0:                       # revisit the least-measured candidate
            return min(self.candidates, key=lambda b: self.count[b])
        return max(self.candidates, key=self.rate)

    def rate(self, b: int) -> float:
        return self.tokens[b] / max(self.seconds[b], 1e-12)

    def observe(self, budget: int, committed: int, seconds: float) -> None:
        d = self.decay if self.count[budget] >= self.warmup else 1.0
        self.tokens[budget] = d * self.tokens[budget] + committed
        self.seconds[budget] = d * self.seconds[budget] + seconds
        self.count[budget] += 1
        self.history.append(budget)


# ---- backends ------------------------------------------------------------------------------------------------

class _TorchOps:
    """The round through reference ops (host syncs allowed): any device, any dtype."""

    def build_tree(self, logits: torch.Tensor, budget: int) -> Tree:
        return torch_build_tree(logits, budget)

    def compile(self, tree: Tree, root: torch.Tensor, bits_out: torch.Tensor):
        ct = torch_compile_tree(tree, int(root.reshape(-1)[0]), 0)
        bits_out.copy_(pack_visibility(ct.visibility))
        return ct.ids, ct.depths, ct.parents

    def follow(self, ids, parents, choices):
        acc, bonus = torch_follow(CompiledTree(ids, ids, parents, ids, None, 0), choices)
        out = torch.full_like(ids, -1)
        out[:len(acc)] = torch.as_tensor(acc, device=ids.device)
        dev = ids.device
        return out, torch.tensor([len(acc)], device=dev), torch.tensor([bonus], device=dev)

    def attention(self, q_lat, q_pe, latent, bits, start, seq_len, scale, out):
        t, s = q_lat.shape[0], latent.shape[0]
        p = int(start)
        vis = torch.zeros(t, s, dtype=torch.bool, device=latent.device)
        vis[:, :p] = True
        vis[:, p:p + t] = unpack_visibility(bits, t)
        out.copy_(torch_absorbed_attention(q_lat, q_pe, latent, vis, scale))

    def norm(self, module, x):
        return module(x)

    def rope(self, x, cos, sin, interleave):
        return apply_rope(x, cos, sin, interleave)


class _CudaOps:
    """The suite's kernels: Numba tree stages, CuPy MLA attention and INT4 MoE; no host sync anywhere."""

    def __init__(self, tree_config=None):
        try:
            from . import tree_numba
            from .mla_attention import tree_attention
        except ImportError as e:
            raise RuntimeError(f"the cuda backend needs numba-cuda and CuPy ({e}); install the project's [gpu] "
                               "extra, or pass backend='torch'") from e
        if tree_numba.backend() != "cuda":
            raise RuntimeError("the cuda backend cannot run under NUMBA_ENABLE_CUDASIM=1; unset it, or pass "
                               "backend='torch'")
        from .norm_rope import rms_norm, rope
        self._tree, self._attn, self._norm, self.rope = tree_numba, tree_attention, rms_norm, rope
        self.tree_config = tree_numba._check_config(tree_config or tree_numba.DEFAULT_CONFIG)

    def build_tree(self, logits: torch.Tensor, budget: int) -> Tree:
        return self._tree.build_tree(logits.float(), budget, config=self.tree_config)

    def compile(self, tree: Tree, root: torch.Tensor, bits_out: torch.Tensor):
        ct = self._tree.compile_tree(tree, root, 0, bits_out=bits_out)
        return ct.ids, ct.depths, ct.parents

    def follow(self, ids, parents, choices):
        acc = self._tree.follow_verified_tree(CompiledTree(ids, ids, parents, ids, None, 0), choices)
        return acc.indices, acc.length, acc.bonus

    def attention(self, q_lat, q_pe, latent, bits, start, seq_len, scale, out):
        self._attn(q_lat, q_pe, latent, bits, scale, out=out, seq_len=seq_len)

    def norm(self, module, x):
        return self._norm(x, module.weight, module.eps)


# ---- the engine ----------------------------------------------------------------------------------------------

@dataclass
class _Buffers:
    """Static device state for up to R requests (index r); slots are rows of a request's [cap] range."""
    latent: torch.Tensor                  # [layers, R, cap, C+R]
    ctx_k: Optional[torch.Tensor]         # [draft layers, R, cap, G, E]
    ctx_v: Optional[torch.Tensor]
    start: torch.Tensor                   # int64 [R]: committed tokens
    bonus: torch.Tensor                   # int64 [R]: the pending token
    active: torch.Tensor                  # int64 [R]: 1 while the request decodes (0: its commits are skipped)
    out_tokens: torch.Tensor              # int64 [R, MAX_T + 1]: the round's emitted tokens (first `length`)
    out_length: torch.Tensor              # int64 [R]
    host: torch.Tensor                    # int64 [R, MAX_T + 2] pinned, used flat: per request its length, then tokens
    host_active: torch.Tensor             # int64 [R] pinned
    arange: torch.Tensor                  # int64 [MAX_T + 1]
    offs: torch.Tensor                    # int64 [R]: r * cap (flat slot of a request's row 0)
    prefill_ids: torch.Tensor             # int64 [MAX_T]: the prompt chunk being prefilled (pad rows: any ids)
    prefill_last: torch.Tensor            # int64 [1]: its last real row (the row whose logits prefill returns)


@dataclass
class _Round:
    """What a round's stages hand each other (device tensors; kept alive by the graph record)."""
    logits_d: Optional[torch.Tensor] = None     # [R, depth, V]
    ids: Optional[torch.Tensor] = None          # [R, T]
    depths: Optional[torch.Tensor] = None       # [R, T]
    parents: Optional[torch.Tensor] = None      # [R, T]
    bits: Optional[torch.Tensor] = None         # int32 [R, Tp, W] (Tp: T rounded up so each request's words
    logits: Optional[torch.Tensor] = None       #   start on a 16-byte boundary)
    feats: Optional[torch.Tensor] = None        # [R, T, F]
    choices: Optional[torch.Tensor] = None      # [R, T]
    accepted: Optional[torch.Tensor] = None     # [R, T]: accepted row indices, -1 past the path
    bonus: Optional[torch.Tensor] = None        # [R]


@dataclass
class EngineRoundTrace:
    """One request's round as the engine ran it (generate(..., trace=True)); the fields of reference.decode's
    RoundTrace that a comparison needs, as host lists. Row 0 is the root (the pending bonus token)."""
    start: int                       # committed length before the round
    ids: list                        # [T] token per tree row
    parents: list                    # [T] parent row (-1 for the root)
    depths: list                     # [T]
    target_choices: list             # [T] the target's choice at each row
    accepted: list                   # accepted rows, root first
    bonus: int
    emitted: list                    # tokens this round emitted (after stop / max_new_tokens cuts)


@dataclass
class _Graphs:
    graphs: list                          # one graph, or one per stage
    rnd: object                           # what the captured calls produced: a round's _Round, a prefill's logits


def _stack(ts: list) -> torch.Tensor:
    """torch.stack(ts), or a view of the one tensor when there is one request (a stack copies: one launch)."""
    return ts[0][None] if len(ts) == 1 else torch.stack(ts)


def _pack_rows(weights: Sequence[torch.Tensor], modules: Sequence) -> torch.Tensor:
    """torch.cat(weights) along rows: one [sum of rows, D] weight, so one GEMM serves several projections. Each
    nn.Linear of `modules` (None skipped) whose weight is one of `weights` (the same storage) is rebound to its
    view of the packed tensor, so no second copy is kept."""
    packed = torch.cat(list(weights)).detach()
    views = packed.split([w.shape[0] for w in weights])
    for m in modules:
        for w, view in zip(weights, views):
            if m is not None and m.weight.data_ptr() == w.data_ptr() and m.weight.shape == w.shape:
                m.weight.data = view
    return packed


def _pad4(t: int) -> int:
    return -(-t // 4) * 4


class Engine:
    """Decode state for up to `max_requests` requests over a (target, drafter) pair. See the module docstring.

    target: a reference.Target whose dense weights sit on the engine's device (routed experts may stay on the
    meta device when `moe_weights` is given). moe_weights: {layer: optimized.moe.MoEWeights} (default: repacked
    from the target once, the held `experts` only). max_seq_len: prompt + new tokens the buffers hold per
    request. max_requests: requests decoded together in one round (generate_batch); every round then runs one
    drafter forward, one verify forward and one MoE pass per layer over all requests' rows together.
    tree_config: the cuda backend's tree launch geometry and kernel choice (an optimized.tree_numba.Config;
    default tree_numba.DEFAULT_CONFIG), e.g. to A/B the warp-list beam against tree_beam inside the engine.
    """

    def __init__(self, target: Target, drafter: Optional[Drafter] = None, *, backend: str = "cuda",
                 eager: bool = False, max_seq_len: Optional[int] = None, moe_weights: Optional[dict] = None,
                 experts: Optional[Sequence[int]] = None, group=None, stage_timing: bool = False,
                 max_requests: int = 1, tree_config=None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        cfg = target.cfg
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.device = target.lm_head.weight.device
        self.dtype = target.lm_head.weight.dtype
        if drafter is not None and drafter.target is not target:
            raise ValueError("the drafter is attached to a different target; load it with load_drafter(path, "
                             "target=this_target)")
        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
            raise ValueError(f"max_requests must be a positive int, got {max_requests!r}")
        if backend == "cuda":
            if self.device.type != "cuda":
                raise ValueError(f"backend='cuda' needs the target on a CUDA device (it is on {self.device}); "
                                 "load it with optimized.load_target(..., device='cuda') or pass backend='torch'")
            if self.dtype != torch.bfloat16:
                raise ValueError(f"backend='cuda' runs bf16 (the kernels are W4A16 / bf16 MLA); the target is "
                                 f"{self.dtype}: load it with dtype=torch.bfloat16 or pass backend='torch'")
            self.ops = _CudaOps(tree_config)
        else:
            if not eager:
                eager = True      # the torch backend syncs inside the round: graphs do not apply (documented)
            if tree_config is not None:
                raise ValueError("tree_config selects the cuda backend's tree kernels; the torch backend builds "
                                 "trees with reference.tree (pass tree_config=None)")
            self.ops = _TorchOps()
        self.backend, self.eager, self.stage_timing = backend, eager, stage_timing
        self.group = group
        self.layer_ids = tuple(drafter.target_layer_ids) if drafter is not None else ()
        self.max_seq_len = int(max_seq_len or min(cfg.max_position_embeddings, 8192))
        if not 1 <= self.max_seq_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {self.max_seq_len} outside 1..max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        # key slots per request, a multiple of 64: the drafter's attention GEMMs run over [bucket] keys, and an
        # odd bucket (max_seq_len + MAX_T) sent cuBLAS to its unaligned kernels (146 us a layer at K2.6 widths,
        # bench/results/engine_notes.md)
        self.cap = -(-(self.max_seq_len + MAX_T) // 64) * 64
        self.max_requests = max_requests
        self._moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        self.held = None if experts is None else sorted({int(e) for e in experts})
        if self.held is not None and any(not 0 <= e < cfg.n_routed_experts for e in self.held):
            raise ValueError(f"experts {self.held[:8]} outside 0..{cfg.n_routed_experts - 1}")
        if backend == "cuda":
            if moe_weights is None:
                from .moe import load_moe_weights
                moe_weights = {i: load_moe_weights(target.model.layers[i].mlp, cfg, experts=self.held,
                                                   device=self.device) for i in self._moe_layers}
            missing = [i for i in self._moe_layers if i not in moe_weights]
            if missing:
                raise ValueError(f"moe_weights lacks MoE layers {missing[:8]}")
        self.moe_weights = moe_weights
        self._prepare_attention()
        self._prepare_mlps()
        self._prepare_drafter()
        self._alloc()
        self._graphs: dict = {}
        self._pool = None
        self._sampling = None
        self.expert_log: Optional[list] = None     # set to [] (eager) to record (layer, expert ids [T, K])

    # ---- construction ----------------------------------------------------------------------------------

    def _prepare_drafter(self):
        """cuda backend: the drafter's projections packed for fewer launches (every launch costs ~2 us in this
        launch-bound engine): per layer q|k|v and gate|up as one weight each, and every layer's context k|v as one
        (commit's context extension). Each output column is the same dot product as in the separate projection
        (cuBLAS may sum it in another order). The torch backend keeps the reference's separate projections."""
        self._dqkv = self._dgu = self._dctx = self._dkw = None
        if self.drafter is None or self.backend != "cuda":
            return
        attn = [layer.self_attn for layer in self.drafter.layers]
        attention_kernel(attn[0].heads // attn[0].kv_heads, attn[0].head_dim)     # a clear error at load, if any
        if len({a.k_norm.eps for a in attn} | {a.q_norm.eps for a in attn}) != 1:
            raise ValueError("Engine: the drafter's q/k norms must share one eps (the cuda backend writes every "
                             "layer's keys in one launch)")
        self._dqkv = [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) for a in attn]
        self._dgu = [torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]) for layer in self.drafter.layers]
        self._dctx = torch.cat([w for a in attn for w in (a.k_proj.weight, a.v_proj.weight)])
        self._dkw = torch.stack([a.k_norm.weight for a in attn])                    # [layers, E]

    def _prepare_mlps(self):
        """cuda backend: each bf16 SwiGLU of the target (a dense layer's MLP, an MoE layer's shared expert) gets
        its gate and up projections as one [2F, D] weight (one GEMM). The separate gate/up weights (module
        parameters, MoEWeights.shared) become views of it, so no second copy is kept."""
        self._tgu = {}
        if self.backend != "cuda":
            return
        for i, layer in enumerate(self.target.model.layers):
            mods = layer.mlp.shared_experts if self.cfg.is_moe_layer(i) else layer.mlp
            if self.cfg.is_moe_layer(i):
                if self.moe_weights[i].shared is None:
                    continue
                gate, up, down = self.moe_weights[i].shared
            else:
                if not all(type(m) is torch.nn.Linear for m in (mods.gate_proj, mods.up_proj, mods.down_proj)):
                    continue                       # e.g. INT4 dense projections: the module's own forward
                gate, up, down = mods.gate_proj.weight, mods.up_proj.weight, mods.down_proj.weight
            if gate.dtype != torch.bfloat16 or gate.device != self.device:
                continue
            gu = _pack_rows((gate, up), (getattr(mods, "gate_proj", None), getattr(mods, "up_proj", None)))
            if self.cfg.is_moe_layer(i):
                self.moe_weights[i].shared = (*gu.split(gate.shape[0]), down)
            self._tgu[i] = (gu, down)

    def _prepare_attention(self):
        cfg = self.cfg
        h, n, c = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        self._w_uk, self._w_uv = [], []
        for layer in self.target.model.layers:
            w = layer.self_attn.kv_b_proj.weight.view(h, -1, c)                     # [H, N+A, C]
            self._w_uk.append(w[:, :n].contiguous())
            self._w_uv.append(w[:, n:].contiguous())
        self._rope_amp = cfg.rope_scaling.amplitude if cfg.rope_scaling is not None else 1.0
        # cuda backend: each layer's first projections of x (q_proj, or q_a_proj, and kv_a_proj_with_mqa) as one
        # [Q + C + R, D] weight; the modules' weights become views of it (no second copy)
        self._qkv_a: dict = {}
        for layer in self.target.model.layers if self.backend == "cuda" else ():
            at = layer.self_attn
            first = at.q_proj if cfg.q_lora_rank is None else at.q_a_proj
            lins = (first, at.kv_a_proj_with_mqa)
            if not all(type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16 for m in lins):
                continue
            self._qkv_a[at] = (_pack_rows([m.weight for m in lins], lins), first.weight.shape[0])
        # the cuda backend writes each layer's latent rows in one launch (norm_rope.latent_rows) where its shape
        # allows (C % 8 == 0, C <= 1024, bf16 norm weights); else the four launches of the reference's steps
        self._latent_rows = self.backend == "cuda" and cfg.kv_lora_rank % 8 == 0 and cfg.kv_lora_rank <= 1024 \
            and all(layer.self_attn.kv_a_layernorm.weight.dtype == torch.bfloat16 for layer in self.target.model.layers)

    def _alloc(self):
        cfg, dev, r = self.cfg, self.device, self.max_requests
        row = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        z = dict(device=dev)
        latent = torch.zeros(cfg.num_hidden_layers, r, self.cap, row, dtype=self.dtype, **z)
        ctx_k = ctx_v = None
        if self.drafter is not None:
            d = self.drafter.cfg
            shape = (d.num_hidden_layers, r, self.cap, d.num_key_value_heads, d.dim_head)
            ctx_k = torch.zeros(shape, dtype=self.drafter.fc.weight.dtype, **z)
            ctx_v = torch.zeros_like(ctx_k)
        pin = dev.type == "cuda"
        long = dict(dtype=torch.long, **z)
        self.buf = _Buffers(latent, ctx_k, ctx_v, torch.zeros(r, **long), torch.zeros(r, **long),
                            torch.ones(r, **long), torch.zeros(r, MAX_T + 1, **long), torch.zeros(r, **long),
                            torch.zeros(r, MAX_T + 2, dtype=torch.long, pin_memory=pin),
                            torch.ones(r, dtype=torch.long, pin_memory=pin), torch.arange(MAX_T + 1, **z),
                            torch.arange(r, **z) * self.cap, torch.zeros(MAX_T, **long), torch.zeros(1, **long))
        self._draft_ids = None if self.drafter is None else torch.full(
            (r, self.drafter.block_size), self.drafter.mask_token_id, **long)      # column 0: each round's bonus
        self._statics: dict = {}                  # _static's tensors (per-shape constants of rounds and prefill)

    # ---- the target forward over T rows per request at slots start.. (prefill chunks and verify alike) -------

    def _forward(self, ids: torch.Tensor, depths: torch.Tensor, bits: torch.Tensor, bucket: int,
                 want_feats: bool, r0: int = 0, logit_rows: Optional[torch.Tensor] = None):
        """Requests r0..r0+n-1: ids [n, T] at positions start + depths [n, T], visibility: their prefix + bits
        [n, Tp, W]. Writes latent rows at slots start..start+T-1. Returns (logits [n, T, V], features
        [n, T, F] or None); logit_rows (flat row indices, one request): logits of those rows only [1, k, V]."""
        cfg, b = self.cfg, self.buf
        n, t = ids.shape
        start = b.start[r0:r0 + n]
        _, slots = self._rows(r0, n, t)                                                      # flat [n*T]
        seq_len = (start + t).to(torch.int32)
        cos, sin = rope_cos_sin(self.target.inv_freq, (start[:, None] + depths).reshape(-1), self._rope_amp)
        h = self.target.embed(ids.reshape(-1))                                               # [n*T, D]
        feats, own = {}, True                    # own: no one else holds h, so a residual add may write into it
        for i, layer in enumerate(self.target.model.layers):
            at = layer.self_attn
            flat = b.latent[i].view(-1, b.latent.shape[-1])                                  # [R*cap, C+R]
            q_nope, q_pe = self._project(at, self.ops.norm(layer.input_layernorm, h), cos, sin, flat, slots)
            q_lat = self._absorb(q_nope, self._w_uk[i])                                     # [n*T, H, C]
            q_pe = q_pe.contiguous()
            o_lat = torch.empty_like(q_lat)
            for j in range(n):                        # one attention launch per request (its own prefix)
                rows_j = slice(j * t, (j + 1) * t)
                self.ops.attention(q_lat[rows_j], q_pe[rows_j], b.latent[i, r0 + j, :bucket], bits[j, :t],
                                   start[j:j + 1], seq_len[j:j + 1], cfg.softmax_scale, o_lat[rows_j])
            o = self._absorb(o_lat, self._w_uv[i].transpose(1, 2)).view(n * t, -1)            # [n*T, H*A]
            if self.backend == "cuda":           # residual adds inside the GEMMs / the MoE combine (fewer launches)
                h = self._add_mm(h, o, at.o_proj.weight, own)
                h, own = self._mlp_residual(i, layer, h, self.ops.norm(layer.post_attention_layernorm, h)), True
            else:
                h = h + at.o_proj(o)
                h = h + self._mlp(i, layer, self.ops.norm(layer.post_attention_layernorm, h))
            if want_feats and i in self.layer_ids:
                feats[i], own = h, False         # kept: the next residual add must not write into it
        last = h if logit_rows is None else h.index_select(0, logit_rows)
        logits = self.target.lm_head(self.ops.norm(self.target.model.norm, last)).view(n, -1, self.cfg.vocab_size)
        return logits, (torch.cat([feats[i] for i in self.layer_ids], -1).view(n, t, -1) if want_feats else None)

    def _absorb(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Per head x [rows, H, a] @ w [H, a, b] -> contiguous [rows, H, b]. The cuda backend runs one batched GEMM
        on the head-major views (cuBLAS takes the token-major strides), so neither side is permuted into a copy
        (an einsum copied both: two copy kernels a layer); the torch backend keeps the reference's einsum."""
        if self.backend != "cuda":
            return torch.einsum("tha,hab->thb", x, w).contiguous()
        out = torch.empty(x.shape[0], x.shape[1], w.shape[2], dtype=x.dtype, device=x.device)
        torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
        return out

    def _project(self, at, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, flat: torch.Tensor,
                 slots: torch.Tensor):
        """reference.target.Attention.project through the backend's norm and RoPE: returns (q_nope, q_pe) and
        writes the latent rows at flat[slots] (cuda backend: one latent_rows launch for norm, RoPE, cat, write)."""
        cfg, norm, rope = self.cfg, self.ops.norm, self.ops.rope
        if at in self._qkv_a:              # q (or q_a) and kv_a as one GEMM; both parts are views of its output
            w, q_rows = self._qkv_a[at]
            qa, kv = F.linear(x, w).split([q_rows, w.shape[0] - q_rows], -1)
        else:
            qa, kv = (at.q_proj if cfg.q_lora_rank is None else at.q_a_proj)(x), at.kv_a_proj_with_mqa(x)
        q = qa if cfg.q_lora_rank is None else at.q_b_proj(norm(at.q_a_layernorm, qa))
        q = q.view(x.shape[0], cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        q_pe = rope(q_pe, cos, sin, cfg.rope_interleave)
        if self._latent_rows:
            latent_rows(kv, at.kv_a_layernorm.weight, at.kv_a_layernorm.eps, cos, sin, cfg.rope_interleave, slots,
                        flat)
        else:
            ckv, k_pe = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
            k_pe = rope(k_pe, cos, sin, cfg.rope_interleave)
            flat.index_copy_(0, slots, torch.cat([norm(at.kv_a_layernorm, ckv), k_pe], -1))
        return q_nope, q_pe

    def _keys_values(self, at, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """reference.drafter.DraftAttention.keys_values through the backend's norm and RoPE (torch backend)."""
        k = self.ops.norm(at.k_norm, at.k_proj(x).view(x.shape[0], at.kv_heads, at.head_dim))
        return self.ops.rope(k, cos, sin, False), at.v_proj(x).view(x.shape[0], at.kv_heads, -1)

    @staticmethod
    def _add_mm(h: torch.Tensor, a: torch.Tensor, w: torch.Tensor, own: bool) -> torch.Tensor:
        """h + a w^T in one GEMM (one rounding where the reference rounds a w^T, then the sum): in place when
        the forward owns h (out of place, torch would first copy h: a launch for a launch)."""
        return h.addmm_(a, w.t()) if own else torch.addmm(h, a, w.t())

    def _swiglu_into(self, i: int, h: torch.Tensor, x: torch.Tensor, own: bool) -> torch.Tensor:
        """h + down(silu(gate x) * up x) in three launches (the packed gate|up weight of _prepare_mlps)."""
        gu, down = self._tgu[i]
        return self._add_mm(h, silu_mul(F.linear(x, gu)), down, own)

    def _mlp_residual(self, i: int, layer, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """cuda backend: h + layer i's MLP or MoE of x, for an h the forward owns (written in place). SwiGLU MLPs
        (dense, the shared expert) as gate|up GEMM, silu_mul, down GEMM with h added; the routed experts' combine
        adds the result of that (one launch each where the reference takes five, then an add)."""
        if not self.cfg.is_moe_layer(i):
            return self._swiglu_into(i, h, x, True) if i in self._tgu else h + layer.mlp(x)
        from .moe import moe_routed, router, shared_expert
        w = self.moe_weights[i]
        idx, wt = router(x, w, self.cfg)
        if self.expert_log is not None:                # diagnostics (eager only): experts per layer
            self.expert_log.append((i, idx))
        if self.group is None:
            if i in self._tgu:                         # the shared expert
                h = self._swiglu_into(i, h, x, True)
            return moe_routed(x, idx, wt, w, h)
        part = moe_routed(x, idx, wt, w, None, torch.float32)                  # fp32 partial [T, D]
        torch.distributed.all_reduce(part, group=self.group)
        if w.shared is not None:
            part += shared_expert(x, w).float()
        return h + part.to(x.dtype)

    def _mlp(self, i: int, layer, x: torch.Tensor) -> torch.Tensor:
        """torch backend: the reference's MLP / MoE of x (the routed experts through the reference modules)."""
        if not self.cfg.is_moe_layer(i):
            return layer.mlp(x)
        moe = layer.mlp
        idx, w = moe.gate(x)
        y = torch.zeros_like(x)
        for e in idx.unique().tolist():
            if self.held is not None and e not in self.held:
                continue
            tok, slot = (idx == e).nonzero(as_tuple=True)
            y.index_add_(0, tok, moe.experts[e](x[tok]) * w[tok, slot, None].to(x.dtype))
        if self.group is not None:
            torch.distributed.all_reduce(y, group=self.group)
        return y if moe.shared_experts is None else y + moe.shared_experts(x)

    # ---- the drafter over the static context -------------------------------------------------------------

    def _extend_context(self, feats: torch.Tensor, r0: int = 0):
        """Context keys/values of feats [n, m, F] (requests r0..r0+n-1) at positions/slots start..start+m-1 (rows
        past a request's accepted count are garbage beyond its committed context, overwritten later)."""
        d = self.drafter
        n, m = feats.shape[:2]
        c = self.ops.norm(d.hidden_norm, d.fc(feats.reshape(n * m, -1).to(d.fc.weight.dtype)))
        slots, cos, sin = self._draft_rows(r0, n, m)
        if self._dctx is not None:                    # cuda: every layer's k|v in one GEMM, written in one launch
            write_keys_values(F.linear(c, self._dctx), self._dkw, d.layers[0].self_attn.k_norm.eps, cos, sin,
                              slots, self.buf.ctx_k, self.buf.ctx_v)
            return
        for i, layer in enumerate(d.layers):
            self._write_context(i, slots, *self._keys_values(layer.self_attn, c, cos, sin))

    def _rows(self, r0: int, n: int, m: int):
        """Rows start..start+m-1 of requests r0..r0+n-1: their positions [n*m] and flat slots in the [R*cap]
        ranges of the static buffers."""
        b = self.buf
        pos = (b.start[r0:r0 + n, None] + b.arange[:m]).reshape(-1)
        return pos, pos + b.offs[r0:r0 + n].repeat_interleave(m)

    def _draft_rows(self, r0: int, n: int, m: int):
        """Rows start..start+m-1 of requests r0..r0+n-1: their flat slots [n*m] and the drafter's RoPE angles
        (one launch on the cuda backend: draft_ops.rows_rope, bit-equal to _rows + the drafter's _cos_sin)."""
        d, b = self.drafter, self.buf
        if self.backend == "cuda":
            return rows_rope(b.start[r0:r0 + n], b.offs[r0:r0 + n], m, d.inv_freq, d.rope_amplitude)
        pos, slots = self._rows(r0, n, m)
        return (slots,) + tuple(d._cos_sin(pos))

    def _write_context(self, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Drafter layer i's keys/values [rows, G, E] into the context buffers at flat slots."""
        b = self.buf
        b.ctx_k[i].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        b.ctx_v[i].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def _draft(self, depth: int, bucket: int, n: int) -> torch.Tensor:
        """Draft logits [n, depth, V] for positions start+1..start+depth, blocks [bonus, mask x depth].

        The block's keys/values are written into the context buffers at its own slots start..start+depth (rows
        past the committed context, which commit's context extension overwrites), so attention reads one
        [bucket] range per request with keys < start + depth + 1 visible: the context plus the whole block,
        bidirectionally, as the reference's [context; block] concatenation. Grouped-query heads are served by
        viewing the query heads as [kv heads, group] (no repeat of the context to every query head)."""
        d, b = self.drafter, self.buf
        blk = depth + 1
        if blk > self._draft_ids.shape[1]:
            raise ValueError(f"draft depth {depth} exceeds the drafter's block ({self._draft_ids.shape[1]} positions)")
        ids = self._draft_ids[:n, :blk]                                                  # [bonus, mask x depth]
        ids[:, 0].copy_(b.bonus[:n])
        h = self.target.embed(ids).view(n * blk, -1).to(d.fc.weight.dtype)               # [n*B, D]
        if d.cfg.input_embedding_scale != 1.0:
            h = h * d.cfg.input_embedding_scale
        start = b.start[:n]
        slots, cos, sin = self._draft_rows(0, n, blk)
        layer_fn = self._draft_layer_torch if self._dqkv is None else self._draft_layer_cuda
        for i, layer in enumerate(d.layers):
            h = layer_fn(i, layer, h, cos, sin, slots, start, n, blk, bucket)
        return d.logits(self.ops.norm(d.norm, h).view(n, blk, -1)[:, 1:])

    def _draft_layer_cuda(self, i, layer, h, cos, sin, slots, start, n: int, blk: int, bucket: int):
        """Drafter layer i on the cuda backend: q|k|v one GEMM, then 3 launches (draft_ops), the residual adds
        inside the o_proj/down GEMMs (one rounding of h + o W^T where the reference rounds twice). Returns h."""
        b, at = self.buf, layer.self_attn
        he = at.heads * at.head_dim
        qkv = F.linear(self.ops.norm(layer.input_layernorm, h), self._dqkv[i])
        q = head_norm_rope(qkv[:, :he].view(n * blk, at.heads, at.head_dim), at.q_norm.weight, at.q_norm.eps,
                           cos, sin)
        write_keys_values(qkv[:, he:], self._dkw[i:i + 1], at.k_norm.eps, cos, sin, slots, b.ctx_k[i:i + 1],
                          b.ctx_v[i:i + 1])
        o = draft_attention(q.view(n, blk, at.heads, at.head_dim), b.ctx_k[i], b.ctx_v[i], start, blk, bucket,
                            at.head_dim ** -0.5)
        h = self._add_mm(h, o, at.o_proj.weight, True)          # h is this draft's own (the embedding output)
        gu = F.linear(self.ops.norm(layer.post_attention_layernorm, h), self._dgu[i])
        return self._add_mm(h, silu_mul(gu), layer.mlp.down_proj.weight, True)

    def _draft_layer_torch(self, i, layer, h, cos, sin, slots, start, n: int, blk: int, bucket: int):
        """Drafter layer i on the torch backend (the reference's steps) over the static context buffers: the
        block's keys/values written at its own slots, keys s >= start + blk masked. Returns h."""
        b, at = self.buf, layer.self_attn
        g, e = at.kv_heads, at.head_dim
        x = self.ops.norm(layer.input_layernorm, h)
        q = self.ops.norm(at.q_norm, at.q_proj(x).view(n * blk, at.heads, e))
        q = self.ops.rope(q, cos, sin, False).view(n, blk, g, at.heads // g, e)            # [n, B, G, rep, E]
        self._write_context(i, slots, *self._keys_values(at, x, cos, sin))
        k, v = b.ctx_k[i, :n, :bucket], b.ctx_v[i, :n, :bucket]                          # [n, bucket, G, E]
        keys = torch.arange(bucket, device=self.device)
        hidden = (keys[None, :] >= (start[:, None] + blk))[:, None, None, None, :]       # [n, 1, 1, 1, bucket]
        scores = torch.einsum("nbgre,nsge->ngrbs", q, k).to(torch.promote_types(q.dtype, torch.float32))
        scores = (scores * e ** -0.5).masked_fill(hidden, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        h = h + at.o_proj(torch.einsum("ngrbs,nsge->nbgre", p, v).reshape(n * blk, -1))
        return h + layer.mlp(self.ops.norm(layer.post_attention_layernorm, h))

    # ---- one round, as stages (all requests of the batch together) ----------------------------------------

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        temperature, top_p, top_k, gen = self._sampling
        if temperature == 0:
            return argmax_rows(logits) if self.backend == "cuda" else logits.argmax(-1)
        if self.backend == "torch":
            return sample(logits, temperature, top_p, top_k, gen)        # the reference's sampler, same RNG
        probs = sampling_probs(logits, temperature, top_p, top_k)        # on-device, graph-safe sampling
        u = torch.rand(probs.shape, device=probs.device, dtype=probs.dtype).clamp_min(1e-30)
        return (probs.log() - (-u.log()).log()).argmax(-1)              # Gumbel-max: a draw from probs

    def _stage_draft(self, r: _Round, key):
        n, mode, budget, depth, bucket = key
        if mode != "ar":
            r.logits_d = self._draft(depth, bucket, n)

    def _stage_tree(self, r: _Round, key):
        n, mode, budget, depth, bucket = key
        b, dev = self.buf, self.device
        if mode == "ar":
            r.ids = b.bonus[:n, None]
            r.depths, r.parents, r.bits = self._static(("ar", n), lambda: (
                torch.zeros(n, 1, dtype=torch.long, device=dev), torch.full((n, 1), -1, dtype=torch.long, device=dev),
                torch.ones(n, 4, 1, dtype=torch.int32, device=dev)))
            return
        trees = [chain_tree(r.logits_d[j]) if mode == "chain" else self.ops.build_tree(r.logits_d[j], budget)
                 for j in range(n)]
        t = trees[0].n + 1
        w = -(-t // 32)
        # the packed visibility: compile writes each request's t rows in place; the pad rows stay zero
        r.bits = self._static(("bits", n, t), lambda: torch.zeros(n, _pad4(t), w, dtype=torch.int32, device=dev))
        parts = [self.ops.compile(tree, b.bonus[j:j + 1], r.bits[j, :t]) for j, tree in enumerate(trees)]
        r.ids, r.depths, r.parents = (_stack([p[k] for p in parts]) for k in range(3))

    def _static(self, key, make: Callable):
        """A round's or a prefill chunk's constant tensors, made once per key (first in the eager warm-up, before
        any capture), so a graph replay launches nothing to fill them."""
        if key not in self._statics:
            self._statics[key] = make()
        return self._statics[key]

    def _stage_verify(self, r: _Round, key):
        n, mode = key[0], key[1]
        r.logits, r.feats = self._forward(r.ids, r.depths, r.bits, key[4], mode != "ar")
        t = r.ids.shape[1]
        r.choices = self._choose(r.logits.reshape(n * t, -1)).view(n, t)

    def _stage_commit(self, r: _Round, key):
        n, mode = key[0], key[1]
        b, dev = self.buf, self.device
        t = r.ids.shape[1]
        if mode == "ar":
            acc = torch.zeros(n, 1, dtype=torch.long, device=dev)
            length, bonus = torch.ones(n, dtype=torch.long, device=dev), r.choices[:, 0]
        else:
            outs = [self.ops.follow(r.ids[j], r.parents[j], r.choices[j]) for j in range(n)]
            acc = _stack([o[0] for o in outs])                                 # [n, T], -1 past the path
            length = _stack([o[1].reshape(()) for o in outs])                  # [n]
            bonus = _stack([o[2].reshape(()) for o in outs])
        r.accepted, r.bonus = acc, bonus
        m = min(t, key[3] + 1)                  # a path holds at most depth + 1 rows: move and extend only those
        start, base = b.start[:n], b.offs[:n, None] + b.start[:n, None]
        src = (base + acc[:, :m].clamp(min=0)).reshape(-1)                     # rows past length: junk
        dst = (base + b.arange[:m]).reshape(-1)
        flat = b.latent.view(b.latent.shape[0], -1, b.latent.shape[-1])       # [layers, R*cap, C+R]
        rows = flat.index_select(1, src)                                       # gather first ...
        flat.index_copy_(1, dst, rows)                                         # ... then write
        if mode != "ar":
            idx = acc[:, :m].clamp(min=0)[..., None].expand(-1, -1, r.feats.shape[-1])
            self._extend_context(r.feats.gather(1, idx))
        emitted = torch.cat([r.ids.gather(1, acc[:, 1:].clamp(min=0)), bonus[:, None]], 1)   # [n, T]
        b.out_tokens[:n, :t].copy_(emitted)
        b.out_tokens[:n].scatter_(1, (length - 1)[:, None], bonus[:, None])
        active = b.active[:n]
        b.out_length[:n].copy_(length)
        start.add_(length * active)
        b.bonus[:n].copy_(torch.where(active.bool(), bonus, b.bonus[:n]))

    STAGES = ("draft", "tree", "verify", "commit")

    def _stage_fns(self):
        return [self._stage_draft, self._stage_tree, self._stage_verify, self._stage_commit]

    # ---- running a round: eager, one graph, or one graph per stage ---------------------------------------

    def _run_round(self, key, timing: Optional[RoundTiming]) -> _Round:
        """Run one round; returns its _Round (under graphs: the captured one, whose tensors the replay wrote)."""
        if self.eager:
            r = _Round()
            if timing is None:
                for fn in self._stage_fns():
                    fn(r, key)
            else:
                self._timed([lambda fn=fn: fn(r, key) for fn in self._stage_fns()], timing)
            return r
        rec = self._graphs.get(key)
        if rec is None:
            rec = self._capture(key, per_stage=timing is not None)
        if timing is None:
            for g in rec.graphs:
                g.replay()
        else:
            self._timed([g.replay for g in rec.graphs], timing)
        return rec.rnd

    def _timed(self, calls, timing: RoundTiming):
        if len(calls) != len(self.STAGES):
            raise RuntimeError("stage timing needs the per-stage graphs (construct the Engine with "
                               "stage_timing=True)")
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)] \
            if self.device.type == "cuda" else None
        marks = [time.perf_counter()]
        for i, call in enumerate(calls):
            if ev:
                ev[i].record()
            call()
            if not ev:
                marks.append(time.perf_counter())
        if ev:
            ev[-1].record()
            ev[-1].synchronize()
            ms = [ev[i].elapsed_time(ev[i + 1]) for i in range(len(calls))]
        else:
            ms = [(marks[i + 1] - marks[i]) * 1e3 for i in range(len(calls))]
        for name, v in zip(self.STAGES, ms):
            setattr(timing, name, getattr(timing, name) + v)
        timing.rounds += 1

    def _capture(self, key, per_stage: bool) -> _Graphs:
        """The round `key` as one graph, or one per stage."""
        r = _Round()
        fns = self._stage_fns()
        groups = [[fn] for fn in fns] if per_stage else [fns]
        def warm():                                   # the stages hand each other one _Round
            w = _Round()
            for fn in fns:
                fn(w, key)
        graphs = self._capture_calls(f"the round {key} (requests, mode, budget, depth, bucket)",
                                     [[lambda fn=fn: fn(r, key) for fn in group] for group in groups], warm)
        rec = self._graphs[key] = _Graphs(graphs, r)
        return rec

    def _capture_calls(self, what: str, groups: list, warm: Callable) -> list:
        """Warm up (eagerly, on a side stream; harmless: writes land past the committed prefix; the scalar state
        is restored), then capture each group of calls as one graph. Raises GraphCaptureError with the cause;
        never falls back."""
        b = self.buf
        saved = (b.start.clone(), b.bonus.clone())
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side):
                warm()
                b.start.copy_(saved[0])
                b.bonus.copy_(saved[1])
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graphs = []
            for group in groups:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool):
                    for call in group:
                        call()
                graphs.append(g)
        except Exception as e:
            raise GraphCaptureError(f"CUDA graph capture of {what} failed: {type(e).__name__}: {e}. Run with "
                                    "eager=True to decode without graphs, and report this.") from e
        return graphs

    # ---- prefill -----------------------------------------------------------------------------------------

    def _bucket(self, length: int) -> int:
        return min(self.cap, max(MIN_BUCKET, 1 << (length - 1).bit_length()))

    @staticmethod
    def _prefill_rows(t: int) -> int:
        """Rows a prefill chunk of t prompt tokens runs as: the power of two >= t (at least 8, at most MAX_T - 1),
        so one graph per (request, rows, bucket) serves every prompt length."""
        return min(MAX_T - 1, max(8, 1 << (t - 1).bit_length()))

    def _prefill(self, prompt: torch.Tensor, r: int):
        """Request r: causal prefill in chunks of at most MAX_T - 1 prompt tokens, each run padded to
        `_prefill_rows` rows (a CUDA graph per shape unless eager). Pad rows come after the chunk's tokens, so
        no real row sees them; they write latent and drafter-context rows past the prompt, which the first round
        overwrites before anything reads them. Returns the last prompt row's logits [1, V]."""
        b = self.buf
        b.start[r] = 0
        n, chunk = prompt.numel(), MAX_T - 1
        logits = None
        for s in range(0, n, chunk):
            t = min(chunk, n - s)
            rows = self._prefill_rows(t)
            b.prefill_ids[:t].copy_(prompt[s:s + t])
            b.prefill_last.fill_(t - 1)
            key = ("prefill", r, rows, self._bucket(s + rows))
            if self.eager:
                logits = self._prefill_chunk(key)
            else:
                rec = self._graphs.get(key)
                if rec is None:
                    out = {}
                    graphs = self._capture_calls(
                        f"the prefill {key} (request, rows, bucket)",
                        [[lambda: out.__setitem__("logits", self._prefill_chunk(key))]],
                        warm=lambda: self._prefill_chunk(key))
                    rec = self._graphs[key] = _Graphs(graphs, out["logits"])
                rec.graphs[0].replay()
                logits = rec.rnd
            b.start[r] += t
        return logits[0]

    def _prefill_chunk(self, key):
        """The prefill forward of b.prefill_ids[:rows] for request r at its start: latent rows, drafter context,
        and the logits of row b.prefill_last [1, 1, V]."""
        _, r, rows, bucket = key
        b = self.buf
        bits = self._static(("causal", rows), lambda: pack_visibility(            # packed causal visibility
            torch.ones(rows, rows, dtype=torch.bool, device=self.device).tril())[None])  # [1, rows, W]
        logits, feats = self._forward(b.prefill_ids[None, :rows], b.arange[None, :rows], bits, bucket,
                                      self.drafter is not None, r0=r, logit_rows=b.prefill_last)
        if self.drafter is not None:
            self._extend_context(feats, r0=r)
        return logits

    # ---- generate ----------------------------------------------------------------------------------------

    def round_key(self, mode: str, budget: Optional[int], remaining: int, start: int, n: int = 1):
        """(requests, mode, budget, depth, bucket) and T for the next round. remaining: the most tokens any
        request of the batch may still emit (so one request alone gets the reference's tail block); start:
        the longest committed length among them."""
        vocab = self.cfg.vocab_size
        if mode == "ar":
            return (n, "ar", 0, 0, self._bucket(start + 1)), 1
        depth = min(self.drafter.block_size, remaining + 1) - 1
        if mode == "chain":
            t = depth + 1
            return (n, "chain", 0, depth, self._bucket(start + t)), t
        budget = self.drafter.block_size - 1 if budget is None else budget
        t = node_count(depth, min(budget, vocab), budget) + 1
        return (n, "ddtree", budget, depth, self._bucket(start + max(t, depth + 1))), t    # the draft block too

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 128, mode: str = "ddtree", budget=None,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
                 stop_token_ids=None, trace: bool = False, on_tokens: Optional[Callable] = None,
                 timing: Optional[RoundTiming] = None) -> GenerateOutput:
        """reference.generate's contract (same tokens under greedy decoding, same acceptance_lengths).
        budget: an int (DDTree nodes), None (block_size - 1) or "auto" (AutoBudget). trace: keep an
        EngineRoundTrace per round (out.trace; one host read per row list a round: for debugging, see
        optimized.debug)."""
        cb = (lambda r, new: on_tokens(new)) if on_tokens else None
        return self.generate_batch([prompt_ids], max_new_tokens, mode, budget, temperature, top_p, top_k, seed,
                                   stop_token_ids, trace, cb, timing)[0]

    @torch.no_grad()
    def generate_batch(self, prompts: Sequence, max_new_tokens: int = 128, mode: str = "ddtree", budget=None,
                       temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
                       stop_token_ids=None, trace: bool = False, on_tokens: Optional[Callable] = None,
                       timing: Optional[RoundTiming] = None) -> list:
        """Decode len(prompts) <= max_requests requests together: each round drafts, verifies (one target
        forward over every request's tree rows; attention per request over its own prefix) and commits all of
        them. Each request's greedy tokens equal its own generate(); a request that finishes stops committing
        while the others go on. on_tokens(r, new) streams request r's tokens. Returns a GenerateOutput each."""
        n = len(prompts)
        if not 1 <= n <= self.max_requests:
            raise ValueError(f"{n} prompts for an engine built with max_requests={self.max_requests}")
        auto = budget == "auto"
        if auto and mode != "ddtree":
            raise ValueError("budget='auto' applies to mode='ddtree'")
        if auto and n > 1:
            raise ValueError("budget='auto' times single-request rounds; use a fixed budget for a batch")
        checked = [_check_args(self.target, self.drafter, p, max_new_tokens, mode, None if auto else budget,
                               temperature, top_p, top_k, stop_token_ids) for p in prompts]
        stops = checked[0][1]
        if not auto and budget is not None and budget > MAX_BUDGET:
            raise ValueError(f"budget {budget} > {MAX_BUDGET}: the verify block holds at most {MAX_T} rows")
        for p, _ in checked:
            if p.numel() + max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt ({p.numel()}) + max_new_tokens ({max_new_tokens}) exceeds this engine's "
                                 f"max_seq_len {self.max_seq_len}; build the Engine with a larger max_seq_len")
        if timing is not None and not (self.eager or self.stage_timing):
            raise ValueError("per-stage timing needs Engine(..., stage_timing=True) (one graph per stage) or "
                             "eager=True")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        if self.backend == "cuda" and temperature > 0 and seed is not None:
            torch.cuda.manual_seed(seed)
        self._sampling = (temperature, top_p, top_k, gen)
        b = self.buf
        emitted, rounds, starts = [], [[] for _ in range(n)], []
        traces = [[] for _ in range(n)] if trace else None
        for r, (p, _) in enumerate(checked):
            first = int(self._choose(self._prefill(p, r))[0])
            b.bonus[r] = first
            emitted.append([first])
            starts.append(p.numel())
            if on_tokens:
                on_tokens(r, [first])
        done = [len(e) >= max_new_tokens or e[-1] in stops for e in emitted]
        wall0 = time.perf_counter()
        uploaded = None
        while not all(done):
            if done != uploaded:                      # the active mask changes only when a request finishes
                b.host_active[:n].copy_(torch.tensor([0 if d else 1 for d in done]))
                b.active[:n].copy_(b.host_active[:n], non_blocking=True)
                uploaded = list(done)
            remaining = max(max_new_tokens - len(e) for e, d in zip(emitted, done) if not d)
            chosen = self._agreed(self.auto_budget.choose()) if auto else budget
            key, t = self.round_key(mode, chosen, remaining, max(starts), n)
            fresh = not self.eager and key not in self._graphs
            r0 = time.perf_counter()
            rnd = self._run_round(key, timing)
            lengths, tokens = self._read_round(n, t)
            pending = [self._trace(rnd, j, t, starts[j], emitted[j][-1]) for j in range(n)] if trace else None
            if auto and not fresh:
                self.auto_budget.observe(chosen, lengths[0], time.perf_counter() - r0)
            for r in range(n):
                if done[r]:
                    continue
                starts[r] += lengths[r]
                new = tokens[r][:max_new_tokens - len(emitted[r])]
                for j, tok in enumerate(new):
                    if tok in stops:
                        new = new[:j + 1]
                        break
                emitted[r] += new
                rounds[r].append(len(new))
                if trace:
                    pending[r].emitted = new
                    traces[r].append(pending[r])
                done[r] = len(emitted[r]) >= max_new_tokens or emitted[r][-1] in stops
                if on_tokens:
                    on_tokens(r, new)
        if timing is not None:
            stages = sum(getattr(timing, s) for s in self.STAGES)
            timing.host += (time.perf_counter() - wall0) * 1e3 - stages
        return [GenerateOutput(tokens=e, acceptance_lengths=rd, trace=traces[j] if trace else None)
                for j, (e, rd) in enumerate(zip(emitted, rounds))]

    def _trace(self, rnd: _Round, j: int, t: int, start: int, root: int) -> EngineRoundTrace:
        """Request j's round from the round's tensors (host copies: trace runs are for debugging, not speed).
        The root row's id is the pending bonus token (in ar rounds the ids tensor aliases the bonus buffer,
        which commit has already advanced)."""
        ids = rnd.ids[j, :t].tolist()
        acc = [a for a in rnd.accepted[j, :t].tolist() if a >= 0]
        return EngineRoundTrace(start=start, ids=[root] + ids[1:], parents=rnd.parents[j, :t].tolist(),
                                depths=rnd.depths[j, :t].tolist(), target_choices=rnd.choices[j, :t].tolist(),
                                accepted=acc, bonus=int(rnd.bonus[j]), emitted=[])

    def _agreed(self, budget: int) -> int:
        """Under expert parallelism, the auto budget of the group's rank 0 (its own timings decide), broadcast so
        that every rank builds the same tree: one 8-byte collective per round. Alone: `budget` unchanged."""
        if self.group is None:
            return budget
        import torch.distributed as dist
        b = torch.tensor([budget], dtype=torch.long, device=self.device)
        dist.broadcast(b, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(b)

    def _read_round(self, n: int, t: int):
        """The one host sync of a round: per request its committed length and emitted tokens."""
        b = self.buf
        if self.device.type != "cuda":
            lengths = b.out_length[:n].tolist()
            return lengths, [b.out_tokens[r, :lengths[r]].tolist() for r in range(n)]
        staged = torch.cat([b.out_length[:n, None], b.out_tokens[:n, :t + 1]], 1)        # [n, t+2], contiguous
        host = b.host.view(-1)[:staged.numel()].view(n, t + 2)                          # contiguous pinned
        host.copy_(staged, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        lengths = host[:, 0].tolist()
        return lengths, [host[r, 1:lengths[r] + 1].tolist() for r in range(n)]

    @property
    def auto_budget(self) -> "AutoBudget":
        if getattr(self, "_auto", None) is None:
            self._auto = AutoBudget()
        return self._auto

    @property
    def graph_count(self) -> int:
        return len(self._graphs)
