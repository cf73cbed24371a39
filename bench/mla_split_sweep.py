"""Sweep of the tensor-core kernel's split plans: every split count without an empty split, timed over rotated
input sets in one CUDA graph (mla_cases.time_graph, as the bench), against the plan's choice (_choose_splits).

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


def split_counts(t: int, s: int, max_blocks: int) -> list[int]:
    """Split counts the plan can take: ceil(key tiles / tiles per split), at most max_blocks blocks."""
    kt = -(-s // 64)
    return sorted({-(-kt // tps) for tps in range(1, kt + 1)
                   if -(-kt // tps) <= mla.MAX_SPLITS and t * -(-kt // tps) <= max_blocks})


def main(argv: list[str]) -> None:
    out_path = Path(argv[0]) if argv and argv[0].endswith(".json") else None
    shapes = [tuple(int(v) for v in a.split(":")) for a in argv[1 if out_path else 0:]] or SHAPES
    info = mla.device_info(0)
    print(f"{info['name']} sm={info['sm_count']}")
    rows = []
    for t, p in shapes:
        probe = mc.make_case(t, 64, p, seed=5)
        cases = [probe] + [mc.make_case(t, 64, p, seed=5 + i) for i in range(1, mc.rotation(mc.work(probe)[1]))]
        masks = [c.tree_mask for c in cases]
        flops, nbytes = mc.work(probe)
        floor = mc.floor_seconds(flops, nbytes) * 1e6
        auto = mla.plan_for(probe.q_lat, probe.q_pe, probe.latent)
        cells = []
        for sp in split_counts(t, p + t, 3 * info["sm_count"]):
            assert mla.plan_for(probe.q_lat, probe.q_pe, probe.latent, num_splits=sp).splits == sp
            calls = [(lambda c=c, m=m, sp=sp: mla.tree_attention(c.q_lat, c.q_pe, c.latent, m, c.scale,
                                                                 num_splits=sp))
                     for c, m in zip(cases, masks)]
            us = mc.time_graph(calls) * 1e6
            rows.append(dict(T=t, prefix=p, splits=sp, us=us, floor_us=floor, auto=sp == auto.splits))
            cells.append((us, sp))
        best = min(cells)
        auto_us = next(u for u, sp in cells if sp == auto.splits)
        print(f"T={t} P={p} floor {floor:.1f} us | plan {auto.splits}: {auto_us:.1f} us | best {best[1]}: "
              f"{best[0]:.1f} us | " + " ".join(f"{sp}:{u:.1f}" for u, sp in sorted(cells, key=lambda x: x[1])))
        sys.stdout.flush()
    if out_path:
        out_path.write_text(json.dumps(dict(device=info["name"], rows=rows),
                                       indent=1))


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    main(sys.argv[1:])
