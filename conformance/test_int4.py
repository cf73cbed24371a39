"""reference.int4 == the compressed-tensors library's pack-quantized INT4, bit for bit."""
import pytest
import torch
from hypothesis import given, strategies as st

from reference.int4 import dequantize, pack_int4, quantize, unpack_int4

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402

shapes = st.tuples(st.integers(1, 9), st.integers(1, 12).map(lambda k: 8 * k))


@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_pack_is_bit_exact_with_compressed_tensors(shape, seed):
    q = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    ours = pack_int4(q)
    theirs = pack_to_int32(q, num_bits=4)
    assert ours.dtype == theirs.dtype == torch.int32
    assert torch.equal(ours, theirs), (ours, theirs)
    assert torch.equal(unpack_int4(theirs, shape), q)
    assert torch.equal(unpack_from_int32(ours, 4, torch.Size(shape)), q)


def test_extreme_nibbles_and_sign_bit():
    """-8 everywhere packs to 0; 7 everywhere to 0xFFFFFFFF (== -1 as int32: the sign bit is data)."""
    assert pack_int4(torch.full((1, 8), -8)).item() == 0
    assert pack_int4(torch.full((1, 8), 7)).item() == -1
    q = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]]) - 8
    assert pack_int4(q).item() == 0x76543210


@given(shape=shapes, group=st.sampled_from([8, 16, 32]), seed=st.integers(0, 2**31 - 1))
def test_quantize_dequantize_match_library(shape, group, seed):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    n, k = shape[0], -(-shape[1] // group) * group
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    g = w.float().view(n, -1, group)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    lib = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16),
                                                 "weight_zero_point": zp},
                                                QuantizationScheme(targets=["Linear"], weights=args))
    packed, ours_scale, shape_t = quantize(w, group)
    assert torch.equal(ours_scale, lib["weight_scale"]), "scales differ from the minmax observer"
    assert torch.equal(packed, lib["weight_packed"])
    assert shape_t.tolist() == lib["weight_shape"].tolist() and shape_t.dtype == torch.int64
    deq = PackedQuantizationCompressor.decompress(dict(lib), QuantizationScheme(targets=["Linear"], weights=args))
    assert torch.equal(dequantize(packed, ours_scale, shape_t, group), deq["weight"])


def test_bad_inputs():
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_int4(torch.zeros(2, 7, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.full((1, 8), 8))
    with pytest.raises(ValueError, match="int32"):
        unpack_int4(torch.zeros(1, 1, dtype=torch.int64), (1, 8))
    with pytest.raises(ValueError, match="weight_scale"):
        dequantize(torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 3), (2, 8), 8)
