"""Sweep of the wgmma kernel's split plans: every (splits, cluster size) without an empty split, timed over
rotated input sets in one CUDA graph (mla_cases.time_graph, as the bench), next to the plan's modeled cost.
Calibrates the split model (optimized/mla_attention.py, WG_*) and shows what clusters buy over the merge kernel.

    python bench/mla_split_sweep.py [out.json] [T:P ...]      (repository root, an H100/H200)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "conformance")]

import torch  # noqa: E402

import mla_cases as mc  # noqa: E402
from optimized import mla_attention as mla  # noqa: E402

SHAPES = [(1, 1024), (1, 8192), (1, 32768), (1, 131072), (9, 8192), (17, 4096), (33, 4096), (33, 8192),
          (65, 4096), (65, 8192), (129, 4096), (257, 8192)]


def combos(t: int, s: int, sm_count: int, max_blocks: int) -> list[tuple[int, int]]:
    """(splits, cluster) pairs the plan can take: splits = ceil(key tiles / tiles per split), cluster | splits."""
    kt, rt = -(-s // 64), -(-t * 64 // 64)
    out = set()
    for tps in range(1, kt + 1):
        sp = -(-kt // tps)
        if sp > mla.MAX_SPLITS or rt * sp > max_blocks:
            continue
        for cs in range(1, mla.MAX_CLUSTER + 1):
            if sp % cs == 0:
                out.add((sp, cs))
    return sorted(out)


def main(argv: list[str]) -> None:
    out_path = Path(argv[0]) if argv and argv[0].endswith(".json") else None
    shapes = [tuple(int(v) for v in a.split(":")) for a in argv[1 if out_path else 0:]] or SHAPES
    info = mla.device_info(0)
    print(f"{info['name']} sm={info['sm_count']} cluster_slots={info['cluster_slots']}")
    rows = []
    for t, p in shapes:
        probe = mc.make_case(t, 64, p, seed=5)
        cases = [probe] + [mc.make_case(t, 64, p, seed=5 + i) for i in range(1, mc.rotation(mc.work(probe)[1]))]
        masks = [c.tree_mask for c in cases]
        flops, nbytes = mc.work(probe)
        floor = mc.floor_seconds(flops, nbytes) * 1e6
        auto = mla.plan_for(probe.q_lat, probe.q_pe, probe.latent)
        s = p + t
        kt, rt = -(-s // 64), t
        cells = []
        for sp, cs in combos(t, s, info["sm_count"], 3 * info["sm_count"]):
            pl = mla.plan_for(probe.q_lat, probe.q_pe, probe.latent, num_splits=sp, cluster=cs)
            assert (pl.splits, pl.cluster) == (sp, cs), (pl, sp, cs)
            calls = [(lambda c=c, m=m, sp=sp, cs=cs: mla.tree_attention(c.q_lat, c.q_pe, c.latent, m, c.scale,
                                                                        num_splits=sp, cluster=cs))
                     for c, m in zip(cases, masks)]
            us = mc.time_graph(calls) * 1e6
            tps = -(-kt // sp)
            slots = info["cluster_slots"] or {}
            per_wave = min(info["sm_count"], slots.get(cs, info["sm_count"] // cs) * cs)
            waves = -(-(rt * sp) // per_wave)
            rows.append(dict(T=t, prefix=p, splits=sp, cluster=cs, groups=sp // cs, tiles_per_split=tps,
                             row_tiles=rt, waves=waves, us=us, floor_us=floor,
                             auto=(sp, cs) == (auto.splits, auto.cluster)))
            cells.append((us, sp, cs))
        cells.sort()
        best = cells[0]
        auto_us = next(u for u, sp, cs in cells if (sp, cs) == (auto.splits, auto.cluster))
        print(f"T={t} P={p} floor {floor:.1f} us | plan {auto.splits}/{auto.cluster}: {auto_us:.1f} us | best "
              f"{best[1]}/{best[2]}: {best[0]:.1f} us | " +
              " ".join(f"{sp}/{cs}:{u:.1f}" for u, sp, cs in sorted(cells, key=lambda x: (x[1], x[2]))))
        sys.stdout.flush()
    if out_path:
        out_path.write_text(json.dumps(dict(device=info["name"], cluster_slots=info["cluster_slots"], rows=rows),
                                       indent=1))


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    main(sys.argv[1:])
