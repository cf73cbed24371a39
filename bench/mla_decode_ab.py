"""A/B of the pair kernel's L2 prefetch (MLA_L2_AHEAD: key pairs prefetched ahead of the one being computed) in
one process, timed as the bench times (CUDA-graph replays over rotated input sets, > 2.5x L2), every variant
checked against float64 first; then a split sweep of decode (T = 1) for the fastest variant.

python bench/mla_decode_ab.py OUT_DIR     (repository root, GPU machine) -> OUT_DIR/mla_decode_ab.{json,md}, OUT_DIR/best_defines
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "conformance")]

import torch  # noqa: E402

import mla_cases as mc  # noqa: E402
from optimized import mla_attention as mla  # noqa: E402

H = 64
AHEAD = (0, 1, 2, 3)
SHAPES = ((1, 8192), (1, 32768), (1, 131072), (33, 8192), (33, 32768), (257, 8192))
SWEEP = ((1, 8192), (1, 32768), (1, 131072))


def rotated_calls(t: int, prefix: int, seed: int, defines: tuple, num_splits=None):
    probe = mc.make_case(t, H, prefix, seed=seed)
    cases = [probe] + [mc.make_case(t, H, prefix, seed=seed + i) for i in range(1, mc.rotation(mc.work(probe)[1]))]
    masks = [c.tree_mask for c in cases]
    return probe, [(lambda c=c, m=m: mla.tree_attention(c.q_lat, c.q_pe, c.latent, m, c.scale, defines=defines,
                                                        num_splits=num_splits)) for c, m in zip(cases, masks)]


def check(defines: tuple) -> None:
    """The policy on shapes whose splits hold 1, 2 and many pairs, odd tile counts included (raises)."""
    for t, p, splits in ((1, 32768, None), (1, 4000, 1), (9, 333, 1), (65, 4097, None), (33, 8191, 3)):
        case = mc.make_case(t, H, p, kind="chain" if t == 1 else "random", seed=t + p)
        out = mla.tree_attention(case.q_lat, case.q_pe, case.latent, case.tree_mask, case.scale, defines=defines,
                                 num_splits=splits)
        mc.check_policy(out, mc.reference_f64(case), mc.reference_bf16(case), f"{defines} T={t} P={p}")


def provenance() -> dict:
    import cupy
    commit = os.environ.get("DDTREE_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cupy=cupy.__version__, commit=commit,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, sweep = [], []
    for ahead in AHEAD:
        defines = (f"MLA_L2_AHEAD={ahead}",)
        check(defines)
        for t, p in SHAPES:
            probe, calls = rotated_calls(t, p, seed=t + p, defines=defines)
            sec = mc.time_graph(calls)
            flops, nbytes = mc.work(probe)
            pl = mla.plan_for(probe.q_lat, probe.q_pe, probe.latent)
            rows.append(dict(ahead=ahead, T=t, prefix=p, us=sec * 1e6, tflops=flops / sec / 1e12,
                             tbps=nbytes / sec / 1e12, floor_ratio=sec / mc.floor_seconds(flops, nbytes),
                             splits=pl.splits, sets=len(calls)))
            r = rows[-1]
            print(f"ahead={ahead} T={t:3d} P={p:6d}: {r['us']:8.1f} us  {r['tflops']:5.0f} TFLOP/s  "
                  f"{r['tbps']:.2f} TB/s  {r['floor_ratio']:.2f}x floor  ({pl.splits} splits)", flush=True)
    best = min(AHEAD, key=lambda a: sum(r["us"] for r in rows if r["ahead"] == a and r["T"] == 1))
    defines = (f"MLA_L2_AHEAD={best}",)
    for t, p in SWEEP:
        probe = mc.make_case(t, H, p, seed=t + p)
        chosen = mla.plan_for(probe.q_lat, probe.q_pe, probe.latent).splits
        for sp in sorted({33, 44, 66, 88, 103, 129, 132, 176, 256, chosen}):
            if sp > -(-(p + t) // 64):
                continue
            probe, calls = rotated_calls(t, p, seed=t + p, defines=defines, num_splits=sp)
            sec = mc.time_graph(calls)
            real = mla.plan_for(probe.q_lat, probe.q_pe, probe.latent, num_splits=sp).splits
            flops, nbytes = mc.work(probe)
            sweep.append(dict(ahead=best, T=t, prefix=p, splits=real, chosen=real == chosen, us=sec * 1e6,
                              floor_ratio=sec / mc.floor_seconds(flops, nbytes)))
            print(f"sweep ahead={best} T={t} P={p} splits={real}{'*' if real == chosen else ''}: {sec * 1e6:.1f} us",
                  flush=True)
    doc = dict(provenance=provenance(), rows=rows, sweep=sweep, best_ahead=best)
    tmp = out_dir / "mla_decode_ab.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out_dir / "mla_decode_ab.json")
    lines = [f"# MLA pair kernel: L2 prefetch A/B ({doc['provenance']['gpu']}, {doc['provenance']['commit'][:7]})", "",
             "us per call (x the floor), rotated inputs in one CUDA graph; AHEAD = key pairs prefetched ahead.", "",
             "| T | prefix | " + " | ".join(f"AHEAD={a}" for a in AHEAD) + " |",
             "| --- | --- | " + " | ".join("---" for _ in AHEAD) + " |"]
    for t, p in SHAPES:
        cells = [next(r for r in rows if r["ahead"] == a and r["T"] == t and r["prefix"] == p) for a in AHEAD]
        lines.append(f"| {t} | {p} | " + " | ".join(f"{c['us']:.1f} ({c['floor_ratio']:.2f}x)" for c in cells) + " |")
    lines += ["", f"Decode split sweep at AHEAD={best} (* = the plan's choice): " + "; ".join(
        f"T={r['T']} P={r['prefix']} {r['splits']}{'*' if r['chosen'] else ''}: {r['us']:.1f}" for r in sweep)]
    (out_dir / "mla_decode_ab.md").write_text("\n".join(lines) + "\n")
    (out_dir / "best_defines").write_text(",".join(defines))   # for MLA_BENCH_DEFINES (bench/mla_gpu_run.sh)
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mla_decode_ab"))
