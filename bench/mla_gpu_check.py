"""One-call GPU check of the MLA kernel: device, build (registers, local memory), a correctness table that
localizes errors (QK path vs PV path, rows, column blocks, splits), then a quick timing line.

python bench/mla_gpu_check.py   (run from the repository root; the conformance tests and the bench follow it)
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "conformance")]

import torch  # noqa: E402

import mla_cases as mc  # noqa: E402
from optimized import mla_attention as mla  # noqa: E402


def localize(out, ref):
    """Where the error sits: by row mod 16 (mma row layout), by 64-column block (PV warp), by token."""
    d = (out.double() - ref.double()).abs()
    scale = ref.abs().max().item()
    t, h, c = d.shape
    rows = d.reshape(t * h, c)
    by_r16 = [rows[i::16].max().item() / scale for i in range(16)]
    by_cb = [d[..., j:j + 64].max().item() / scale for j in range(0, c, 64)]
    by_t = d.amax(dim=(1, 2)) / scale
    return (f"    by row%16: {' '.join(f'{x:.1e}' for x in by_r16)}\n"
            f"    by 64-col block: {' '.join(f'{x:.1e}' for x in by_cb)}\n"
            f"    worst tokens: {by_t.topk(min(5, t)).indices.tolist()} first bad token: "
            f"{int((by_t > 0.05).nonzero()[0]) if (by_t > 0.05).any() else None}")


def main():
    t0 = time.time()
    info = mla.device_info(0)
    print(f"device {info}  (compile {time.time() - t0:.1f} s)")
    for k, v in mla.kernel_attributes(0).items():
        print(f"  {k}: {v}")
    cases = [  # (name, T, H, P, kind, kwargs)
        ("1 tile, no mask", 1, 64, 63, "chain", {}),
        ("decode P=1000 splits=1", 1, 64, 1000, "chain", dict(num_splits=1)),
        ("decode P=1000 auto", 1, 64, 1000, "chain", {}),
        ("tree T=9 P=100 splits=1", 9, 64, 100, "random", dict(num_splits=1)),
        ("tree T=65 P=4097 auto", 65, 64, 4097, "random", {}),
        ("tree T=200 H=8 P=10 splits=7", 200, 8, 10, "random", dict(num_splits=7)),
        ("w4 config T=9 P=333", 9, 64, 333, "random", dict(config="mla_mma_w4_m32_n32_s1")),
        ("mma w8 T=65 P=4097", 65, 64, 4097, "random", dict(config="mla_mma_w8_m64_n64_s2")),
        ("wgmma serial T=65 P=4097", 65, 64, 4097, "random", dict(config="mla_wgmma_m64_n64")),
        ("tree T=33 P=8000 splits=1", 33, 64, 8000, "random", dict(num_splits=1)),
        ("tree T=17 P=1150 splits=1 (19 tiles)", 17, 64, 1150, "random", dict(num_splits=1)),
        ("decode P=131072 auto", 1, 64, 131072, "chain", {}),
        ("tree T=1025 H=64 P=129", 1025, 64, 129, "random", {}),
        ("tree T=64 H=128 P=777", 64, 128, 777, "random", {}),
        ("tree T=5 H=1 P=0", 5, 1, 0, "chain", {}),
        ("generic C=16 R=8 T=7", 7, 4, 5, "random", dict(c=16, r=8)),
    ]
    failures = 0
    for name, t, h, p, kind, kw in cases:
        c, r = kw.pop("c", 512), kw.pop("r", 64)
        for uniform in (True, False):
            case = mc.make_case(t, h, p, c=c, r=r, kind=kind, seed=t + p)
            if uniform:      # q = 0: softmax is uniform over visible keys, so only the PV path and the mask count
                case.q_lat.zero_()
                case.q_pe.zero_()
            try:
                out = mla.tree_attention(case.q_lat, case.q_pe, case.latent, case.tree_mask, case.scale, **kw)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a diagnostic table reports every failure and goes on
                print(f"{name:32s} {'uniform' if uniform else 'random ':8s} RAISED {type(e).__name__}: {e}")
                failures += 1
                continue
            ref64, ref16 = mc.reference_f64(case), mc.reference_bf16(case)
            err, base = mc.errors(out, ref64), mc.errors(ref16, ref64)
            ok = torch.isfinite(out).all().item() and err["max"] <= 2 * base["max"] + 1e-6 \
                and err["fro"] <= 2 * base["fro"] + 1e-6
            failures += not ok
            kern = mla.plan_for(case.q_lat, case.q_pe, case.latent, config=kw.get("config"),
                                num_splits=kw.get("num_splits"))
            print(f"{name:32s} {'uniform' if uniform else 'random ':8s} {'ok ' if ok else 'BAD'} "
                  f"{kern.kernel}/{kern.splits} kernel max "
                  f"{err['max']:.2e} fro {err['fro']:.2e} | torch-bf16 max {base['max']:.2e} fro {base['fro']:.2e}")
            if not ok:
                print(localize(out.nan_to_num(1e3), ref64))
    variants = {  # name: (config, defines); config None = the plan's choice (wgmma on 9.0)
        "wgmma": (None, ()), "wgmma_plain": (None, ("MLA_SKIP_RESCALE=0", "MLA_FAST_EXP2=0")),
        "wgmma_serial": ("mla_wgmma_m64_n64", ()), "mma": ("mla_mma_w8_m64_n64_s2", ())}
    shapes = [(1, 8192), (1, 131072), (33, 8192), (33, 32768), (257, 8192)]
    cases = {sh: mc.make_case(sh[0], 64, sh[1], seed=sh[0]) for sh in shapes}
    score = {}
    print("variant A/B (us per call and TFLOP/s; policy checked on T=9 P=333 and T=65 P=4097):")
    for name, (cfg, defs) in variants.items():
        ok = True
        for ct, cp in ((9, 333), (65, 4097)):
            chk = mc.make_case(ct, 64, cp, seed=2)
            out = mla.tree_attention(chk.q_lat, chk.q_pe, chk.latent, chk.tree_mask, chk.scale, defines=defs,
                                     config=cfg)
            try:
                mc.check_policy(out, mc.reference_f64(chk), mc.reference_bf16(chk), name)
            except AssertionError as e:
                print(f"  {name}: {e}")
                ok, failures = False, failures + 1
        row = []
        for sh, case in cases.items():
            f = lambda c=case: mla.tree_attention(c.q_lat, c.q_pe, c.latent, c.tree_mask, c.scale,  # noqa
                                                  defines=defs, config=cfg)
            row.append(mc.time_graph([f]))
        score[name] = (sum(row), ok)
        kname = cfg or mla.plan_for(cases[shapes[0]].q_lat, cases[shapes[0]].q_pe, cases[shapes[0]].latent).kernel
        regs = mla.kernel_attributes(0, defs)[kname]
        print(f"  {name:14s} " + " ".join(
            f"T={sh[0]} P={sh[1]}: {x * 1e6:7.1f} ({mc.work(cases[sh])[0] / x / 1e12:3.0f})"
            for sh, x in zip(shapes, row)) + f"  {regs}  policy {'ok' if ok else 'BAD'}")
    best = min((k for k in score if score[k][1] and variants[k][0] is None), key=lambda k: score[k][0],
               default="wgmma")
    print(f"best variant of the default kernel: {best} {variants[best][1]}")
    Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mla_best_defines").write_text(",".join(variants[best][1]))
    print("split sweep (us; the plan's choice marked *):")
    defs = variants[best][1]
    for t, p in ((1, 8192), (1, 32768), (1, 131072), (9, 8192), (33, 8192), (65, 32768)):
        case = mc.make_case(t, 64, p, seed=3)
        chosen = mla.plan_for(case.q_lat, case.q_pe, case.latent).splits
        cells = []
        for sp in sorted({1, 2, 4, 8, 16, 33, 66, 132, 256, chosen}):
            if sp > -(-(p + t) // 64):
                continue
            f = lambda c=case, sp=sp: mla.tree_attention(c.q_lat, c.q_pe, c.latent, c.tree_mask, c.scale,  # noqa
                                                         defines=defs, num_splits=sp)
            real = mla.plan_for(case.q_lat, case.q_pe, case.latent, num_splits=sp).splits
            cells.append(f"{real}{'*' if sp == chosen else ''}:{mc.time_graph([f]) * 1e6:.1f}")
        print(f"  T={t} P={p}: " + " ".join(cells))
    print(f"check: {failures} failing rows")


if __name__ == "__main__":
    main()
