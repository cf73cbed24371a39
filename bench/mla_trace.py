"""Where the wgmma pair kernel's time goes: clock64 stamps of one block's schedule (built with -DMLA_TRACE=1),
averaged over the steady-state pairs, next to the time per call of the kernel as served, of the same kernel
with the K refills skipped (-DMLA_PAIR_NOLOAD=1: wrong results, the schedule alone) and of the one-tile wgmma
kernel. Needs an sm_90 GPU; argv: T:P pairs (default 257:8192 33:32768).

    python bench/mla_trace.py 257:8192
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "conformance")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mla_cases as mc  # noqa: E402
from optimized import mla_attention as mla  # noqa: E402

EVENTS = {  # event index -> what has just happened, per warpgroup (see TRACE(e) in mla_wgmma_pair)
    0: ("pair start", "pair start"), 8: ("rope panel landed", "rope panel landed"),
    9: ("K panels 0-3 landed", "K panels 4-7 landed"), 10: ("K panels 4-7 landed", "K panels 0-3 landed"),
    1: ("S0 ready (QK0 retired)", "S1 ready (QK1 retired)"), 2: ("m0, scale0 published", "got m0, scale0"),
    3: ("got P1, scale1", "P1, scale1 published"), 4: ("P0 V0_L retired", "got P0"),
    5: ("P1 V1_L issued", "P1 V1_R retired"), 6: ("P1 V1_L retired", "P0 V0_R retired"),
    11: ("rope refill issued", "rope refill issued"), 12: ("S0 masked, row max", "S1 masked, row max"),
    13: ("P0 = exp, packed", "-"),
}


def build(defines):
    import cupy
    opts = ("-std=c++17", "-arch=sm_90a") + tuple(f"-D{d}" for d in defines)
    mod = cupy.RawModule(code=mla.kernel_source(), options=opts)
    return mod


def launcher(mod, name, case, splits, merge=False):
    """run() launches kernel `name` of `mod` (None: the plan's choice) over `case` with `splits` (None: the plan's)
    on the current torch stream at call time (so a CUDA graph captures it), then mla_combine when `merge` (the
    split merge, as served). Returns run, the plan and the output buffer."""
    t, h, c = case.q_lat.shape
    info = mla.device_info(0)
    pl = mla.plan(t, h, c, case.q_pe.shape[2], case.latent.shape[0], info["sm_count"], info["smem_optin"],
                  name, splits, info["cc"])
    fn = mod.get_function(pl.kernel)
    fn.max_dynamic_shared_size_bytes = pl.smem
    comb = mod.get_function("mla_combine") if merge and pl.splits > 1 else None
    m = t * h
    out = torch.empty((t, h, c), dtype=torch.bfloat16, device="cuda")
    o_part = torch.empty((pl.splits, m, c), dtype=torch.float32, device="cuda") if pl.splits > 1 else None
    lse = torch.empty((pl.splits, m), dtype=torch.float32, device="cuda") if pl.splits > 1 else None
    p = lambda x: np.uint64(0 if x is None else x.data_ptr())  # noqa: E731
    args = (p(case.q_lat), p(case.q_pe), p(case.latent), p(case.tree_mask), p(out), p(o_part), p(lse), np.int32(t),
            np.int32(h), np.int32(case.latent.shape[0] - t), np.int32(case.latent.shape[0]),
            np.int32(case.tree_mask.shape[1]), np.int32(pl.chunk_keys), np.float32(case.scale * mla._LOG2E),
            np.uint64(0))

    def run():
        with mla._cupy_stream(torch.cuda.current_stream().cuda_stream, 0):
            fn(pl.grid, pl.block, args, shared_mem=pl.smem)
            if comb is not None:
                comb((m, c // 128, 1), (mla.COMBINE_THREADS, 1, 1),
                     (p(o_part), p(lse), p(out), np.int32(m), np.int32(c), np.int32(pl.splits)))
    return run, pl, out


def read_global(mod, name: str, shape: tuple, dtype=np.int64) -> np.ndarray:
    """A __device__ array of `mod` (the trace stamps) copied to the host."""
    host = np.zeros(shape, dtype=dtype)
    mod.get_global(name).copy_to_host(host.ctypes.data_as(np.ctypeslib.ctypes.c_void_p), host.nbytes)
    return host


def per_call(run, reps=20):
    for _ in range(3):
        run()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        run()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e3


def main(argv):
    shapes = [tuple(int(v) for v in a.split(":")) for a in argv] or [(257, 8192), (33, 32768)]
    traced, plain, noload = build(["MLA_TRACE=1"]), build([]), build(["MLA_PAIR_NOLOAD=1"])
    for t, p in shapes:
        case = mc.make_case(t, 64, p, seed=1)
        row = []
        for label, mod, name in (("pair", plain, "mla_wgmma_pair"), ("pair, no K refills", noload, "mla_wgmma_pair"),
                                 ("pair, traced", traced, "mla_wgmma_pair"), ("one-tile", plain, "mla_wgmma_m64_n64")):
            run, pl, _ = launcher(mod, name, case, 1)
            us = per_call(run)
            tiles = pl.grid[0] * -(-case.latent.shape[0] // 64)
            row.append(f"{label}: {us:.1f} us ({us * 132 / tiles:.2f} us per tile per SM)")
            if label == "pair, traced":
                host = read_global(mod, "mla_trace", (2, 64, 16))
                n_pairs = min(64, -(-case.latent.shape[0] // 128))
                lo, hi = 2, max(3, n_pairs - 1)
                start = host[0, lo:hi, 0].astype(np.float64)
                period = np.diff(host[0, lo:hi + 1, 0]).mean() if hi + 1 <= n_pairs else float("nan")
                print(f"T={t} P={p}: pairs {lo}..{hi - 1} of {n_pairs}, period {period:.0f} cycles; "
                      f"event times in cycles after wg0's pair start:")
                for e, (w0, w1) in EVENTS.items():
                    d0 = (host[0, lo:hi, e] - start).mean()
                    d1 = (host[1, lo:hi, e] - start).mean()
                    print(f"  e{e:<2d} wg0 {d0:7.0f}  {w0:26s} | wg1 {d1:7.0f}  {w1}")
        print(f"T={t} P={p} splits=1: " + "; ".join(row))


if __name__ == "__main__":
    main(sys.argv[1:])
