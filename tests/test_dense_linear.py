"""PackedLinear (the kernel's dense GEMV/GEMM, kt_serve/kernel/linear.py) against fp32 torch: y = x Wᵀ + b with W the
bf16 weight, or for a quantized format its dequantized values by the independent rules of tests/quant_reference.py.
Every format × every kernel table on this CPU, odd shapes (N, K not multiples of 64 or 32), row counts on both
sides of the decode / many-row split, strided and 3-D inputs, bias, both output dtypes."""

from __future__ import annotations

import pytest
import torch

from kt_serve.kernel.linear import PackedLinear
from quant_reference import ref_quantize
from test_kernel import ISAS

FORMATS = ("bf16", "int8", "int4", "fp8")
SHAPES = [(1, 64), (65, 31), (130, 200), (300, 1000), (64, 2048)]  # (N, K)
ROWS = (1, 2, 3, 4, 7, 64, 65, 200)


def rel_l2(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def reference(x, w, b, fmt):
    W = ref_quantize(w.bfloat16().float(), fmt)
    y = x.float() @ W.T
    return y if b is None else y + b.float()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_matches_torch(isa, fmt):
    g = torch.Generator().manual_seed(7)
    for N, K in SHAPES:
        w = torch.randn(N, K, generator=g) * 0.05
        b = torch.randn(N, generator=g)
        lin = PackedLinear(w.bfloat16(), b, weight_format=fmt, isa=isa)
        assert lin.isa == isa and lin.weight_format == fmt
        for M in ROWS:
            x = torch.randn(M, K, generator=g).bfloat16()
            ref = reference(x, w, b, fmt)
            y32 = lin(x, out_dtype=torch.float32)
            # the int formats also quantize x (int16 per row, below bf16's own rounding)
            assert rel_l2(y32, ref) < (1e-5 if fmt in ("bf16", "fp8") else 1e-3), (N, K, M)
            y16 = lin(x)
            assert y16.dtype == torch.bfloat16 and rel_l2(y16, ref) < 1e-2, (N, K, M)
            assert rel_l2(lin(x, with_bias=False, out_dtype=torch.float32), ref - b) < 1e-3, (N, K, M)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_weight_follows_the_quantization_rules(fmt):
    w = torch.randn(70, 130, generator=torch.Generator().manual_seed(1)) * 0.1
    lin = PackedLinear(w.bfloat16(), weight_format=fmt)
    ref = ref_quantize(w.bfloat16().float(), fmt)
    assert torch.allclose(lin.dequantized(), ref, rtol=1e-6, atol=1e-7)


def test_strided_and_batched_inputs():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 80, generator=g) * 0.05, torch.randn(96, generator=g)
    lin = PackedLinear(w.bfloat16(), b)
    wide = torch.randn(5, 200, generator=g).bfloat16()
    x = wide[:, 40:120]  # rows 200 values apart
    assert rel_l2(lin(x, out_dtype=torch.float32), reference(x, w, b, "bf16")) < 1e-5
    x3 = torch.randn(2, 3, 80, generator=g).bfloat16()
    y3 = lin(x3, out_dtype=torch.float32)
    assert y3.shape == (2, 3, 96)
    assert rel_l2(y3, reference(x3.reshape(6, 80), w, b, "bf16").reshape(2, 3, 96)) < 1e-5
    assert lin(torch.empty(0, 80).bfloat16()).shape == (0, 96)


def test_the_weight_is_copied():
    w = torch.randn(64, 64).bfloat16()
    lin = PackedLinear(w)
    x = torch.randn(2, 64).bfloat16()
    ref = reference(x, w.float(), None, "bf16")
    w.zero_()
    assert rel_l2(lin(x, out_dtype=torch.float32), ref) < 1e-5


def test_bad_arguments_raise_clear_errors():
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(ValueError, match="2-D"):
        PackedLinear(torch.randn(8))
    with pytest.raises(ValueError, match="weight_format"):
        PackedLinear(w, weight_format="int3")
    with pytest.raises(ValueError, match="bias has shape"):
        PackedLinear(w, torch.zeros(9))
    lin = PackedLinear(w)
    with pytest.raises(ValueError, match=r"\[\.\.\., 16\]"):
        lin(torch.randn(2, 15).bfloat16())
    with pytest.raises(ValueError, match="CPU bf16"):
        lin(torch.randn(2, 16))
