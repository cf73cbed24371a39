"""optimized.norm_rope (one-launch RMSNorm and RoPE, CuPy kernels) == reference.target.RMSNorm / apply_rope.

Replaces: reference.target.RMSNorm.forward and reference.target.apply_rope on bf16 CUDA tensors inside the
engine (target: input/post/q_a/kv_a/final norms, q_pe/k_pe rotation; drafter: every norm and rotation).
Backend: the CuPy kernels, the only path (CPU tensors and other dtypes raise).
Tolerances: RoPE is compared bit for bit with the reference in bf16 (the kernel repeats its rounding steps).
RMSNorm follows the kernel policy of TOLERANCES.md: error against a float64 evaluation at most 2x (+1e-6)
PyTorch bf16's, and at most two bf16 steps (2^-6 relative) from the bf16 reference anywhere: the normalized
value may round one step differently (fp32 sum order), and the weight multiply rounds once more.
CPU tests: the clear errors. GPU tests: marked `gpu`.
"""
import pytest
import torch
from hypothesis import given, strategies as st

from reference.target import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

import optimized.norm_rope as nr
from nvrtc_build import assert_builds_without_spills

gpu = pytest.mark.gpu


def norm_module(d: int, seed: int) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    m = RMSNorm(d, 1e-6)
    with torch.no_grad():
        m.weight.copy_(1 + 0.3 * torch.randn(d, generator=g))
    return m


def wide_rows(rows: int, d: int, extra: int, seed: int, scale: float, device="cuda") -> torch.Tensor:
    """[rows, d] bf16 on `device` as a column slice of a [rows, extra + d + 3] tensor (a view with row stride > d)
    when extra > 0 (like ckv split from the kv_a projection), else contiguous. The slice is taken on the device:
    moving a view there would make it contiguous."""
    g = torch.Generator().manual_seed(seed)
    full = (scale * torch.randn(rows, extra + d + (3 if extra else 0), generator=g)).to(torch.bfloat16)
    return full.to(device)[:, extra:extra + d]


# ---- CPU: clear errors -----------------------------------------------------------------------------------

def test_cpu_tensors_raise():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA tensor"):
        nr.latent_rows(x, torch.ones(48, dtype=torch.bfloat16), 1e-6, torch.zeros(4, 8), torch.zeros(4, 8), True,
                       torch.arange(4), torch.zeros(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA tensor"):
        nr.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="CUDA tensor"):
        nr.rope(x, torch.zeros(4, 32), torch.zeros(4, 32))


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_nvrtc_builds(arch):
    """norm_rope.cu builds with NVRTC (CuPy's compiler) for Hopper and Blackwell, no spills, every kernel the
    launcher fetches present. Needs cuda_bf16.h: the nvidia-cuda-nvcc wheel's or a toolkit's."""
    assert_builds_without_spills(nr._SOURCE.read_text(), "norm_rope.cu", arch, nr.KERNELS)


# ---- GPU -------------------------------------------------------------------------------------------------

@gpu
@given(rows=st.integers(1, 70), d=st.sampled_from([16, 36, 64, 128, 256, 512, 1536, 7168]),
       view=st.booleans(), heads=st.sampled_from([1, 4]), scale=st.sampled_from([1e-2, 1.0, 30.0]),
       seed=st.integers(0, 2**16))
def test_rms_norm_policy(rows, d, view, heads, scale, seed):
    m = norm_module(d, seed)
    x = wide_rows(rows * heads, d, 5 if view else 0, seed + 1, scale)
    if heads > 1 and not view:
        x = x.view(rows, heads, d)                                    # per-head norm (drafter q/k norms)
    w = m.weight.to(torch.bfloat16).cuda()
    path = nr.norm_path(x, x.stride(-2), w)
    # the 16-byte kernel exactly where everything is 16-byte aligned (a view at column offset 5 is not; d = 36 is not)
    assert path == ("v8" if d % 8 == 0 and not view else "generic")
    assert (x.stride(-2) != d) == view          # a column view (rows of d + 8); not is_contiguous(): one row is
    out = nr.rms_norm(x, w, m.eps)
    assert out.shape == x.shape and out.is_contiguous() and out.dtype == torch.bfloat16
    ref64 = m.double()(x.double().cpu())
    ref16 = m.to(torch.bfloat16).cuda()(x).cpu().double()
    got = out.cpu().double()
    scale_ref = ref64.abs().max().clamp(min=1e-30)
    err_k = ((got - ref64).abs().max() / scale_ref).item()
    err_t = ((ref16 - ref64).abs().max() / scale_ref).item()
    assert err_k <= 2 * err_t + 1e-6, f"rms_norm rows={rows} d={d}: error {err_k:.3e} vs PyTorch bf16 {err_t:.3e}"
    step = (ref16.abs() * 2.0 ** -6).clamp(min=1e-30)      # normalized value one step off, then x weight rounds
    assert ((got - ref16).abs() <= step).all(), "rms_norm: more than two bf16 steps from the bf16 reference"
    assert nr._kernels.cache_info().currsize >= 1                      # the CuPy kernel ran


@gpu
@pytest.mark.parametrize("d", [512, 1536, 7168])
def test_rms_norm_paths_agree(d):
    """The 16-byte kernel and the generic one on the same rows: within one bf16 step (fp32 sum order only)."""
    m = norm_module(d, 3)
    w = m.weight.to(torch.bfloat16).cuda()
    a = wide_rows(9, d, 0, 4, 1.0)                               # contiguous, 16-byte aligned
    shifted = torch.empty(9, d + 1, dtype=torch.bfloat16, device="cuda")[:, 1:]
    shifted[:] = a                                                       # the same rows at a 2-byte offset
    assert nr.norm_path(a, a.stride(0), w) == "v8" and nr.norm_path(shifted, shifted.stride(0), w) == "generic"
    va, vg = nr.rms_norm(a, w, m.eps).double(), nr.rms_norm(shifted, w, m.eps).double()
    assert ((va - vg).abs() <= va.abs() * 2.0 ** -7 + 1e-30).all()
    assert (va != 0).any()


@gpu
@pytest.mark.parametrize("rows, heads, other, d, offset", [(9, 4, 2, 64, 0), (17, 32, 8, 128, 0), (3, 2, 1, 36, 0),
                                                           (5, 4, 4, 64, 8), (2, 3, 1, 64, 64)])
def test_rms_norm_head_split(rows, heads, other, d, offset):
    """A head split of a fused projection ([rows, heads, d] inside [rows, (offset/d + heads + other) * d]: one
    stride between heads, another between rows; the drafter's q/k norms on its fused q/k/v output) normalizes
    each head exactly as the same heads made contiguous, on both kernels (d = 36 takes the generic one)."""
    m = norm_module(d, rows + heads)
    w = m.weight.to(torch.bfloat16).cuda()
    g = torch.Generator().manual_seed(rows)
    full = torch.randn(rows, offset + (heads + other) * d, generator=g).to(torch.bfloat16).cuda()
    x = full[:, offset:offset + heads * d].view(rows, heads, d)
    with pytest.raises(RuntimeError):
        x.view(rows * heads, d)                                           # not one uniform row stride
    split = nr.norm_path(x, x.stride(0), w, x.stride(1))
    assert split == ("v8" if d % 8 == 0 else "generic")
    out = nr.rms_norm(x, w, m.eps)
    want = nr.rms_norm(x.contiguous(), w, m.eps)
    assert out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out, want), (out - want).abs().max()


@gpu
@given(t=st.integers(1, 40), heads=st.sampled_from([0, 1, 4, 64]), rot=st.sampled_from([16, 64, 128]),
       interleave=st.booleans(), split=st.booleans(), seed=st.integers(0, 2**16),
       start=st.integers(0, 5000))
def test_rope_bit_exact(t, heads, rot, interleave, split, seed, start):
    g = torch.Generator().manual_seed(seed)
    nope = 24 if split else 0
    shape = (t, heads, nope + rot) if heads else (t, nope + rot)
    x = (3 * torch.randn(shape, generator=g)).to(torch.bfloat16).cuda()[..., nope:]   # q_pe / k_pe views
    inv = rope_inv_freq(rot, 50000.0)
    cos, sin = rope_cos_sin(inv.cuda(), torch.arange(start, start + t, device="cuda"), 1.2)
    out = nr.rope(x, cos, sin, interleave)
    ref = apply_rope(x, cos, sin, interleave)
    assert out.is_contiguous() and out.shape == ref.shape
    assert torch.equal(out, ref), f"rope t={t} heads={heads} rot={rot} interleave={interleave}: " \
        f"{(out != ref).sum().item()} values differ"
    assert nr._kernels.cache_info().currsize >= 1


@gpu
@given(t=st.integers(1, 40), shape=st.sampled_from([(512, 64), (64, 16), (16, 8), (1024, 32)]),
       interleave=st.booleans(), q_before=st.sampled_from([0, 24]), seed=st.integers(0, 2**16),
       start=st.integers(0, 5000))
def test_latent_rows_bit_exact(t, shape, interleave, q_before, seed, start):
    """latent_rows == the engine's four launches (rms_norm of ckv, rope of k_pe, cat, index_copy) bit for bit,
    from a kv view inside a wider projection output (q_before columns ahead, like a fused q|kv GEMM), into
    permuted slots of a cache whose other rows stay untouched; and the RoPE part equals the reference's."""
    c, r = shape
    g = torch.Generator().manual_seed(seed)
    full = (3 * torch.randn(t, q_before + c + r, generator=g)).to(torch.bfloat16).cuda()
    kv = full[:, q_before:]
    m = norm_module(c, seed)
    w = m.weight.detach().to(torch.bfloat16).cuda()
    cos, sin = rope_cos_sin(rope_inv_freq(r, 50000.0).cuda(), torch.arange(start, start + t, device="cuda"), 1.2)
    slots = torch.randperm(t + 7, generator=g)[:t].cuda()
    cache = torch.full((t + 7, c + r), 7.0, dtype=torch.bfloat16, device="cuda")
    nr.latent_rows(kv, w, m.eps, cos, sin, interleave, slots, cache)
    want = torch.full_like(cache, 7.0)
    want.index_copy_(0, slots, torch.cat([nr.rms_norm(kv[:, :c], w, m.eps),
                                          nr.rope(kv[:, c:], cos, sin, interleave)], -1))
    assert torch.equal(cache, want), f"{(cache != want).sum().item()} values differ (C={c}, R={r})"
    assert torch.equal(cache[slots, c:], apply_rope(kv[:, c:], cos, sin, interleave))


@gpu
def test_gpu_bad_inputs_raise():
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="bfloat16"):
        nr.rms_norm(x.float(), w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        nr.rms_norm(x, w.float(), 1e-6)
    with pytest.raises(ValueError, match="contiguous last dim"):
        nr.rms_norm(torch.zeros(64, 4, dtype=torch.bfloat16, device="cuda").t(), w, 1e-6)
    with pytest.raises(ValueError, match="uniform stride"):     # [6, 4, 5, 64] from [4, 6, 5, 64]: no [a, 5, 64]
        nr.rms_norm(torch.zeros(4, 6, 5, 64, dtype=torch.bfloat16, device="cuda").transpose(0, 1), w, 1e-6)
    with pytest.raises(ValueError, match="cos"):
        nr.rope(x, torch.zeros(4, 16, device="cuda"), torch.zeros(4, 32, device="cuda"))
    with pytest.raises(ValueError, match="even"):
        nr.rope(x[:, :63], torch.zeros(4, 31, device="cuda"), torch.zeros(4, 31, device="cuda"))
    cs, slots, cache = torch.zeros(4, 8, device="cuda"), torch.arange(4, device="cuda"), torch.zeros_like(x)
    nr.latent_rows(x, w[:48], 1e-6, cs, cs, True, slots, cache)          # C = 48, R = 16: fine
    for args, match in (((x, w[:44], 1e-6, cs, cs, True, slots, cache), "C % 8"),
                        ((x, w[:48], 1e-6, cs[:, :4], cs, True, slots, cache), "cos"),
                        ((x, w[:48], 1e-6, cs, cs, True, slots.int(), cache), "slots"),
                        ((x, w[:48], 1e-6, cs, cs, True, slots, cache[:, :60]), "latent")):
        with pytest.raises(ValueError, match=match):
            nr.latent_rows(*args)
