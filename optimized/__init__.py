"""ddtree optimized tier: the DDTree round on NVIDIA GPUs (Numba tree kernels, CuPy MLA and INT4 MoE kernels,
an engine that keeps the round on the device under CUDA graphs).

Public API (ARCHITECTURE.md), the reference's names and signatures plus engine options:
    target  = load_target(path)                      # bf16 on cuda by default; INT4 experts repacked once
    drafter = load_drafter(path, target=target)
    out     = generate(target, drafter, prompt_ids, max_new_tokens=N, mode="ddtree", budget=B)
    out.backend                                      # "cuda" (the kernels) or "torch" (reference ops)
Engine options of generate: backend ("cuda" | "torch"), eager, max_seq_len, timing (a RoundTiming to fill).
The Engine behind generate is built once per (target, drafter, options) and reused (static buffers, graphs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import reference
from reference.decode import GenerateOutput

from .engine import BACKENDS, Engine, GraphCaptureError, RoundTiming

__all__ = ["load_target", "load_drafter", "generate", "engine_for", "Engine", "EngineOutput", "GraphCaptureError",
           "RoundTiming", "BACKENDS"]


def load_target(path: str, dtype: torch.dtype = torch.bfloat16, device="cuda"):
    """reference.load_target with the engine's defaults (bf16 on the GPU). The INT4 experts are repacked for the
    kernels when the first engine over this target is built (once)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"load_target: device {device!r} asked for but this torch has no CUDA device "
                           f"(torch {torch.__version__}); on a CPU use device='cpu' with backend='torch'")
    return reference.load_target(path, dtype=dtype, device=device)


def load_drafter(path: str, target, dtype: Optional[torch.dtype] = None, device=None):
    return reference.load_drafter(path, target=target, dtype=dtype, device=device)


@dataclass
class EngineOutput(GenerateOutput):
    backend: str = ""                 # which backend ran: "cuda" or "torch"
    graphs: int = 0                   # CUDA graphs the engine holds after this call (0 when eager)


def engine_for(target, drafter=None, *, backend: Optional[str] = None, eager: bool = False,
               max_seq_len: Optional[int] = None, stage_timing: bool = False) -> Engine:
    """The cached Engine for (target, drafter, options); built on first use. backend defaults to "cuda"."""
    backend = backend or "cuda"
    engines = target.__dict__.setdefault("_ddtree_engines", {})
    key = (id(drafter), backend, eager, max_seq_len, stage_timing)
    if key not in engines:
        moe = None
        for (d, bk, *_), eng in engines.items():      # share the repacked experts between engines
            if bk == backend and eng.moe_weights is not None:
                moe = eng.moe_weights
                break
        engines[key] = Engine(target, drafter, backend=backend, eager=eager, max_seq_len=max_seq_len,
                              moe_weights=moe, stage_timing=stage_timing)
    return engines[key]


def generate(target, drafter, prompt_ids, max_new_tokens: int = 128, mode: str = "ddtree",
             budget: Optional[int] = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: Optional[int] = None, stop_token_ids=None, trace: bool = False, on_tokens=None, *,
             backend: Optional[str] = None, eager: bool = False, max_seq_len: Optional[int] = None,
             timing: Optional[RoundTiming] = None) -> EngineOutput:
    """reference.generate's signature and contract, run by the engine (see optimized.engine)."""
    engine = engine_for(target, drafter, backend=backend, eager=eager,
                        max_seq_len=max_seq_len, stage_timing=timing is not None and not eager)
    out = engine.generate(prompt_ids, max_new_tokens=max_new_tokens, mode=mode, budget=budget,
                          temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop_token_ids=stop_token_ids, trace=trace, on_tokens=on_tokens, timing=timing)
    return EngineOutput(tokens=out.tokens, acceptance_lengths=out.acceptance_lengths, trace=out.trace,
                        backend=engine.backend, graphs=engine.graph_count)
