"""Expert-parallel K2.6 bench (issues 9 and 10): run under torchrun, one process per GPU.

    torchrun --nproc-per-node 8 bench/ep_bench.py --layers 61 --out DIR        # the full-size run (8x H200)
    torchrun --nproc-per-node 2 bench/ep_bench.py --comm-only --out DIR        # the collective alone (CPU: gloo)

Each rank builds a K2.6-width target with random INT4 weights (optimized.synthetic.k26_engine_parts): the
replicated parts (embedding, MLA, dense layer, shared experts, router, lm_head, drafter) and its contiguous
block of the 384 routed experts (optimized.distributed.expert_shard), then decodes a random prefix of
--prefix tokens with the expert-parallel engine (one all-reduce per MoE layer), per-stage timing from one CUDA
graph per stage, for ar and ddtree budgets 4..64.

Communication is measured separately: the same all-reduce the engine issues (fp32 [T, hidden], T = the verify
rows) timed alone with CUDA events (or wall time on CPU), times the MoE layer count, so `verify - comm` is the
compute part of the verify.

Derived throughput: tokens/s = tau / round time, with tau measured on the trained pair at the same budget
(bench/results/engine_trained.json) and, separately, the published Kimi-K2.5-DFlash tau = 5.3. The
autoregressive step is compared with its bandwidth floor as the issue defines it: the bytes one token must read
(every non-expert weight once + 8 experts per MoE layer, ~33 GB for K2.6: `ar_floor_bytes`) over world x 4.24
TB/s (replicated weights are in fact read by every rank, so this floor is optimistic for a replicated layout).

Rank 0 writes ep_<world>x.json and .md under --out (with provenance).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(__file__))

BW = 4.24e12
TAU_K25 = 5.3
BUDGETS = (4, 8, 16, 32, 64)


def time_allreduce(rows: int, hidden: int, device, reps: int = 50) -> float:
    """Seconds for one all-reduce of fp32 [rows, hidden]: median of reps after warm-up (CUDA events on a GPU,
    bench/conftest.cuda_time; wall time on CPU)."""
    x = torch.randn(rows, hidden, device=device)
    if device.type == "cuda":
        from conftest import cuda_time
        return cuda_time(lambda: dist.all_reduce(x), warmup=5, reps=reps)
    for _ in range(5):
        dist.all_reduce(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def trained_taus() -> dict:
    path = os.path.join(ROOT, "bench", "results", "engine_trained.json")
    if not os.path.exists(path):
        return {}
    rows = json.load(open(path))["results"]
    return {r["budget"] if r["mode"] == "ddtree" else r["mode"]: r["tau"] for r in rows}


def ar_floor_bytes(target) -> float:
    """Bytes one autoregressive token must read (the issue's ~33 GB for K2.6): every non-expert weight once
    (the embedding only its row), the router in fp32, and 8 routed experts per MoE layer."""
    from optimized.synthetic import _weight_bytes
    cfg = target.cfg
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * (0.5 + 2 / cfg.quantization_config.group_size)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    emb = target.model.embed_tokens.weight
    return (_weight_bytes(target) - emb.numel() * emb.element_size()
            + moe_layers * (cfg.num_experts_per_tok * expert + cfg.n_routed_experts * cfg.hidden_size * 4))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--comm-only", action="store_true", help="time the per-layer all-reduce only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from optimized import distributed
    from optimized.synthetic import k26_configs
    d = distributed.init()
    cfg, _ = k26_configs(args.layers)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    rows_of = {"ar": 1, **{b: b + 1 for b in BUDGETS}}
    comm = {str(k): time_allreduce(t, cfg.hidden_size, d.device) * moe_layers * 1e3 for k, t in rows_of.items()}
    result = dict(world=d.world, backend=d.backend, layers=args.layers, moe_layers=moe_layers, prefix=args.prefix,
                  comm_ms_per_round=comm,
                  comm_bytes_per_layer={str(k): t * cfg.hidden_size * 4 for k, t in rows_of.items()})
    if not args.comm_only:
        if d.device.type != "cuda":
            raise SystemExit("the engine part needs GPUs (NCCL); on CPU run with --comm-only")
        result["configs"] = run_engine(args, d, cfg, comm)
    if d.rank == 0 and args.out:
        write(args.out, result)
    distributed.shutdown()
    return 0


def run_engine(args, d, cfg, comm) -> list:
    from optimized.distributed import expert_shard
    from optimized.engine import Engine, RoundTiming
    from optimized.synthetic import k26_engine_parts
    experts = expert_shard(cfg.n_routed_experts, d.rank, d.world)
    target, drafter, moe = k26_engine_parts(args.layers, d.device, experts=experts)
    eng = Engine(target, drafter, moe_weights=moe, experts=experts, group=dist.group.WORLD,
                 max_seq_len=args.prefix + 256, stage_timing=True)
    prompt = torch.randint(0, cfg.vocab_size - 8, (args.prefix,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    taus = trained_taus()
    floor_ms = ar_floor_bytes(target) / (d.world * BW) * 1e3          # the reads spread over the ranks
    rows = []
    for mode, budget in [("ar", None)] + [("ddtree", b) for b in BUDGETS]:
        eng.generate(prompt, max_new_tokens=args.rounds + 1, mode=mode, budget=budget, timing=RoundTiming())
        timing = RoundTiming()
        eng.generate(prompt, max_new_tokens=args.rounds + 1, mode=mode, budget=budget, timing=timing)
        per = timing.per_round()
        round_ms = sum(per[k] for k in ("draft", "tree", "verify", "commit"))
        key = "ar" if mode == "ar" else budget
        row = dict(mode=mode, budget=budget, stage_ms=per, round_ms=round_ms, comm_ms=comm[str(key)],
                   verify_compute_ms=per["verify"] - comm[str(key)])
        if mode == "ar":
            row["tokens_per_s"] = 1e3 / round_ms
            row["ar_floor_ms"] = floor_ms
            row["ar_over_floor"] = round_ms / floor_ms
        else:
            if budget in taus:
                row["tokens_per_s_trained_tau"] = taus[budget] * 1e3 / round_ms
                row["trained_tau"] = taus[budget]
            row["tokens_per_s_tau_5.3"] = TAU_K25 * 1e3 / round_ms
        rows.append(row)
    return rows


def write(out: str, result: dict) -> None:
    from conftest import provenance_info
    os.makedirs(out, exist_ok=True)
    result["provenance"] = provenance_info()
    name = f"ep_{result['world']}x"
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Expert parallel, {result['world']} ranks ({result['backend']}), {result['layers']} layers, "
             f"prefix {result['prefix']}", "",
             "All-reduce per round (fp32 [T, hidden] once per MoE layer), ms: " +
             ", ".join(f"{k}: {v:.3f}" for k, v in result["comm_ms_per_round"].items())]
    for r in result.get("configs", []):
        s = r["stage_ms"]
        lines.append(f"- {r['mode']} {r['budget'] or ''}: round {r['round_ms']:.2f} ms (draft {s['draft']:.2f}, "
                     f"tree {s['tree']:.2f}, verify {s['verify']:.2f} of which comm {r['comm_ms']:.2f}, commit "
                     f"{s['commit']:.2f})" +
                     (f"; {r['tokens_per_s']:.0f} tokens/s, {r['ar_over_floor']:.2f}x the AR floor" if "ar_floor_ms" in r
                      else f"; {r['tokens_per_s_tau_5.3']:.0f} tokens/s at tau 5.3" +
                      (f", {r['tokens_per_s_trained_tau']:.0f} at the trained pair's tau {r['trained_tau']:.2f}"
                       if "trained_tau" in r else "")))
    open(os.path.join(out, name + ".md"), "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
