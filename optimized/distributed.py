"""Expert parallelism over torch.distributed: a K2.6 target spread over the GPUs of one box (gloo on CPU in CI).

    torchrun --nproc-per-node 8 -m optimized generate --target DIR --drafter DIR --prompt "..."

    d = distributed.init()                                         # from torchrun's RANK, WORLD_SIZE, MASTER_*
    target = distributed.load_target_shard(path, d.rank, d.world, torch.bfloat16, d.device)
    drafter = optimized.load_drafter(drafter_path, target=target)
    with distributed.failure_guard():
        out = distributed.generate_distributed(target, drafter, prompt_ids, max_new_tokens=128, budget=32)

Legend: T rows of a forward (verify block or prefill chunk), D hidden size, E routed experts, W ranks.

What each rank holds. The routed experts are split into W contiguous blocks of ids (`expert_shard`: sizes differ
by at most one); a rank reads only its block from the safetensors files (`load_target_shard`: the other experts
stay on the meta device, no memory, no I/O; a shard file holding none of its tensors is never opened). Everything
else is replicated: embedding, MLA attention and its latent cache, dense layers, router, shared expert, lm_head,
the drafter and its context. For K2.6 (384 experts a layer, INT4) the experts are ~96% of the bytes, so each of
8 ranks holds 48 experts a layer (~70 GB) plus the replicated ~23 GB (bf16).

One collective per MoE layer. Every rank runs the same round (optimized.engine): it routes all T rows with the
replicated router, computes the partial sum over the experts it holds (zero for pairs routed elsewhere) and ends
the layer in one all-reduce of the partial sum, in fp32 on the cuda backend (T x D x 4 bytes a layer: 1 verify
row of K2.6 is 7168 x 4 = 28 KB, a budget-32 tree 33 x 28 KB = 0.9 MB; 60 MoE layers a round) and in the
working dtype on the torch backend. The shared expert is added after the reduction, once. Nothing else crosses
ranks during a round.

Why ranks stay in agreement. When an engine is built, one all-reduce checks that the ranks' experts cover every
expert exactly once. After each MoE all-reduce every rank holds the same hidden states (ring and tree
all-reduces hand every rank the one reduced value, bit for bit), so logits, the draft, the tree, the target's choices, acceptance and
commit are computed from identical inputs by identical code: the ranks take identical decisions with no further
communication. Two things could break this and are closed off: sampling draws from a generator seeded
identically on every rank (generate_distributed broadcasts rank 0's seed when none is given), and
budget="auto" follows rank 0's choice, broadcast every round (the engine's `_agreed`: one 8-byte collective). At the end every rank all-gathers a hash of
its tokens and acceptance lengths and raises DistributedError if any rank differs (one 8-byte collective).

Failures end the job, never hang it. `init` sets a timeout on every collective (gloo honours it per operation;
NCCL's watchdog aborts the communicator after it). A rank that raises inside `failure_guard` records its error
in the job's store and exits; its peers' pending collective fails at once (gloo: connection closed by peer) or
at the timeout, and the peers raise DistributedError naming the failed rank and its error. A rank stuck
outside a collective (hung I/O, a deadlock) makes its peers time out with DistributedError after timeout_s.
Under torchrun the agent then stops the remaining ranks and exits non-zero with the root-cause rank. The same
timeout bounds the rendezvous and the wait for the slowest rank's shard load: raise it (--dist-timeout) when a
shard load takes longer than the default 10 minutes.
"""
from __future__ import annotations

import datetime
import gc
import hashlib
import json
import os
import random
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from reference.checkpoint import (CheckpointError, _EXPERT, _IGNORED, _check, _meta_model, _module, _open,
                                  _shard_map, checkpoint_config, expected_tensors)
from reference.target import Target, rope_inv_freq

from .engine import Engine

__all__ = ["expert_shard", "load_target_shard", "ExpertShard", "init", "Dist", "shutdown", "failure_guard",
           "generate_distributed", "engine_for_rank", "check_agreement", "DistributedError", "DEFAULT_TIMEOUT_S",
           "is_torchrun"]

DEFAULT_TIMEOUT_S = 600.0
_TARGETS: "weakref.WeakSet" = weakref.WeakSet()  # targets whose cached rank engines hold the process group
_FAILED = "ddtree/failed/"                       # store key prefix: a rank's recorded error


class DistributedError(RuntimeError):
    """The job cannot go on: a rank failed, a collective timed out, or ranks disagree on the output."""


# ---- which experts a rank holds, and loading only those -------------------------------------------------------

def expert_shard(n_experts: int, rank: int, world: int) -> list[int]:
    """This rank's routed expert ids: W contiguous blocks in rank order, the first n_experts % W ranks one larger
    (sizes differ by at most one; 384 over 8 = 48 each; 8 over 3 = [0..2], [3..5], [6, 7]). A rank past
    n_experts holds none (it still runs the replicated parts and adds zeros to the reduction)."""
    if world < 1 or not 0 <= rank < world or n_experts < 0:
        raise ValueError(f"expert_shard: rank {rank} of world {world} over {n_experts} experts is not valid")
    base, extra = divmod(n_experts, world)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (rank < extra)))


@dataclass(frozen=True)
class ExpertShard:
    """What load_target_shard read (target.expert_shard): the held experts and the tensor names and files read."""
    rank: int
    world: int
    experts: tuple
    tensors_read: frozenset          # names as in the files (wrapper prefix included)
    files_opened: frozenset          # absolute paths


def load_target_shard(path: str, rank: int, world: int, dtype: torch.dtype = torch.bfloat16,
                      device="cpu") -> Target:
    """reference.load_target, reading only this rank's routed experts (expert_shard) and every non-expert tensor.
    The other ranks' experts stay on the meta device: the result runs through an Engine built with this shard's
    experts (generate_distributed), not through Target.forward. Names are checked against config.json as a
    whole (a checkpoint reference.load_target rejects is rejected here too); each tensor read is checked as the
    reference checks it. target.expert_shard (ExpertShard) records what was read."""
    cfg = checkpoint_config(path)
    held = expert_shard(cfg.n_routed_experts, rank, world)
    prefix, expected = cfg.tensor_prefix, expected_tensors(cfg)
    where = {name[len(prefix):] if name.startswith(prefix) else name: (name, file)
             for name, file in _shard_map(path).items() if not _IGNORED.search(name)}
    missing, unexpected = sorted(set(expected) - set(where)), sorted(set(where) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: tensors do not match config.json: missing {missing[:4]}, unexpected "
                              f"{[where[s][0] for s in unexpected[:4]]} (reference.load_target names each one)")
    keep = set(held)
    wanted = [s for s in expected if not (m := _EXPERT.match(s)) or int(m.group(2)) in keep]
    by_file: dict[str, list[str]] = {}
    for short in wanted:
        by_file.setdefault(where[short][1], []).append(short)
    model = _meta_model(cfg)
    state = {}
    for file, shorts in sorted(by_file.items()):
        with _open(file) as f:
            for short in shorts:
                state[short] = _read(f, file, where[short][0], short, expected[short], model, dtype).to(device)
    model.load_state_dict(state, strict=False, assign=True)     # the other ranks' experts stay on meta
    model.inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    model.expert_shard = ExpertShard(rank, world, tuple(held), frozenset(where[s][0] for s in wanted),
                                     frozenset(by_file))
    return model.eval()


def _read(f, file: str, name: str, short: str, shape_kind, model, dtype) -> torch.Tensor:
    """One tensor, checked and converted exactly as reference.load_target does."""
    try:
        t = f.get_tensor(name)
    except Exception as e:
        raise CheckpointError(f"{file}: tensor {name!r} cannot be read: truncated or corrupt file ({e})") from None
    shape, kind = shape_kind
    _check(file, name, t, shape, kind)
    if kind == "shape":
        want = list(_module(model, short).weight_packed.shape)
        got = t.tolist()
        if got[0] != want[0] or not want[1] * 8 - 8 < got[1] <= want[1] * 8:
            raise CheckpointError(f"{file}: tensor {name!r} = {got} does not match its weight_packed shape")
        return t.to(torch.int64)
    if kind == "float" and not short.endswith(("weight_scale", "e_score_correction_bias")):
        return t.to(dtype)
    return t


# ---- the process group --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device             # this rank's device: cuda:LOCAL_RANK under NCCL, cpu under gloo
    backend: str
    timeout_s: float


def is_torchrun() -> bool:
    """Launched by torchrun (or any launcher setting its variables) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(backend: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S, device=None) -> Dist:
    """Join the job described by torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
    backend: "nccl" when `device` is a CUDA device (default: CUDA when available), else "gloo". Every collective,
    and the rendezvous, times out after timeout_s (see the module docstring). Idempotent within a process."""
    need = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if need:
        raise RuntimeError(f"distributed.init: {', '.join(need)} not set; launch with torchrun --nproc-per-node N "
                           "(or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("distributed.init: backend nccl needs CUDA devices; on CPU use gloo (--device cpu)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        kw = dict(device_id=dev) if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
    elif dist.get_backend() != backend:
        raise RuntimeError(f"distributed.init: the process group is already initialised with {dist.get_backend()}")
    return Dist(rank, world, local, dev, backend, timeout_s)


def shutdown() -> None:
    """Drop the cached rank engines, then destroy the process group. The engines hold the group, and a gloo group
    still referenced at interpreter exit can abort the process ('terminate called without an active exception');
    an Engine kept by the caller (engine_for_rank) must be dropped before this."""
    for t in list(_TARGETS):
        t.__dict__.pop("_ddtree_rank_engines", None)
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def failure_guard():
    """Wrap a rank's work (load + generate). An error raised here is recorded in the job's store before it
    propagates; an error of a collective (a peer closed its connection, a timeout) becomes DistributedError naming
    a rank that recorded a failure (the lowest), or saying that a rank is stuck when none did."""
    try:
        yield
    except Exception as e:
        if not dist.is_initialized() or isinstance(e, DistributedError):
            raise
        me, world = dist.get_rank(), dist.get_world_size()
        store = _store()
        if _collective_error(e):
            others = [(r, _get(store, r)) for r in range(world) if r != me]
            failed = [(r, msg) for r, msg in others if msg is not None]
            if failed:
                r, msg = failed[0]
                raise DistributedError(f"rank {r} of {world} failed: {msg} (rank {me} stopped at a collective: "
                                       f"{_first_line(e)})") from e
            raise DistributedError(f"rank {me} of {world}: a collective failed with no error recorded by another rank "
                                   f"(a rank is stuck, or died without a trace): {_first_line(e)}") from e
        if store is not None:
            try:
                store.set(_FAILED + str(me), f"{type(e).__name__}: {_first_line(e)}")
            except Exception:
                pass                  # the store's host is gone: the peers still fail at their next collective
        raise


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def _get(store, rank: int) -> Optional[str]:
    try:
        key = _FAILED + str(rank)
        return store.get(key).decode() if store is not None and store.check([key]) else None
    except Exception:
        return None


def _collective_error(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(
        s in text for s in ("gloo", "Connection closed by peer", "Connection reset", "Timed out", "NCCL",
                            "timed out")))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:400]


# ---- generate on every rank ------------------------------------------------------------------------------------

def engine_for_rank(target: Target, drafter=None, *, group=None, experts=None, backend: str = "cuda",
                    eager: bool = False, max_seq_len: Optional[int] = None, stage_timing: bool = False) -> Engine:
    """The cached expert-parallel Engine of this rank. experts: default the shard load_target_shard read, else
    expert_shard(E, rank, world) (a full target on every rank). Checks once, with one all-reduce, that the ranks'
    experts cover every expert exactly once."""
    group = group if group is not None else dist.group.WORLD      # Engine(group=None) means one process
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shard = getattr(target, "expert_shard", None)
    if shard is not None and (shard.rank, shard.world) != (rank, world):
        raise ValueError(f"the target holds the experts of rank {shard.rank} of {shard.world}, but this is rank "
                         f"{rank} of {world}")
    if experts is None:
        experts = shard.experts if shard is not None else expert_shard(target.cfg.n_routed_experts, rank, world)
    experts = tuple(sorted(int(e) for e in experts))
    engines = target.__dict__.setdefault("_ddtree_rank_engines", {})
    key = (id(drafter), id(group), experts, backend, eager, max_seq_len, stage_timing)
    if key not in engines:
        count = torch.zeros(target.cfg.n_routed_experts, dtype=torch.int32, device=target.device)
        count[list(experts)] = 1
        dist.all_reduce(count, group=group)
        if not bool((count == 1).all()):
            bad = (count != 1).nonzero().flatten().tolist()[:8]
            raise DistributedError(f"the ranks' experts do not cover each expert exactly once (experts {bad} are "
                                   f"held by {[int(count[e]) for e in bad]} ranks)")
        engines[key] = Engine(target, drafter, backend=backend, eager=eager, max_seq_len=max_seq_len,
                              experts=experts, group=group, stage_timing=stage_timing)
        _TARGETS.add(target)
    return engines[key]


def generate_distributed(target: Target, drafter, prompt_ids, max_new_tokens: int = 128, mode: str = "ddtree",
                         budget=None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                         seed: Optional[int] = None, stop_token_ids=None, on_tokens=None, *, group=None,
                         experts=None, backend: str = "cuda", eager: bool = False,
                         max_seq_len: Optional[int] = None, timing=None):
    """optimized.generate's contract on every rank of `group` (default: the whole job); every rank returns the
    same EngineOutput, checked at the end (DistributedError when a rank differs)."""
    from . import EngineOutput
    if temperature > 0 and seed is None:               # every rank must draw the same samples
        s = torch.tensor([random.getrandbits(62)], dtype=torch.long, device=target.device)
        dist.broadcast(s, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        seed = int(s)
    engine = engine_for_rank(target, drafter, group=group, experts=experts, backend=backend, eager=eager,
                             max_seq_len=max_seq_len, stage_timing=timing is not None and not eager)
    out = engine.generate(prompt_ids, max_new_tokens=max_new_tokens, mode=mode, budget=budget,
                          temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop_token_ids=stop_token_ids, on_tokens=on_tokens, timing=timing)
    check_agreement(out.tokens, out.acceptance_lengths, group=group, device=target.device)
    return EngineOutput(tokens=out.tokens, acceptance_lengths=out.acceptance_lengths, trace=None,
                        backend=engine.backend, graphs=engine.graph_count)


def check_agreement(tokens, acceptance_lengths, group=None, device="cpu") -> None:
    """All-gather an 8-byte hash of (tokens, acceptance lengths); DistributedError on every rank if any differs."""
    digest = hashlib.sha256(json.dumps([list(tokens), list(acceptance_lengths)]).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)], dtype=torch.long, device=device)
    world = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    hashes = [int(h) for h in everyone]
    if len(set(hashes)) > 1:
        odd = [r for r, h in enumerate(hashes) if h != hashes[0]]
        raise DistributedError(f"ranks disagree on the generated tokens: ranks {odd} differ from rank 0 (a rank "
                               "computed different logits: check that every rank loaded the same checkpoint)")
