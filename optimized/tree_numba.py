"""DDTree tree stages on the GPU (Numba CUDA): build_tree, compile_tree, follow_verified_tree, commit.

Same signatures as reference/tree.py (and the same node SET and ORDER, ties included; see its docstring);
tensors stay on the device. Kernels: optimized/kernels/tree_topk.py (per-depth top-K), tree_beam.py
(best-first selection, a depth per step), tree_list.py (best-first selection, a node per step, one warp: budgets
up to Config.list_max), tree_thresh.py (the set at or before a threshold, a level at a time: Config.beam =
"threshold", opt-in), tree_verify.py (compile, follow, commit).

    tree     = build_tree(draft_logits, budget)          # [L, V] on the GPU -> Tree on the GPU
    compiled = compile_tree(tree, root_token, start)     # CompiledTree + visibility_bits (packed, below)
    acc      = follow_verified_tree(compiled, choices)   # Accepted(indices, length, bonus) on the GPU
    feats    = commit(kv, start, acc, features)          # compacts kv [S, C] in place; features[acc]

Packed visibility (read by the tree-masked attention kernel): int32 [n+1, W], W = ceil((n+1)/32), holding
uint32 bit patterns: bit b of word w of row i is vis[i, 32*w + b] (j is i or an ancestor of i); bits past
column n are 0. The committed prefix (columns before `start` of the attention row) is always visible and is
not stored.

Limits: budget <= 1024, L <= 15, V < 2^31. No silent fallback: without a GPU (and without the simulator)
every entry point raises. Under NUMBA_ENABLE_CUDASIM=1 (set before numba is imported) the same kernels run in
the Numba simulator on CPU tensors; `backend()` says which one ran.
"""
from __future__ import annotations

from . import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

from dataclasses import dataclass
from typing import Optional, Union

import torch
from numba import cuda
from .kernels.tree_beam import BMAX, beam_for
from .kernels.tree_list import LIST_BMAX, MAX_DEPTH, auto_for, list_for
from .kernels.tree_segment import BIG_BMAX, beam_unless_for, segment_kernel_for
from .kernels.tree_shallow import SHALLOW_BMAX, shallow_for
from .kernels.tree_thresh import BMAX_THRESH, SCRATCH_ROWS, STATS, scratch_nodes, thresh_for
from .kernels.tree_device import SIM, WARP
from .kernels.tree_topk import (CAP, EPT, NB, PMAX, SORT_NA, TOPK_T, WAVE_BLOCKS, topk_filter,
                                topk_stats)
from .kernels.tree_verify import COMPILE_T, COMPILE_W, commit_kv, compile_rows, follow, gather_rows
from reference.tree import CompiledTree, Tree, check_build_args, node_count


@dataclass(frozen=True)
class Config:
    """Launch geometry. Block sizes: multiples of WARP, at most WARP*WARP, powers of two (reductions)."""
    topk_threads: int
    chunk: int             # fewest token ids per top-K block (raised so that all rows' blocks fit one wave,
                           #   a row has at most PMAX chunks, and a chunk is a multiple of topk_threads * EPT)
    beam_threads: int      # largest beam block (the beam runs min(this, budget rounded up to a power of two))
    follow_threads: int
    list_max: int = 0      # budgets up to this take the warp-list beam (tree_list.py) instead of tree_beam's,
                           #   those up to WARP by tree_list.auto_for (tree_beam's body on trees <= 2 deep);
                           #   0: never. DEFAULT_CONFIG: 32 (see LIST_DEFAULT)
    beam: str = "tree"     # budgets above list_max: "tree" (tree_beam.py, a depth per step) or "threshold"
                           #   (tree_thresh.py, the set at or before a threshold, enumerated a level at a time)
    shallow: bool = True   # budgets above list_max's warp and up to SHALLOW_BMAX first try the two-level selection
                           #   (tree_shallow.py: exact when the tree is at most 2 deep, decided on the device), then
                           #   up to SEGMENT_BMAX the segment selection (tree_segment.py: nodes at most 2 deviations
                           #   off the rank-0 chain); else the beam above runs. (Not in the one-warp auto beam of
                           #   budgets <= 32: there both were slower, tree_run20: 8.7 against tree_beam's 6.4 us on
                           #   one-deep trees, 27.9 against the list beam's 15.2 on draft-like L = 15.) Above
                           #   SHALLOW_BMAX up to BIG_BMAX: the segment selection in its own launch (a pool of up to
                           #   176 KB of shared memory), then tree_beam in a second one when it declined.


# The warp-list beam costs ~0.45 us a node whatever the depth; tree_beam ~5 us a depth (H100, tree_run11): the list
# wins on deep (draft-like) trees up to budget 64 and loses on shallow ones and from W = 2 rows (budget > 64). In
# the engine on the trained pair's real drafts its tree stage is faster at budgets 16 / 32 (0.044 / 0.054 ms
# against 0.049 / 0.058) and slower at 64 (0.071 against 0.067), hence 32. Budgets up to a warp go through
# tree_list.auto_for, which runs tree_beam's body instead when the tree is at most 2 deep (tree_run14: 6.4 against
# 12.2 us on normal rows at budget 16; tree_run15, H100: the default path at budget 16 49.1 -> 40.8 us at L = 7).
LIST_DEFAULT = 32
BEAMS = ("tree", "threshold")     # Config.beam's values
DEFAULT_CONFIG = (Config(16, 8, 16, 16, list_max=LIST_DEFAULT) if SIM
                  else Config(TOPK_T, 2048, 1024, 256, list_max=LIST_DEFAULT))


@dataclass(frozen=True)
class PackedCompiledTree(CompiledTree):
    visibility_bits: torch.Tensor = None   # int32 [n+1, ceil((n+1)/32)]: uint32 words, see module docstring


@dataclass(frozen=True)
class Accepted:
    """follow_verified_tree on the device: indices int64 [n+1] (accepted node indices from 0, then -1),
    length int64 [1], bonus int64 [1]."""
    indices: torch.Tensor
    length: torch.Tensor
    bonus: torch.Tensor

    def to_host(self) -> tuple[list[int], int]:
        """(accepted node indices, next bonus token), as reference.tree.follow_verified_tree returns them."""
        n = int(self.length.item())
        return self.indices[:n].tolist(), int(self.bonus.item())


def backend() -> str:
    """"cudasim" (Numba simulator, CPU tensors) or "cuda" (a real GPU, CUDA tensors)."""
    return "cudasim" if SIM else "cuda"


def _require(*tensors: torch.Tensor) -> None:
    if not SIM and not cuda.is_available():
        raise RuntimeError("optimized.tree_numba needs a CUDA GPU and numba found none. On a machine without "
                           "one, set NUMBA_ENABLE_CUDASIM=1 before numba is first imported to run these kernels "
                           "in the Numba CUDA simulator (CPU tensors, tiny shapes only).")
    for t in tensors:
        if SIM and t.is_cuda:
            raise ValueError("under the Numba simulator (NUMBA_ENABLE_CUDASIM=1) pass CPU tensors")
        if not SIM and not t.is_cuda:
            raise ValueError(f"pass CUDA tensors (got a tensor on {t.device}); move it with .cuda()")


def _arr(t: torch.Tensor):
    """Zero-copy Numba view of a contiguous tensor (a NumPy view under the simulator)."""
    if SIM:
        return t.numpy()
    return cuda.as_cuda_array(t, sync=False)   # no stream sync: launches are ordered on torch's stream


_streams: dict = {}


def _stream(device: torch.device):
    if SIM:
        return 0
    ptr = torch.cuda.current_stream(device).cuda_stream
    if ptr not in _streams:
        _streams[ptr] = cuda.default_stream() if ptr == 0 else cuda.external_stream(ptr)
    return _streams[ptr]


def _check_config(cfg: Config) -> Config:
    for t in (cfg.topk_threads, cfg.beam_threads, cfg.follow_threads):
        if t % WARP or t > WARP * WARP or t & (t - 1):
            raise ValueError(f"block size {t} must be a power of two, a multiple of {WARP}, <= {WARP * WARP}")
    if not SIM and cfg.topk_threads != TOPK_T:
        raise ValueError(f"topk_threads must be {TOPK_T} on the GPU (the top-K kernels are compiled for that block), "
                         f"got {cfg.topk_threads}")
    if isinstance(cfg.list_max, bool) or not isinstance(cfg.list_max, int) or not 0 <= cfg.list_max <= LIST_BMAX:
        raise ValueError(f"list_max must be an int in 0..{LIST_BMAX} (the warp-list beam's largest budget), "
                         f"got {cfg.list_max!r}")
    if cfg.beam not in BEAMS:
        raise ValueError(f"beam must be one of {BEAMS}, got {cfg.beam!r}")
    if not isinstance(cfg.shallow, bool):
        raise ValueError(f"shallow must be a bool, got {cfg.shallow!r}")
    if cfg.topk_threads * SORT_NA < BMAX:
        raise ValueError(f"topk_threads {cfg.topk_threads} < {BMAX // SORT_NA}: the top-K's whole-row sort "
                         f"holds {BMAX} keys in {SORT_NA} registers per thread")
    return cfg


class _Workspace:
    """Device scratch for one (device, L, V, K, config); reused across calls (and CUDA graph replays). The
    histograms and counters are zero on creation, and the kernels leave them zero."""

    def __init__(self, device, depth, vocab, k, budget, cfg: Config):
        step = cfg.topk_threads * EPT
        chunk = max(cfg.chunk, -(-vocab // PMAX))
        if not SIM:
            wave = WAVE_BLOCKS * torch.cuda.get_device_properties(device).multi_processor_count
            chunk = max(chunk, -(-vocab // max(1, wave // depth)))
        self.chunk = -(-chunk // step) * step
        self.parts = -(-vocab // self.chunk)
        z = dict(device=device)
        self.part_m = torch.empty(depth, self.parts, dtype=torch.float64, **z)
        self.part_s = torch.empty(depth, self.parts, dtype=torch.float64, **z)
        self.hist = torch.zeros(depth, NB, dtype=torch.int32, **z)
        self.counters = torch.zeros(depth, 2, dtype=torch.int32, **z)
        self.cand = torch.empty(depth, CAP, dtype=torch.int64, **z)
        self.top_lp = torch.empty(depth, k, dtype=torch.float32, **z)
        self.top_id = torch.empty(depth, k, dtype=torch.int64, **z)
        self.count = torch.zeros(1, dtype=torch.int64, **z)
        nodes = scratch_nodes(budget) if cfg.beam == "threshold" else 1     # the threshold beam's buffer
        self.thresh_ints = torch.empty(SCRATCH_ROWS, nodes, dtype=torch.int32, **z)
        self.thresh_stats = torch.zeros(STATS, dtype=torch.int32, **z)     # tree_thresh.STATS
        names = ("part_m", "part_s", "hist", "counters", "cand", "top_lp", "top_id", "count",
                 "thresh_ints", "thresh_stats")
        self.a = {name: _arr(getattr(self, name)) for name in names}


_workspaces: dict = {}


def _workspace(device, depth, vocab, k, budget, cfg) -> _Workspace:
    key = (str(device), depth, vocab, k, budget, cfg)
    if key not in _workspaces:
        if len(_workspaces) > 64:
            _workspaces.clear()
        _workspaces[key] = _Workspace(device, depth, vocab, k, budget, cfg)
    return _workspaces[key]


def _topk_stage(x, vocab: int, k: int, ws: _Workspace, cfg: Config, s) -> None:
    """Two launches: ws.top_lp / ws.top_id [L, K] = the per-depth candidates by rank."""
    a = ws.a
    grid, tpb = (ws.parts, a["hist"].shape[0]), cfg.topk_threads
    topk_stats[grid, tpb, s](x, vocab, ws.chunk, a["part_m"], a["part_s"], a["hist"])
    topk_filter[grid, tpb, s](x, vocab, ws.chunk, k, a["part_m"], a["part_s"], a["hist"], a["counters"], a["cand"],
                              a["top_lp"], a["top_id"])


def _beam_stage(k: int, budget: int, ws: _Workspace, cfg: Config, s, tokens, depths, parents, scores) -> None:
    """One launch (two above SHALLOW_BMAX): the first `budget` nodes in order into tokens/depths/parents/scores
    [budget]. Budgets up to cfg.list_max: the warp-list beam (one warp), up to a warp of them through
    tree_list.auto_for (one warp that takes tree_beam's body instead when the tree is at most 2 deep); else cfg.beam's
    (tree_beam or the threshold beam; when cfg.shallow, tree_beam behind the two-level and segment selections up to
    SHALLOW_BMAX / SEGMENT_BMAX, and above that up to BIG_BMAX behind the segment selection's own launch), in a block
    of the budget rounded up to a power of two (at least a warp), at most cfg.beam_threads threads."""
    a = ws.a
    out = (a["top_lp"], a["top_id"], k, budget, _arr(tokens), _arr(depths), _arr(parents), _arr(scores), a["count"])
    if budget > cfg.list_max and cfg.beam == "threshold":
        beam, threads = thresh_for(budget, cfg.beam_threads)
        beam[1, threads, s](*out, a["thresh_ints"], a["thresh_stats"])
        return
    smem = 0                                     # dynamic shared memory (the two-level and segment selections')
    if cfg.shallow and SHALLOW_BMAX < budget <= BIG_BMAX and budget > cfg.list_max:
        seg, seg_threads, seg_smem = segment_kernel_for(budget, cfg.beam_threads)
        _launch_big(seg, seg_threads, seg_smem, s, out)
        beam, threads = beam_unless_for(budget, cfg.beam_threads)
    elif budget <= min(cfg.list_max, WARP):
        beam, threads = auto_for(budget)
    elif budget <= cfg.list_max:
        beam, threads = list_for(budget)
    elif cfg.shallow and budget <= SHALLOW_BMAX:
        beam, threads, smem = shallow_for(budget, cfg.beam_threads)
    else:
        beam, threads = beam_for(budget, cfg.beam_threads)
    beam[1, threads, s, smem](*out)


_big_ready: dict = {}


def _launch_big(kernel, threads: int, smem: int, s, args) -> None:
    """Launch `kernel` with `smem` bytes of dynamic shared memory, above the 48 KB a kernel gets without asking:
    once per kernel and device, its specialization to these argument types (the launcher's are always the same:
    another set fails that dispatcher's type check) gets its limit raised to smem
    (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES; numba-cuda has no public call for it, so this goes through the
    driver binding numba-cuda itself uses for the shared-memory carveout). A refusal raises: no other beam runs in
    its place."""
    if SIM:
        kernel[1, threads, s, smem](*args)
        return
    dev = cuda.get_current_device().id
    key = (id(kernel), smem, dev)
    spec = _big_ready.get(key)
    if spec is None:
        spec = kernel.specialize(*args)
        try:
            from numba.cuda.cudadrv import driver as drv
            fn = next(iter(spec.overloads.values()))._codelibrary.get_cufunc()
            attr = drv.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            drv.driver.cuKernelSetAttribute(attr, smem, fn.handle, fn.device.id)
        except Exception as e:     # an API that moved, or a device with less shared memory a block
            raise RuntimeError(f"could not raise the segment kernel's dynamic shared-memory limit to {smem} bytes "
                               f"({type(e).__name__}: {e}); build trees of budget > {SHALLOW_BMAX} with "
                               "Config(shallow=False) (tree_beam alone) on this setup") from e
        _big_ready[key] = spec
    spec[1, threads, s, smem](*args)


def build_tree(draft_logits: torch.Tensor, budget: int, *, check_values: bool = False,
               config: Optional[Config] = None) -> Tree:
    """reference.tree.build_tree on the GPU. check_values also rejects NaN/+inf logits (a host sync)."""
    check_build_args(draft_logits, budget, values=check_values)
    _require(draft_logits)
    depth, vocab = draft_logits.shape
    device = draft_logits.device
    if budget == 0 or depth == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return Tree(empty, empty.clone(), empty.clone(), torch.zeros(0, dtype=torch.float64, device=device))
    if budget > BMAX:
        raise ValueError(f"budget {budget} > {BMAX}: the GPU tree build supports budgets up to {BMAX}"
                         + (" (the simulator build: up to 64)" if SIM else ""))
    if depth > MAX_DEPTH:
        raise ValueError(f"draft_logits has L = {depth} > {MAX_DEPTH} depths: the GPU tree build packs rank "
                         f"tuples of at most {MAX_DEPTH} digits")
    cfg = _check_config(config or DEFAULT_CONFIG)
    if cfg.beam == "threshold" and cfg.list_max < budget and budget > BMAX_THRESH:
        raise ValueError(f"budget {budget} > {BMAX_THRESH}: the threshold beam (Config.beam) takes budgets up to "
                         f"{BMAX_THRESH}; use beam='tree' above that")
    k = min(budget, vocab)
    n = node_count(depth, k, budget)
    ws = _workspace(device, depth, vocab, k, budget, cfg)
    x = _arr(draft_logits.float().contiguous())
    s = _stream(device)
    _topk_stage(x, vocab, k, ws, cfg, s)
    tokens = torch.empty(budget, dtype=torch.long, device=device)
    depths = torch.empty(budget, dtype=torch.long, device=device)
    parents = torch.empty(budget, dtype=torch.long, device=device)
    scores = torch.empty(budget, dtype=torch.float64, device=device)
    _beam_stage(k, budget, ws, cfg, s, tokens, depths, parents, scores)
    if check_values and int(ws.count.item()) != n:
        raise RuntimeError(f"GPU tree build produced {int(ws.count.item())} nodes, expected {n}")
    return Tree(tokens=tokens[:n], depths=depths[:n], parents=parents[:n], scores=scores[:n])


def compile_tree(tree: Tree, root_token: Union[int, torch.Tensor], start: int, *,
                 bits_out: Optional[torch.Tensor] = None) -> PackedCompiledTree:
    """reference.tree.compile_tree on the GPU, plus the packed visibility. root_token: int or a 1-element
    device tensor (no host sync). bits_out: an int32 [n+1, W] contiguous tensor on the device that receives the
    packed visibility (returned as visibility_bits), e.g. rows of a static buffer; default: a new one."""
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")
    _require(tree.tokens)
    n = tree.n
    device = tree.tokens.device
    rows, words = n + 1, (n + 32) // 32
    if bits_out is not None and (bits_out.dtype != torch.int32 or tuple(bits_out.shape) != (rows, words)
                                 or not bits_out.is_contiguous() or bits_out.device != device):
        raise ValueError(f"bits_out must be a contiguous int32 [{rows}, {words}] tensor on {device}, got "
                         f"{bits_out.dtype} {tuple(bits_out.shape)} on {bits_out.device}")
    if isinstance(root_token, torch.Tensor):      # a device tensor: read by the kernel (no host sync)
        root, root_val = root_token.reshape(1).to(device=device, dtype=torch.long), -1
    else:
        root_val = int(root_token)
        if root_val < 0:
            raise ValueError(f"root_token must be a non-negative token id, got {root_val}")
        root = tree.tokens   # unused (any int64 array)
    ids = torch.empty(rows, dtype=torch.long, device=device)
    positions = torch.empty(rows, dtype=torch.long, device=device)
    parents = torch.empty(rows, dtype=torch.long, device=device)
    depths = torch.empty(rows, dtype=torch.long, device=device)
    vis = torch.empty(rows, rows, dtype=torch.bool, device=device)
    bits = torch.empty(rows, words, dtype=torch.int32, device=device) if bits_out is None else bits_out
    blocks = -(-rows * words // COMPILE_W)
    compile_rows[blocks, COMPILE_T, _stream(device)](
        _arr(tree.tokens.long().contiguous()), _arr(tree.depths.long().contiguous()),
        _arr(tree.parents.long().contiguous()), _arr(root), root_val, start, _arr(ids), _arr(positions), _arr(parents),
        _arr(depths), _arr(vis), _arr(bits))
    return PackedCompiledTree(ids=ids, positions=positions, parents=parents, depths=depths, visibility=vis,
                              start=start, visibility_bits=bits)


def follow_verified_tree(compiled: CompiledTree, target_choices: torch.Tensor, *,
                         config: Optional[Config] = None) -> Accepted:
    """The acceptance walk on the device (reference.tree.follow_verified_tree); no host sync."""
    rows = compiled.ids.shape[0]
    if target_choices.shape != (rows,):
        raise ValueError(f"target_choices must have shape ({rows},) (one per tree row), "
                         f"got {tuple(target_choices.shape)}")
    _require(compiled.ids, target_choices)
    cfg = _check_config(config or DEFAULT_CONFIG)
    device = compiled.ids.device
    acc = torch.empty(rows, dtype=torch.long, device=device)
    length = torch.empty(1, dtype=torch.long, device=device)
    bonus = torch.empty(1, dtype=torch.long, device=device)
    follow[1, cfg.follow_threads, _stream(device)](
        _arr(compiled.ids.contiguous()), _arr(compiled.parents.contiguous()),
        _arr(target_choices.long().contiguous()), _arr(acc), _arr(length), _arr(bonus))
    return Accepted(indices=acc, length=length, bonus=bonus)


_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _words(t: torch.Tensor) -> torch.Tensor:
    """Same bytes as an integer tensor (Numba has no bf16/fp8 arrays; the copy moves bits)."""
    return t.view(_WORD[t.element_size()])


def commit(kv: torch.Tensor, start: int, accepted: Accepted, features: torch.Tensor) -> torch.Tensor:
    """Move rows start + accepted[j] of the latent cache kv [S, C] to start + j (in place, sources read
    before any overwrite) and return features[accepted] as [n+1, F] (rows >= length zeroed)."""
    if kv.dim() != 2 or not kv.is_contiguous():
        raise ValueError(f"kv must be a contiguous [S, C] cache, got shape {tuple(kv.shape)}")
    rows = accepted.indices.shape[0]
    if features.dim() != 2 or features.shape[0] != rows:
        raise ValueError(f"features must be [{rows}, F] (one row per tree row), got {tuple(features.shape)}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start + rows > kv.shape[0]:
        raise ValueError(f"start {start!r} + {rows} tree rows does not fit the cache of {kv.shape[0]} rows")
    _require(kv, features, accepted.indices)
    device = kv.device
    s = _stream(device)
    kw = _words(kv)
    commit_kv[-(-kw.shape[1] // 128), 128, s](_arr(kw), start, _arr(accepted.indices), _arr(accepted.length))
    src = _words(features.contiguous())
    out = torch.empty_like(src)
    gather_rows[-(-out.numel() // 128), 128, s](_arr(src), _arr(accepted.indices), _arr(accepted.length),
                                               _arr(out))
    return out.view(features.dtype)
