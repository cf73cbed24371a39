"""optimized.draft_ops (the drafter's attention steps as CuPy kernels) == reference.drafter.DraftAttention's steps.

Replaces, on the engine's cuda backend: DraftAttention's q_norm + apply_rope (head_norm_rope), keys_values + the
engine's context-cache writes (write_keys_values, one layer or all layers in one launch), the unmasked
[context; block] attention (draft_attention, with its key-split merge) and the MLP's silu(gate) * up (silu_mul).
Backend: the CuPy kernels, the only path (CPU tensors and other dtypes raise).
Tolerances (TOLERANCES.md kernel policy): error against a float64 evaluation at most 2x (+1e-6) that of the
reference's own bf16 steps; the norm/RoPE kernels also reproduce the reference's rounding steps, so nearly every
value is bit-equal to the bf16 reference (>= 99 % asserted; the RMSNorm's fp32 sum order may move a value one
bf16 step). Attention keeps fp32 where the reference rounds P to bf16: policy only.
CPU tests: the clear errors and the NVRTC build. GPU tests: marked `gpu`.
"""
import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

from reference.target import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

import optimized.draft_ops as do
from nvrtc_build import assert_builds_without_spills

gpu = pytest.mark.gpu


def rel_err(a: torch.Tensor, ref64: torch.Tensor) -> float:
    return ((a.double().cpu() - ref64).abs().max() / ref64.abs().max().clamp(min=1e-30)).item()


def angles(rows: int, e: int, start: int = 7):
    return rope_cos_sin(rope_inv_freq(e, 50000.0).cuda(), torch.arange(start, start + rows, device="cuda"), 1.1)


def norm_module(e: int, seed: int) -> RMSNorm:
    m = RMSNorm(e, 1e-5)
    with torch.no_grad():
        m.weight.copy_(1 + 0.3 * torch.randn(e, generator=torch.Generator().manual_seed(seed)))
    return m


def norm_rope_refs(x: torch.Tensor, m: RMSNorm, cos, sin):
    """(bf16 reference steps on the GPU, float64 evaluation on the CPU) of rope(RMSNorm(x)), NeoX halves, both with
    the bf16 weight the kernel gets (`m` is left as it is)."""
    m16 = copy.deepcopy(m).to(torch.bfloat16).cuda()
    m64 = copy.deepcopy(m16).double().cpu()
    ref16 = apply_rope(m16(x), cos, sin, interleave=False)
    ref64 = apply_rope(m64(x.double().cpu()), cos.double().cpu(), sin.double().cpu(), interleave=False)
    return ref16, ref64


def check_norm_rope(got: torch.Tensor, ref16: torch.Tensor, ref64: torch.Tensor, what: str):
    err_k, err_t = rel_err(got, ref64), rel_err(ref16, ref64)
    assert err_k <= 2 * err_t + 1e-6, f"{what}: error {err_k:.3e} vs the bf16 reference steps' {err_t:.3e}"
    same = (got == ref16).float().mean().item()
    assert same >= 0.99, f"{what}: only {same:.2%} of values bit-equal to the bf16 reference steps"


# ---- CPU: the build and the clear errors ------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_nvrtc_builds(arch):
    """draft.cu builds with NVRTC for Hopper and Blackwell, every kernel the launcher fetches present, no spills."""
    spills = assert_builds_without_spills(do._SOURCE.read_text(), "draft.cu", arch, do.KERNELS)
    assert set(spills) == set(do.KERNELS), sorted(set(spills) ^ set(do.KERNELS))


def test_cpu_tensors_and_unbuilt_shapes_raise():
    x = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 CUDA tensor"):
        do.head_norm_rope(x, torch.ones(64, dtype=torch.bfloat16), 1e-5, torch.zeros(4, 32), torch.zeros(4, 32))
    with pytest.raises(ValueError, match="bfloat16 CUDA tensor"):
        do.silu_mul(torch.zeros(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no kernel variant.*backend='torch'"):
        do.attention_kernel(16, 128)
    with pytest.raises(ValueError, match="no kernel variant"):
        do.attention_kernel(8, 256)
    assert do.attention_kernel(2, 64) == "draft_attention_r2_c2"          # the trained drafter
    assert do.attention_kernel(8, 128) == "draft_attention_r8_c4"         # K2.6's (64 heads over 8, E = 128)
    assert do.attention_kernel(3, 20) == "draft_attention_r4_c2"
    assert do.splits_for(1024) == 1 and do.splits_for(1025) == 3 and do.splits_for(4096) == 8


# ---- GPU ------------------------------------------------------------------------------------------------

@gpu
@given(rows=st.integers(1, 40), heads=st.sampled_from([1, 4, 64]), e=st.sampled_from([16, 64, 128, 256]),
       offset=st.sampled_from([0, 1]), scale=st.sampled_from([0.05, 1.0, 20.0]), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_head_norm_rope_policy(rows, heads, e, offset, scale, seed):
    """q_norm then RoPE of the q heads of a fused q|k|v output (a view: a row stride wider than the heads, at a
    head offset or a 2-byte one) in one launch."""
    g = torch.Generator().manual_seed(seed)
    full = (scale * torch.randn(rows, offset + (heads + 2) * e, generator=g)).to(torch.bfloat16).cuda()
    x = full[:, offset:offset + heads * e].view(rows, heads, e)
    m = norm_module(e, seed)
    cos, sin = angles(rows, e)
    got = do.head_norm_rope(x, m.weight.to(torch.bfloat16).cuda(), m.eps, cos, sin)
    assert got.shape == (rows, heads, e) and got.is_contiguous()
    check_norm_rope(got, *norm_rope_refs(x, m, cos, sin), f"head_norm_rope rows={rows} heads={heads} e={e}")


@gpu
@pytest.mark.parametrize("layers, g, e", [(1, 2, 64), (3, 2, 64), (2, 8, 128), (2, 1, 20)])
def test_write_keys_values(layers, g, e):
    """Each layer's keys (k_norm, RoPE) and values written at the given flat slots of [layers, R, cap, G, E]
    caches, every other row untouched; one launch for all layers (commit) or one layer's slice (draft)."""
    rows, r, cap = 6, 2, 32
    gen = torch.Generator().manual_seed(layers * 100 + e)
    kv = torch.randn(rows, layers * 2 * g * e + 3, generator=gen).to(torch.bfloat16).cuda()[:, 3:]
    mods = [norm_module(e, i) for i in range(layers)]
    w = torch.stack([m.weight for m in mods]).to(torch.bfloat16).cuda()
    slots = torch.tensor([5, 6, 7, 40, 41, 63], device="cuda")                # request 1's rows start at 32
    kc = torch.full((layers, r, cap, g, e), 7.0, dtype=torch.bfloat16, device="cuda")
    vc = torch.full_like(kc, -7.0)
    cos, sin = angles(rows, e, start=5)
    do.write_keys_values(kv, w, 1e-5, cos, sin, slots, kc, vc)
    untouched = torch.ones(r * cap, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    for layer, m in enumerate(mods):
        k = kv[:, layer * 2 * g * e:(layer * 2 + 1) * g * e].view(rows, g, e)
        v = kv[:, (layer * 2 + 1) * g * e:(layer + 1) * 2 * g * e].view(rows, g, e)
        kl, vl = kc[layer].view(r * cap, g, e), vc[layer].view(r * cap, g, e)
        check_norm_rope(kl[slots], *norm_rope_refs(k, m, cos, sin), f"keys, layer {layer}")
        assert torch.equal(vl[slots], v), f"values, layer {layer}"
        assert (kl[untouched] == 7.0).all() and (vl[untouched] == -7.0).all(), f"layer {layer}: other rows written"
    if layers > 1:                                      # one layer's slice, as the draft writes it
        kc1, vc1 = kc.clone(), vc.clone()
        kc1[1] = vc1[1] = 0
        do.write_keys_values(kv[:, 2 * g * e:4 * g * e], w[1:2], 1e-5, cos, sin, slots, kc1[1:2], vc1[1:2])
        assert torch.equal(kc1[1].view(-1, g, e)[slots], kc[1].view(-1, g, e)[slots])
        assert torch.equal(vc1[1].view(-1, g, e)[slots], vc[1].view(-1, g, e)[slots])
        assert torch.equal(kc1[0], kc[0]) and torch.equal(kc1[2:], kc[2:])


def attention_refs(q, kc, vc, starts, blk, scale):
    """The reference's bf16 steps (DraftAttention.forward over each request's visible rows) on the GPU and a
    float64 evaluation on the CPU: [n * B, H * E] each."""
    n, b, h, e = q.shape
    g = kc.shape[2]
    out16, out64 = [], []
    for j, s in enumerate(starts):
        qj = q[j]                                                              # [B, H, E]
        k = kc[j, :s + blk].repeat_interleave(h // g, dim=1)                   # [S, H, E]
        v = vc[j, :s + blk].repeat_interleave(h // g, dim=1)
        scores = torch.einsum("bhe,she->hbs", qj, k).float()
        p = torch.softmax(scores * scale, dim=-1).to(q.dtype)
        out16.append(torch.einsum("hbs,she->bhe", p, v).reshape(b, -1))
        q64, k64, v64 = qj.double().cpu(), k.double().cpu(), v.double().cpu()
        p64 = torch.softmax(torch.einsum("bhe,she->hbs", q64, k64) * scale, dim=-1)
        out64.append(torch.einsum("hbs,she->bhe", p64, v64).reshape(b, -1))
    return torch.cat(out16), torch.cat(out64)


def run_attention(n, b, h, g, e, starts, cap, max_keys, seed, qscale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = (qscale * torch.randn(n, b, h, e, generator=gen)).to(torch.bfloat16).cuda()
    kc = torch.randn(n + 1, cap, g, e, generator=gen).to(torch.bfloat16).cuda()
    vc = torch.randn(n + 1, cap, g, e, generator=gen).to(torch.bfloat16).cuda()
    for j, s in enumerate(starts):                       # rows past what a request sees: NaN, never read
        kc[j, s + b:] = float("nan")
        vc[j, s + b:] = float("nan")
    scale = e ** -0.5
    got = do.draft_attention(q, kc, vc, torch.tensor(starts, device="cuda"), b, max_keys, scale)
    assert got.shape == (n * b, h * e) and got.dtype == torch.bfloat16
    ref16, ref64 = attention_refs(q, kc, vc, starts, b, scale)
    err_k, err_t = rel_err(got, ref64), rel_err(ref16, ref64)
    assert err_k <= 2 * err_t + 1e-6, f"draft_attention {n}x{b} rows, H={h} G={g} E={e} starts={starts}: error " \
        f"{err_k:.3e} vs the reference bf16 steps' {err_t:.3e}"
    return got


@gpu
@pytest.mark.parametrize("n, b, h, g, e, starts, cap, max_keys", [
    (1, 8, 4, 2, 64, [300], 512, 512),                 # the trained drafter, one split
    (2, 8, 4, 2, 64, [0, 700], 1024, 1024),            # a request that sees only its own block
    (1, 8, 64, 8, 128, [3000], 4160, 4160),            # K2.6's drafter at a 3k context: 9 key splits + merge
    (2, 4, 8, 8, 32, [1500, 20], 2048, 2048),          # rep 1; one request's splits past its length stay empty
    (1, 3, 6, 2, 20, [50], 128, 128),                  # rep 3, head_dim 20: the scalar-load path
    (1, 8, 16, 4, 256, [200], 256, 256),               # head_dim 256
])
def test_draft_attention_policy(n, b, h, g, e, starts, cap, max_keys):
    run_attention(n, b, h, g, e, starts, cap, max_keys, seed=n + h + e)


@gpu
@given(n=st.integers(1, 3), b=st.integers(1, 16), g=st.sampled_from([1, 2, 8]), rep=st.sampled_from([1, 2, 4, 8]),
       e=st.sampled_from([8, 64, 128]), data=st.data())
@settings(max_examples=25, deadline=None)
def test_draft_attention_drawn(n, b, g, rep, e, data):
    cap = 2304
    starts = [data.draw(st.integers(0, cap - b), label=f"start {j}") for j in range(n)]
    qscale = data.draw(st.sampled_from([0.1, 1.0, 8.0]), label="q scale")   # 8: sharp, near one-hot rows
    run_attention(n, b, g * rep, g, e, starts, cap, cap, seed=sum(starts) + e, qscale=qscale)
    assert do._kernels.cache_info().currsize >= 1                              # the CuPy kernels ran


@gpu
@given(n=st.integers(1, 4), m=st.integers(1, 40), half=st.sampled_from([8, 32, 64]),
       amplitude=st.sampled_from([1.0, 1.2079]), data=st.data())
@settings(max_examples=30, deadline=None)
def test_rows_rope_bit_equal(n, m, half, amplitude, data):
    """Slots and angles of rows start..start+m-1 per request == the engine's _rows + rope_cos_sin, bit for bit."""
    starts = data.draw(st.lists(st.integers(0, 300_000), min_size=n, max_size=n), label="starts")
    start = torch.tensor(starts, device="cuda")
    offs = torch.arange(n, device="cuda") * 400_000
    inv = rope_inv_freq(2 * half, 50000.0).cuda()
    slots, cos, sin = do.rows_rope(start, offs, m, inv, amplitude)
    pos = (start[:, None] + torch.arange(m, device="cuda")).reshape(-1)
    want_cos, want_sin = rope_cos_sin(inv, pos, amplitude)
    assert torch.equal(slots, pos + offs.repeat_interleave(m))
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), \
        f"{(cos != want_cos).sum().item()} cos and {(sin != want_sin).sum().item()} sin values differ"


@gpu
def test_silu_mul():
    gen = torch.Generator().manual_seed(0)
    gu = (3 * torch.randn(37, 2 * 300, generator=gen)).to(torch.bfloat16).cuda()
    got = do.silu_mul(gu)
    gate, up = gu.chunk(2, -1)
    want = torch.nn.functional.silu(gate) * up
    assert got.shape == want.shape
    same = (got == want).float().mean().item()
    off = ((got.double() - want.double()).abs() / want.double().abs().clamp(min=1e-30)).max().item()
    assert same >= 0.99 and off <= 2.0 ** -7, f"silu_mul: {same:.2%} bit-equal, worst {off:.3e} relative"


@gpu
def test_gpu_bad_inputs_raise():
    q = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16, device="cuda")
    kc = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16, device="cuda")
    start = torch.zeros(1, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="max_keys"):
        do.draft_attention(q, kc, kc, start, 8, 65, 0.125)
    with pytest.raises(ValueError, match="multiple"):
        do.draft_attention(torch.zeros(1, 8, 3, 64, dtype=torch.bfloat16, device="cuda"), kc, kc, start, 8, 64, 1.)
    with pytest.raises(ValueError, match="start"):
        do.draft_attention(q, kc, kc, start.int(), 8, 64, 0.125)
    with pytest.raises(ValueError, match="contiguous"):
        do.draft_attention(q.transpose(1, 2), kc, kc, start, 8, 64, 0.125)
    with pytest.raises(ValueError, match="cos"):
        do.head_norm_rope(q[0], torch.ones(64, dtype=torch.bfloat16, device="cuda"), 1e-5,
                          torch.zeros(8, 16, device="cuda"), torch.zeros(8, 32, device="cuda"))
    with pytest.raises(ValueError, match="kv must be"):
        do.write_keys_values(torch.zeros(3, 100, dtype=torch.bfloat16, device="cuda"),
                             torch.ones(1, 64, dtype=torch.bfloat16, device="cuda"), 1e-5,
                             torch.zeros(3, 32, device="cuda"), torch.zeros(3, 32, device="cuda"),
                             torch.zeros(3, dtype=torch.long, device="cuda"), kc[None], kc[None])
