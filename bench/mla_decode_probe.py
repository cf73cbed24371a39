"""Where decode's (T = 1) time goes, at the plan's split counts: the pair kernel as served against the same kernel
with its K refills after the first pair skipped (-DMLA_PAIR_NOLOAD=1: wrong results, the schedule and the fixed
per-block work alone), and against a single split (one block streams every key), timed as the bench times (rotated
inputs in one CUDA graph). If NOLOAD is close to the served time, the loads are not what decode waits for.
Also the split merge alone (mla_combine on fp32 partials of the served split count, rotated over 4 sets: read from
HBM, where the served merge finds them in L2) and the same launch with zero splits (it writes zeros: an upper
bound on one graph node, as each replay's own overhead is spread over 4 launches only).

python bench/mla_decode_probe.py [OUT.json]      (repository root, an sm_90 GPU)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "conformance")]

import torch  # noqa: E402

import mla_cases as mc  # noqa: E402
from optimized import mla_attention as mla  # noqa: E402

PREFIXES = (8192, 32768, 131072)


def timed(prefix: int, defines: tuple, num_splits=None) -> tuple[float, int, float]:
    """(seconds per call, splits, the floor in seconds)"""
    sec, probe, _ = mc.time_rotated(1, 64, prefix, seed=prefix, defines=defines, num_splits=num_splits)
    splits = mla.plan_for(probe.q_lat, probe.q_pe, probe.latent, num_splits=num_splits).splits
    return sec, splits, mc.floor_seconds(*mc.work(probe))


def merge_alone(splits: int, rot: int = 4) -> float:
    """Seconds per mla_combine launch at decode's shape (64 rows x 512), `splits` fp32 partials; rotated sets."""
    from optimized.cuda_launch import launch, ptr
    import numpy as np
    kernels, _ = mla._device_module(torch.cuda.current_device())
    dev = torch.device("cuda", torch.cuda.current_device())
    sets = [(torch.randn(max(splits, 1), 64, 512, device=dev), torch.randn(max(splits, 1), 64, device=dev),
             torch.empty(64, 512, dtype=torch.bfloat16, device=dev)) for _ in range(rot)]
    calls = [(lambda o=o, l=l, y=y: launch(kernels["mla_combine"], dev, (64, 4, 1), (mla.COMBINE_THREADS, 1, 1),
                                           (ptr(o), ptr(l), ptr(y), np.int32(64), np.int32(512), np.int32(splits))))
             for o, l, y in sets]
    return mc.time_graph(calls)


def main(out: str | None) -> None:
    rows = []
    print(f"{torch.cuda.get_device_name(0)}; T = 1, H = 64; us per call (rotated inputs, one CUDA graph)")
    for p in PREFIXES:
        served, sp, floor = timed(p, ())
        noload = timed(p, ("MLA_PAIR_NOLOAD=1",))[0]
        one = timed(p, (), num_splits=1)[0]
        merge, empty = merge_alone(sp), merge_alone(0)
        rows.append(dict(prefix=p, splits=sp, served_us=served * 1e6, noload_us=noload * 1e6, one_split_us=one * 1e6,
                         merge_us=merge * 1e6, empty_launch_us=empty * 1e6, floor_us=floor * 1e6))
        print(f"P={p:6d} splits={sp:3d}: served {served * 1e6:6.1f}  no K refills {noload * 1e6:6.1f}  "
              f"1 split {one * 1e6:7.1f}  merge alone {merge * 1e6:5.1f}  empty launch {empty * 1e6:4.1f}  "
              f"floor {floor * 1e6:5.1f}", flush=True)
    if out:
        Path(out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(0), rows=rows), indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
