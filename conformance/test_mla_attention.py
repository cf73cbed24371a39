"""optimized.mla_attention (kernels/mla_attention.cu) against reference.target.absorbed_attention.

CPU: the mask format, input validation, the launch plan, and an nvcc build of the .cu for sm_90 / sm_120.
GPU (`gpu`): the tolerance policy (mla_cases.check_policy: <= 2x PyTorch-bf16's error vs float64) on random
trees and chains, odd prefixes, T = 1 .. 1025, H = 1 .. 128; split-KV merges; the generic path; stream,
graph capture, determinism, every element written. `speed`: the issue's goals, judged by ratios in-run.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from hypothesis import given, strategies as st

import mla_cases as mc
from nvrtc_build import compile_log, spill_stores
from optimized import mla_attention as mla
from optimized.mla_attention import pack_visibility, unpack_visibility, plan, tree_attention

H200 = dict(sm_count=132, smem_optin=232448)          # plan() without cc: a 9.0-less device (no wgmma)
MMA_W8 = "mla_mma_w8_m64_n64_s2"
WGMMA_PAIR = "mla_wgmma_pair"          # the default on compute capability 9.0
WGMMA_SERIAL = "mla_wgmma_m64_n64"      # the one-tile-at-a-time wgmma kernel it replaces (kept for A/B)


def _default_backend() -> str:
    """What the plan must pick for C=512, R=64 on this GPU: the wgmma kernel on compute capability 9.0."""
    return "wgmma" if mla.device_info()["cc"] == mla.WGMMA_ARCH else "mma"


# ---- CPU: mask format ------------------------------------------------------------------------------------

@given(t=st.integers(1, 1025), n=st.integers(1, 1025), seed=st.integers(0, 2 ** 31 - 1))
def test_pack_round_trip(t, n, seed):
    g = torch.Generator().manual_seed(seed)
    vis = torch.rand(t, n, generator=g) < torch.rand(1, generator=g)
    words = pack_visibility(vis)
    assert words.dtype == torch.int32 and words.shape == (t, (n + 31) // 32)
    assert torch.equal(unpack_visibility(words, n), vis)


def test_pack_bit_layout():
    vis = torch.zeros(2, 70, dtype=torch.bool)
    vis[0, 0] = vis[0, 31] = vis[0, 69] = vis[1, 33] = True
    w = pack_visibility(vis)
    assert w.tolist() == [[1 - 2 ** 31, 0, 1 << 5], [0, 1 << 1, 0]]   # bit 31 set -> negative int32


def test_tree_visibility_ancestors():
    vis = mc.tree_visibility([-1, 0, 0, 1, 3])
    assert vis[4].tolist() == [True, True, False, True, True]
    assert vis[2].tolist() == [True, False, True, False, False]


# ---- CPU: validation (raises before any GPU is touched) --------------------------------------------------

def _cpu_inputs(t=3, h=2, c=16, r=8, p=5):
    return (torch.zeros(t, h, c, dtype=torch.bfloat16), torch.zeros(t, h, r, dtype=torch.bfloat16),
            torch.zeros(p + t, c + r, dtype=torch.bfloat16), torch.zeros(t, (t + 31) // 32, dtype=torch.int32))


@pytest.mark.parametrize("mutate, error, match", [
    (lambda a: (a[0].float(), *a[1:]), TypeError, "q_lat must be bfloat16"),
    (lambda a: (a[0], a[1], a[2].half(), a[3]), TypeError, "latent must be bfloat16"),
    (lambda a: (*a[:3], a[3].long()), TypeError, "tree_mask must be int32"),
    (lambda a: (a[0][0], *a[1:]), ValueError, r"expected q_lat \[T,H,C\]"),
    (lambda a: (a[0], a[1][:, :1], *a[2:]), ValueError, "must share"),
    (lambda a: (*a[:2], a[2][:, :-1], a[3]), ValueError, "latent rows have"),
    (lambda a: (*a[:2], a[2][:2], a[3]), ValueError, "prefix plus the T"),
    (lambda a: (*a[:3], torch.zeros(3, 2, dtype=torch.int32)), ValueError, r"tree_mask must be \[T, ceil"),
    (lambda a: (a[0].transpose(0, 1).contiguous().transpose(0, 1), *a[1:]), ValueError, "q_lat must be contiguous"),
    (lambda a: a, ValueError, "needs CUDA tensors"),
])
def test_validation_errors(mutate, error, match):
    with pytest.raises(error, match=match):
        tree_attention(*mutate(_cpu_inputs()), mc.K2_SCALE)


def test_validation_too_long_and_scale():
    t = mla.MAX_T + 1
    args = _cpu_inputs(t=t, h=1)
    with pytest.raises(ValueError, match="1..1025"):
        tree_attention(*args, mc.K2_SCALE)
    with pytest.raises(ValueError, match="softmax_scale"):
        tree_attention(*_cpu_inputs(), float("nan"))
    with pytest.raises(ValueError, match="neither the tensor-core shape"):
        tree_attention(*_cpu_inputs(c=2048, r=8), mc.K2_SCALE)


# ---- CPU: the launch plan --------------------------------------------------------------------------------

@given(t=st.integers(1, 1025), h=st.sampled_from([1, 4, 64, 128]), p=st.integers(0, 140_000))
def test_plan_covers_keys(t, h, p):
    for cc, backend, kernel in ((0, "mma", MMA_W8), (90, "wgmma", WGMMA_PAIR)):
        pl = plan(t, h, 512, 64, p + t, **H200, cc=cc)
        assert pl.backend == backend and pl.kernel == kernel and pl.smem <= H200["smem_optin"]
        assert pl.chunk_keys % 64 == 0 and 1 <= pl.splits <= mla.MAX_SPLITS
        assert (pl.splits - 1) * pl.chunk_keys < p + t <= pl.splits * pl.chunk_keys     # no empty split, all keys
        assert pl.grid == (-(-t * h // 64), pl.splits, 1) and pl.block == (256, 1, 1)


def test_plan_backends_and_configs():
    assert plan(4, 4, 16, 8, 20, **H200).backend == "simt"
    assert plan(1, 64, 512, 64, 100, sm_count=188, smem_optin=101376).kernel == "mla_mma_w4_m32_n32_s1"
    with pytest.raises(ValueError, match="needs 230912 B"):
        plan(1, 64, 512, 64, 100, sm_count=188, smem_optin=101376, config="mla_mma_w8_m64_n64_s2")
    with pytest.raises(ValueError, match="tensor-core kernel"):
        plan(4, 4, 16, 8, 20, **H200, num_splits=2)
    assert plan(1, 64, 512, 64, 8192 + 1, **H200, num_splits=7).splits == 7
    assert plan(1, 64, 512, 64, 100, **H200, cc=90, config=MMA_W8).backend == "mma"   # mma.sync on Hopper
    assert plan(1, 64, 512, 64, 100, sm_count=188, smem_optin=101376, cc=120).kernel == "mla_mma_w4_m32_n32_s1"
    with pytest.raises(ValueError, match="compute capability 9.0 only"):
        plan(1, 64, 512, 64, 100, **H200, cc=120, config=WGMMA_SERIAL)
    assert mla.CONFIGS[WGMMA_SERIAL].smem_bytes == 231424 <= H200["smem_optin"]
    assert mla.CONFIGS[WGMMA_PAIR].smem_bytes == 231936 <= H200["smem_optin"]
    for config in (None, WGMMA_SERIAL):   # the pair kernel takes odd tile counts too (the last tile alone)
        pl = plan(1, 64, 512, 64, 64 * 9, **H200, cc=90, config=config, num_splits=4)
        assert (pl.chunk_keys, pl.splits) == (192, 3)                                  # 9 tiles: 3+3+3


# ---- CPU: the .cu builds for both target architectures ---------------------------------------------------

def _tensor_core_kernels(arch: str) -> list[str]:
    return [k for k, c in mla.CONFIGS.items() if c.runs_on(mla.WGMMA_ARCH if arch == "sm_90a" else 0)]


def _check_ptxas_report(arch: str, log: str) -> dict:
    """The ptxas -v report of a build for `arch`: every kernel there (the wgmma kernel in sm_90a builds only),
    no wgmma serialization (ptxas C7514, e.g. after a wait_group that ptxas cannot follow). Returns the spill
    stores in bytes per entry function."""
    for name in _tensor_core_kernels(arch) + ["mla_combine", "mla_combine_rows"] + list(mla.GENERIC_KERNELS):
        assert f"Compiling entry function '{name}'" in log, log
    assert ("mla_wgmma_m64_n64" in log) == (arch == "sm_90a")
    assert "C7514" not in log and "serialized" not in log, f"ptxas serialized the wgmma pipeline: {log}"
    return spill_stores(log)


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a", "sm_120"])
def test_nvcc_builds(arch, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    res = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-std=c++17", "-Xptxas", "-v", "-o",
                          str(tmp_path / "mla.cubin"), str(mla._CU_PATH)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    spills = _check_ptxas_report(arch, res.stderr)
    assert max(spills.values()) <= 64, f"register spills grew: {res.stderr}"
    assert all(spills[k] == 0 for k in spills if "wgmma" in k), f"a wgmma kernel spills: {res.stderr}"


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a", "sm_120"])
def test_nvrtc_builds(arch):
    """What CuPy compiles on each device (_check_ptxas_report), and no spills in the tensor-core kernels."""
    spills = _check_ptxas_report(arch, compile_log(mla.kernel_source(), "mla_attention.cu", arch))
    names = _tensor_core_kernels(arch)
    assert set(spills) >= set(names) and all(spills[n] == 0 for n in names), spills
    assert all(spills[k] <= 64 for k in mla.GENERIC_KERNELS), spills   # the fp32 SIMT path (8 B at C <= 1024)


# ---- GPU: the tolerance policy ---------------------------------------------------------------------------

CASES = [  # (T, H, prefix, kind)
    (1, 64, 0, "chain"), (1, 64, 1000, "chain"), (1, 128, 4097, "chain"), (1, 1, 63, "chain"),
    (2, 64, 63, "random"), (5, 1, 0, "chain"), (9, 64, 1000, "random"), (31, 3, 65, "random"),
    (33, 64, 100, "random"), (33, 7, 31, "random"), (64, 128, 777, "random"), (65, 64, 4097, "random"),
    (65, 64, 129, "chain"), (257, 64, 2000, "random"), (1025, 4, 300, "random"), (1025, 64, 129, "random"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, WGMMA_SERIAL, MMA_W8])
@pytest.mark.parametrize("t, h, prefix, kind", CASES)
def test_matches_reference(t, h, prefix, kind, config):
    """The plan's kernel (the wgmma pair kernel on 9.0), the one-tile wgmma kernel and the mma.sync kernel,
    which 9.0 runs only when asked."""
    if config == WGMMA_SERIAL and _default_backend() != "wgmma":
        pytest.skip("the wgmma kernels exist on compute capability 9.0 only")
    case = mc.make_case(t, h, prefix, kind=kind, seed=t * 1000 + prefix)
    want = _default_backend() if config is None else mla.CONFIGS[config].kind
    assert mla.plan_for(case.q_lat, case.q_pe, case.latent, config=config).backend == want
    out = tree_attention(case.q_lat, case.q_pe, case.latent, case.tree_mask, case.scale, config=config)
    mc.check_policy(out, mc.reference_f64(case), mc.reference_bf16(case), f"T={t} H={h} P={prefix} {kind} {want}")


@pytest.mark.gpu
def test_peaked_scores():
    case = mc.make_case(40, 64, 3000, q_std=2.0, seed=7)      # score std ~ 7: near one-hot rows
    out = tree_attention(case.q_lat, case.q_pe, case.latent, case.tree_mask, case.scale)
    mc.check_policy(out, mc.reference_f64(case), mc.reference_bf16(case), "peaked")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 47, mla.MAX_SPLITS])
def test_split_merge(splits):
    # T=200 over P=10: later chunks hold only tree keys, so many rows see nothing there (lse = -inf partials)
    for t, h, prefix in ((17, 64, 3000), (200, 8, 10)):
        case = mc.make_case(t, h, prefix, seed=splits + t)
        out = tree_attention(case.q_lat, case.q_pe, case.latent, case.tree_mask, case.scale, num_splits=splits)
        mc.check_policy(out, mc.reference_f64(case), mc.reference_bf16(case), f"splits={splits} T={t}")


@pytest.mark.gpu
@pytest.mark.parametrize("t, h, prefix", [(1, 64, 1000), (9, 64, 333), (65, 16, 4097), (300, 2, 50)])
def test_small_smem_config(t, h, prefix):
    """The 99 KB configuration (sm_120 parts), exercised on whatever GPU is here."""
    case = mc.make_case(t, h, prefix, seed=5 + t)
    out = tree_attention(case.q_lat, case.q_pe, case.latent, case.tree_mask, case.scale,
                         config="mla_mma_w4_m32_n32_s1")
    mc.check_policy(out, mc.reference_f64(case), mc.reference_bf16(case), f"w4 T={t} H={h} P={prefix}")


@pytest.mark.gpu
@pytest.mark.parametrize("t, h, c, r, prefix", [(1, 4, 16, 8, 0), (7, 4, 16, 8, 5), (40, 4, 16, 8, 100),
                                                (33, 2, 256, 32, 70), (3, 3, 1000, 200, 17),
                                                (1, 4, 64, 16, 700), (129, 4, 64, 16, 300),   # the trained pair
                                                (5, 3, 20, 6, 40), (2, 1, 1, 1, 3),          # L % 8 != 0
                                                (3, 2, 300, 12, 2000)])                      # 8+ chunks a warp
def test_generic_small_dims(t, h, c, r, prefix):
    """The generic kernel (a block per query row, a lane per key): each C bracket (64 / 256 / 1024 columns), the
    16-B and the scalar key loads, rows seeing only tree keys (P = 0), warps with several key chunks."""
    case = mc.make_case(t, h, prefix, c=c, r=r, seed=t + c)
    pl = mla.plan_for(case.q_lat, case.q_pe, case.latent)
    want = next(k for cap, k in zip(mla.GENERIC_CAPS, mla.GENERIC_KERNELS) if c <= cap)
    assert pl.backend == "simt" and pl.kernel == want, pl
    out = tree_attention(case.q_lat, case.q_pe, case.latent, case.tree_mask, case.scale)
    mc.check_policy(out, mc.reference_f64(case), mc.reference_bf16(case), f"generic C={c} R={r}")


@pytest.mark.gpu
def test_absorbed_attention_signature():
    case = mc.make_case(12, 64, 500, seed=3)
    out = mla.absorbed_attention(case.q_lat, case.q_pe, case.latent, case.visible, case.scale)
    mc.check_policy(out, mc.reference_f64(case), mc.reference_bf16(case), "absorbed_attention")
    vis = case.visible.clone()
    vis[3, 10] = False
    with pytest.raises(ValueError, match="every prefix slot visible"):
        mla.absorbed_attention(case.q_lat, case.q_pe, case.latent, vis, case.scale)


# ---- GPU: serving-engine properties ----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("t, prefix", [(1, 5000), (65, 1000)])
def test_every_element_written_and_deterministic(t, prefix):
    case = mc.make_case(t, 64, prefix, seed=11)
    out = torch.full_like(case.q_lat, float("nan"))
    tree_attention(case.q_lat, case.q_pe, case.latent, case.tree_mask, case.scale, out=out)
    assert torch.isfinite(out).all()
    again = tree_attention(case.q_lat, case.q_pe, case.latent, case.tree_mask, case.scale)
    assert torch.equal(out, again), "two runs differ: a race"


@pytest.mark.gpu
def test_side_stream_and_graph_capture():
    case = mc.make_case(33, 64, 2000, seed=13)
    args = (case.q_lat, case.q_pe, case.latent, case.tree_mask, case.scale)
    want = tree_attention(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = tree_attention(*args)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)
    out = torch.empty_like(want)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tree_attention(*args, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.gpu
def test_missing_wgmma_kernel_raises(monkeypatch):
    """A module without the sm_90a kernel (an NVRTC that ignored -arch=sm_90a) raises with what to do when the
    plan picks it, never falling back; the mma.sync kernel still runs when asked for."""
    if _default_backend() != "wgmma":
        pytest.skip("the wgmma kernel exists on compute capability 9.0 only")
    case = mc.make_case(9, 64, 100, seed=4)
    args = (case.q_lat, case.q_pe, case.latent, case.tree_mask, case.scale)
    monkeypatch.setitem(mla.device_info()["missing"], WGMMA_PAIR, "simulated")
    with pytest.raises(RuntimeError, match="did not compile sm_90a code"):
        tree_attention(*args)
    out = tree_attention(*args, config=MMA_W8)
    mc.check_policy(out, mc.reference_f64(case), mc.reference_bf16(case), "mma while wgmma is missing")


@pytest.mark.gpu
def test_gpu_layout_errors():
    case = mc.make_case(4, 8, 100, seed=1)
    lat = case.latent
    with pytest.raises(ValueError, match="q_lat must be contiguous"):
        tree_attention(case.q_lat.transpose(0, 1).contiguous().transpose(0, 1), case.q_pe, lat, case.tree_mask,
                       case.scale)
    buf = torch.empty(lat.numel() + 1, dtype=torch.bfloat16, device=lat.device)
    shifted = buf[1:].view_as(lat)
    shifted.copy_(lat)
    with pytest.raises(ValueError, match="16-byte boundary"):
        tree_attention(case.q_lat, case.q_pe, shifted, case.tree_mask, case.scale)
    with pytest.raises(ValueError, match="on cpu"):
        tree_attention(case.q_lat, case.q_pe, lat, case.tree_mask.cpu(), case.scale)


# ---- GPU: speed goals (issue 6 section 5), judged by ratios measured in this run ----------------------------

def _speed(t, prefix, h=64):
    """Seconds per call as the bench times it (mla_cases.time_rotated), PyTorch's masked einsum, flops, bytes."""
    ours, case, _ = mc.time_rotated(t, h, prefix, seed=99)
    backend = mla.plan_for(case.q_lat, case.q_pe, case.latent).backend
    if backend != _default_backend():                 # not an AssertionError: a goal's xfail must not hide it
        pytest.fail(f"the plan chose backend {backend!r}, not {_default_backend()!r}")
    flops, nbytes = mc.work(case)
    torch_s = mc.time_eager(lambda: mc.reference_bf16(case))
    return ours, torch_s, flops, nbytes


GOAL_NOT_MET = ("issue 6 goal not met (H200, 2026-12-04, wgmma pair kernel at 36d03ae: T=1 P=8k 16.3 us = 7.2x the "
                "bandwidth floor, of which ~12.9 us the attention kernel (65 blocks of 2 key tiles, latency-bound) "
                "and ~3.6 us the split merge; 1.9x at 128k): see bench/results/mla_notes.md run 7")


@pytest.mark.gpu
@pytest.mark.speed
@pytest.mark.xfail(reason=GOAL_NOT_MET, strict=False, raises=AssertionError)
def test_speed_goal_decode_bandwidth():
    """Issue goal: T = 1, prefix 8k within 2x of the bandwidth floor."""
    ours, _, flops, nbytes = _speed(1, 8192)
    ratio = ours / mc.floor_seconds(flops, nbytes)
    assert ratio <= 2.0, f"T=1 P=8k: {ours * 1e6:.1f} us = {ratio:.2f}x the floor (goal <= 2x)"


@pytest.mark.gpu
@pytest.mark.speed
@pytest.mark.parametrize("prefix", [8192, 32768])
def test_speed_goal_tree_tflops(prefix):
    """Issue goal: T = 33, prefix >= 8k at >= 400 TFLOP/s (half the measured 787). Met on the H200 at e39b708 and
    36d03ae: 411 / 414 TFLOP/s at 8k (a 3 % margin), 482 / 483 at 32k (bench/results/mla_notes.md run 7)."""
    ours, _, flops, _ = _speed(33, prefix)
    assert flops / ours / 1e12 >= 400, f"T=33 P={prefix}: {flops / ours / 1e12:.0f} TFLOP/s (goal >= 400)"


@pytest.mark.gpu
@pytest.mark.speed
@pytest.mark.parametrize("t, prefix, max_floor_ratio, min_vs_torch", [(1, 32768, 4.5, 6.0), (33, 8192, 2.5, 5.0),
                                                                       (65, 32768, 2.1, 5.0)])
def test_speed_regression(t, prefix, max_floor_ratio, min_vs_torch):
    """What the plan's kernel reaches on an H200 (wgmma pair kernel, measured 2026-12-04 at 1dc8a45: 3.54x / 1.96x /
    1.63x the floor, 12x / 8.9x / 8.6x PyTorch's masked einsum), with ~25% margin: guards against regressions,
    judged by in-run ratios. The thresholds are the H200's; another GPU runs another kernel."""
    ours, torch_s, flops, nbytes = _speed(t, prefix)
    ratio = ours / mc.floor_seconds(flops, nbytes)
    assert ratio <= max_floor_ratio, f"T={t} P={prefix}: {ratio:.2f}x the floor (was <= {max_floor_ratio})"
    assert torch_s / ours >= min_vs_torch, f"T={t} P={prefix}: {torch_s / ours:.2f}x PyTorch (was >= {min_vs_torch})"


@pytest.mark.gpu
@pytest.mark.parametrize("c, r", [(512, 64), (64, 16)])
def test_device_seq_len_in_one_graph(c, r):
    """Graph mode (the engine's): one captured launch over a buffer of 4096 rows serves every prefix, the
    kernel reading S = P + T from the device. Each replay equals the host-shaped call on the first S rows up to
    bf16 rounding (the split plan, hence the summation order, differs)."""
    t, h, cap = 33, 16, 4096
    case = mc.make_case(t, h, cap - t, c=c, r=r, seed=21)
    buf = case.latent.clone()                                      # [cap, C+R]
    seq = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(case.q_lat)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        seq.fill_(cap)
        tree_attention(case.q_lat, case.q_pe, buf, case.tree_mask, case.scale, out=out, seq_len=seq)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        tree_attention(case.q_lat, case.q_pe, buf, case.tree_mask, case.scale, out=out, seq_len=seq)
    for prefix in (0, 1, 100, 777, 2048, cap - t):
        buf.copy_(case.latent)
        # the tree rows sit at slots prefix..prefix+T-1 in both calls
        buf[prefix:prefix + t] = case.latent[cap - t:]
        seq.fill_(prefix + t)
        out.fill_(float("nan"))
        g.replay()
        want = tree_attention(case.q_lat, case.q_pe, buf[:prefix + t].contiguous(), case.tree_mask, case.scale)
        torch.cuda.synchronize()
        err = (out.float() - want.float()).abs().max().item()
        assert err <= 2 ** -7 * want.float().abs().max().item() + 1e-6, f"prefix {prefix}: error {err}"
