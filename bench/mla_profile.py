"""Per-kernel device time of tree_attention (attention kernel vs the split-KV merge) under torch.profiler
(CUPTI sees the CuPy launches too; the clocks are not pinned, unlike ncu). argv: config or 'auto', then
T:P pairs (default 1:8192 1:32768 1:131072 33:8192).

    python bench/mla_profile.py auto 1:8192 33:8192
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "conformance")]

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import mla_cases as mc  # noqa: E402
from optimized import mla_attention as mla  # noqa: E402


def main(argv: list[str]) -> None:
    config = None if not argv or argv[0] == "auto" else argv[0]
    shapes = [tuple(int(v) for v in a.split(":")) for a in argv[1:]] or [(1, 8192), (1, 32768), (1, 131072),
                                                                        (33, 8192)]
    reps = 20
    for t, p in shapes:
        case = mc.make_case(t, 64, p, seed=1)
        pl = mla.plan_for(case.q_lat, case.q_pe, case.latent, config=config)
        call = lambda: mla.tree_attention(case.q_lat, case.q_pe, case.latent, case.tree_mask,  # noqa: E731
                                          case.scale, config=config)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                call()
            torch.cuda.synchronize()
        per = defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.name.startswith("mla_"):
                per[ev.name] += ev.device_time / reps
        floor = mc.floor_seconds(*mc.work(case)) * 1e6
        cells = " ".join(f"{k}: {v:.1f} us" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
        print(f"T={t} P={p} {pl.kernel} splits={pl.splits} floor {floor:.1f} us | {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])
