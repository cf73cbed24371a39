"""Where a round's device time goes: every kernel of one captured stage graph (torch.profiler / CUPTI sees the
kernels a graph replay launches), summed by kernel and by family, against the stage's CUDA-event time (the
difference is launch gaps between the graph's kernels).

    python bench/engine_profile.py k26 4            # K2.6 widths, 4 target layers (1 dense + 3 MoE), prefix 4096
    python bench/engine_profile.py trained          # the trained pair (fixtures/trained), golden prompt 0
    ... --json FILE                                  # also write the rows

Prints, per (mode, budget, stage): the event time, the kernel sum, the gap, then the families and the top kernels.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

FAMILIES = [            # first match wins
    ("moe_int4", r"moe_int4|moe_gemm|moe_fused|moe_grouped"),
    ("router_gemm", r"moe_router_gemm|gemvx|sm80_xmma_gemm_f32f32"),     # the fp32 router GEMM (ours / cuBLAS)
    ("moe_route", r"moe_route|moe_group|route|topk_group"),
    ("mla", r"^mla_"),
    ("tree", r"topk_|beam|compile|follow|commit_"),
    ("norm_rope", r"rms_norm|rope"),
    ("gemm", r"gemm|gemv|cutlass|xmma|sm90_|sm80_|ampere|cublas|splitKreduce"),
    ("copy/index", r"index|gather|scatter|copy|cat|Cat|memcpy|memset|fill"),
    ("reduce/softmax", r"reduce|softmax|argmax|max|sum|topk|sort"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
]


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name):
            return fam
    return "other"


def profile_graph(graph, reps: int = 20):
    """(event ms per replay, {kernel: (ms per replay, launches per replay)})."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    event_ms = a.elapsed_time(b) / reps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time / 1e3 / reps
            per[ev.name][1] += 1
    return event_ms, {k: (v[0], v[1] / reps) for k, v in per.items()}


def report(tag: str, stage: str, event_ms: float, kernels: dict, rows: list, top: int = 12) -> None:
    ksum = sum(v[0] for v in kernels.values())
    launches = sum(v[1] for v in kernels.values())
    fam = defaultdict(lambda: [0.0, 0.0])
    for k, (ms, n) in kernels.items():
        fam[family(k)][0] += ms
        fam[family(k)][1] += n
    print(f"\n== {tag} {stage}: event {event_ms:.3f} ms, kernels {ksum:.3f} ms in {launches:.0f} launches, "
          f"gaps {event_ms - ksum:.3f} ms ({(event_ms - ksum) / max(launches, 1) * 1e3:.2f} us per launch)")
    for f, (ms, n) in sorted(fam.items(), key=lambda kv: -kv[1][0]):
        print(f"   {f:<15} {ms:8.3f} ms  {n:5.0f} launches")
    for k, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {ms * 1e3:9.1f} us  x{n:<4.0f} {k[:110]}")
    rows.append(dict(tag=tag, stage=stage, event_ms=event_ms, kernel_ms=ksum, launches=launches,
                     families={f: v for f, v in fam.items()},
                     kernels={k: v for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:40]}))


def engine_for(which: str, layers: int):
    from optimized.engine import Engine
    if which == "k26":
        from optimized.synthetic import k26_engine_parts
        target, drafter, moe = k26_engine_parts(layers, "cuda")
        return Engine(target, drafter, moe_weights=moe, max_seq_len=4096 + 256, stage_timing=True), 4096
    import optimized
    target = optimized.load_target(str(ROOT / "fixtures/trained/target"))
    drafter = optimized.load_drafter(str(ROOT / "fixtures/trained/drafter"), target=target)
    return Engine(target, drafter, stage_timing=True), 0


def main(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("which", choices=["k26", "trained"])
    ap.add_argument("layers", nargs="?", type=int, default=4)
    ap.add_argument("--configs", default="ar,chain,16,64")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from optimized.engine import RoundTiming
    from optimized.synthetic import distinct_experts
    eng, prefix = engine_for(args.which, args.layers)
    gen = torch.Generator().manual_seed(0)
    if prefix:
        prompt = torch.randint(0, eng.cfg.vocab_size - 8, (prefix,), generator=gen).tolist()
    else:
        prompt = json.loads((ROOT / "fixtures/trained/golden.json").read_text())["cases"][0]["prompt_ids"]
    rows: list = []
    for c in args.configs.split(","):
        mode, budget = (c, None) if c in ("ar", "chain") else ("ddtree", int(c))
        before = set(eng._graphs)
        eng.generate(prompt, max_new_tokens=4, mode=mode, budget=budget, timing=RoundTiming())
        keys = [k for k in eng._graphs if k not in before and k[0] != "prefill" and k[1] == mode]
        key = max(keys, key=lambda k: k[3])                # the full-depth round
        tag = f"{args.which} {mode}" + (f" {budget}" if budget else "") + f" key={key}"
        for i, stage in enumerate(eng.STAGES):
            if mode == "ar" and stage in ("draft", "tree"):
                continue
            ev, kern = profile_graph(eng._graphs[key].graphs[i])
            report(tag, stage, ev, kern, rows)
            if stage == "verify":
                verify = rows[-1]
        t = int(eng._graphs[key].rnd.ids.shape[1])
        distinct = distinct_experts(eng, prompt, mode, budget, t)
        moe_us = sum(ms for k, (ms, n) in verify["kernels"].items() if family(k) == "moe_int4") * 1e3
        per = moe_us / max(1, sum(distinct))
        print(f"   {t} rows: distinct experts per MoE layer {distinct}; MoE expert kernels {moe_us:.1f} us = "
              f"{per:.2f} us per distinct expert")
        verify.update(rows=t, distinct_experts=distinct)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                                   rows=rows), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
