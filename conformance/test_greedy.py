"""optimized.greedy.argmax_rows == torch.argmax(-1), exactly: ties (the first index wins), NaN (counts as the
maximum, the first NaN wins), -inf rows, bf16 and fp32, aligned (16-byte loads) and unaligned rows, rows of one
block's chunk and rows split over several blocks (V > 8192 bf16 / 4096 fp32 values, a partial last chunk).

Replaces: the engine's greedy choice (`logits.argmax(-1)`) on the cuda backend. Backend: the CuPy kernel, the only
path. Tolerance: none (integer equality). CPU tests: the NVRTC build and the clear errors; GPU tests: `gpu`.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import optimized.greedy as gr
from nvrtc_build import assert_builds_without_spills


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_nvrtc_builds(arch):
    spills = assert_builds_without_spills(gr._SOURCE.read_text(), "greedy.cu", arch, gr.KERNELS.values())
    assert set(spills) == set(gr.KERNELS.values())


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="CUDA tensor"):
        gr.argmax_rows(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="CUDA tensor"):
        gr.argmax_rows(torch.zeros(2, 8, dtype=torch.float16))


@pytest.mark.gpu
@given(rows=st.integers(1, 300), v=st.sampled_from([1, 7, 37, 4096, 4099, 8193, 20001, 40960, 163840]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), offset=st.sampled_from([0, 1]),
       kind=st.sampled_from(["randn", "ties", "nan", "-inf", "few"]), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_argmax_equals_torch(rows, v, dtype, offset, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, v + offset, generator=g)
    if kind == "ties":                                  # a handful of values: many equal maxima per row
        x = torch.randint(0, 3, x.shape, generator=g).float()
    elif kind == "few":
        x = torch.randint(-2, 2, x.shape, generator=g).float() * 1e-3
    elif kind == "nan":
        x[torch.rand(x.shape, generator=g) < 0.01] = float("nan")
    elif kind == "-inf":
        x[: rows // 2] = float("-inf")
    x = x.to(dtype).cuda()[:, offset:]                  # offset 1: unaligned rows (the scalar-load path)
    assert torch.equal(gr.argmax_rows(x), x.argmax(-1)), f"rows={rows} V={v} {dtype} {kind} offset={offset}"
    assert gr._kernels.cache_info().currsize >= 1
