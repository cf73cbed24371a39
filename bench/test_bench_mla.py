"""Bench: tree-masked MLA attention (optimized.mla_attention) at K2.6 shapes against the floor and PyTorch.

H=64, C=512, R=64; prefix 1k/8k/32k/128k; T = 1, 9, 33, 65, 257 (random trees, parents[i] < i).
Time: CUDA-graph replays of the kernel over rotated input sets (> 2.5x L2), CUDA events, median.
Baselines: reference.target.absorbed_attention in bf16 (PyTorch masked einsum) and
scaled_dot_product_attention with a boolean mask (GQA: one latent K/V head), eager, events, median.
floor = max(flops / 787 TFLOP/s, bytes / 4.24 TB/s); bytes = latent once + q + out + mask.

Run: pytest -o addopts="" --import-mode=importlib bench/test_bench_mla.py --benchmark-only
Writes bench/results/mla_attention.{json,md,png} (or $MLA_BENCH_OUT/).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mla_cases as mc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PREFIXES = [1024, 8192, 32768, 131072]
TS = [1, 9, 33, 65, 257]
H = 64
OUT_DIR = Path(os.environ.get("MLA_BENCH_OUT", Path(__file__).parent / "results"))
DEFINES = tuple(d for d in os.environ.get("MLA_BENCH_DEFINES", "").split(",") if d)   # kernel variant


def _provenance() -> dict:
    import cupy
    commit = os.environ.get("MLA_COMMIT", "")        # the device copy of the tree has no git metadata
    if not commit:
        try:
            res = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).parent)
            commit = res.stdout.strip() if res.returncode == 0 else "unknown"
        except OSError:
            commit = "unknown"
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                cupy=cupy.__version__, commit=commit or "unknown", kernel_defines=list(DEFINES))


@pytest.fixture(scope="module")
def rows():
    collected: list[dict] = []
    yield collected
    if collected:
        _write(collected)


def _sdpa(case: mc.Case):
    c = case.q_lat.shape[-1]
    q = torch.cat([case.q_lat, case.q_pe], -1).transpose(0, 1).unsqueeze(0)       # [1, H, T, L]
    k = case.latent[None, None]                                                    # [1, 1, S, L]
    v = case.latent[None, None, :, :c]                                             # [1, 1, S, C]
    vis = case.visible
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=vis, scale=case.scale, enable_gqa=True)


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("t", TS)
def test_bench_mla(benchmark, rows, t, prefix):
    from optimized.mla_attention import plan_for
    ours, probe, graph_call = mc.time_rotated(t, H, prefix, seed=t + prefix, defines=DEFINES)
    flops, nbytes = mc.work(probe)
    n_sets = mc.rotation(nbytes)
    pl = plan_for(probe.q_lat, probe.q_pe, probe.latent)

    out = graph_call()
    ref = mc.reference_bf16(probe)
    err = mc.errors(out, ref)
    torch_s = mc.time_eager(lambda: mc.reference_bf16(probe))
    del ref
    try:
        sdpa_s = mc.time_eager(_sdpa(probe), reps=3)
        sdpa_note = ""
    except torch.OutOfMemoryError as e:           # recorded, not hidden
        sdpa_s, sdpa_note = None, f"OOM: {str(e)[:80]}"
    torch.cuda.empty_cache()

    floor = mc.floor_seconds(flops, nbytes)
    row = dict(T=t, prefix=prefix, H=H, kernel=pl.kernel, splits=pl.splits, rotated_sets=n_sets,
               time_us=ours * 1e6, tflops=flops / ours / 1e12, tbps=nbytes / ours / 1e12,
               floor_us=floor * 1e6, ratio_to_floor=ours / floor,
               bound="flops" if flops / (mc.PEAK_TFLOPS * 1e12) > nbytes / (mc.PEAK_TBPS * 1e12) else "bytes",
               torch_einsum_us=torch_s * 1e6, speedup_vs_einsum=torch_s / ours,
               sdpa_us=None if sdpa_s is None else sdpa_s * 1e6,
               speedup_vs_sdpa=None if sdpa_s is None else sdpa_s / ours, sdpa_note=sdpa_note,
               max_rel_diff_vs_torch_bf16=err["max"], flops=flops, bytes=nbytes)
    benchmark.extra_info.update(row)
    benchmark.extra_info.update(_provenance())
    rows.append(row)

    def one():
        graph_call()
        torch.cuda.synchronize()
    benchmark.pedantic(one, rounds=5, iterations=1, warmup_rounds=1)


def _write(rows: list[dict]) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    prov = _provenance()
    (OUT_DIR / "mla_attention.json").write_text(json.dumps(dict(provenance=prov, rows=rows), indent=1))
    lines = [f"# Tree-masked MLA attention, K2.6 shapes (H=64, C=512, R=64) on {prov['gpu']}",
             "", f"torch {prov['torch']}, CUDA {prov['cuda']}, cupy {prov['cupy']}, commit {prov['commit'][:12]}. "
             "Floor = max(flops / 787 TFLOP/s, bytes / 4.24 TB/s). PyTorch = reference absorbed_attention in bf16 "
             "(masked einsum) and SDPA with a bool mask. Kernel variant: "
             f"{', '.join(prov['kernel_defines']) or 'defaults'}.", "",
             "| T | prefix | splits | µs | TFLOP/s | TB/s | floor µs | × floor | einsum µs | × vs einsum | SDPA µs | × vs SDPA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sd = "n/a" if r["sdpa_us"] is None else f"{r['sdpa_us']:.0f}"
        sx = "n/a" if r["speedup_vs_sdpa"] is None else f"{r['speedup_vs_sdpa']:.1f}"
        lines.append(f"| {r['T']} | {r['prefix']} | {r['splits']} | {r['time_us']:.1f} | {r['tflops']:.0f} | "
                     f"{r['tbps']:.2f} | {r['floor_us']:.1f} | {r['ratio_to_floor']:.2f} ({r['bound']}) | "
                     f"{r['torch_einsum_us']:.0f} | {r['speedup_vs_einsum']:.1f} | {sd} | {sx} |")
    text = "\n".join(lines) + "\n"
    (OUT_DIR / "mla_attention.md").write_text(text)
    print("\n" + text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        for p in PREFIXES:
            sel = [r for r in rows if r["prefix"] == p]
            ax[0].plot([r["T"] for r in sel], [r["tflops"] for r in sel], "o-", label=f"prefix {p}")
            ax[1].plot([r["T"] for r in sel], [r["ratio_to_floor"] for r in sel], "o-", label=f"prefix {p}")
        ax[0].axhline(787, ls="--", c="k", lw=0.8)
        ax[0].axhline(400, ls=":", c="r", lw=0.8)
        for a, y in zip(ax, ("TFLOP/s", "time / floor")):
            a.set_xscale("log", base=2)
            a.set_xlabel("T (tree rows)")
            a.set_ylabel(y)
            a.legend()
        fig.suptitle(f"tree-masked MLA attention, H=64, {prov['gpu']}")
        fig.tight_layout()
        fig.savefig(OUT_DIR / "mla_attention.png", dpi=110)
    except ImportError:
        pass
