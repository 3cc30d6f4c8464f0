"""kt_serve.kernel.norm.rms_norm (one C++ pass) against an fp32 torch restatement of SGLang's RMSNorm.forward_native
(bf16 inputs and weight; with and without the residual add), at decode and prefill row counts and odd widths; and
gemma_rms_norm (Qwen3.5's norms) against a restatement of GemmaRMSNorm.forward_native and through the plugin's hook
on SGLang's own module."""

from __future__ import annotations

import pytest
import torch

from kt_serve.kernel.norm import gated_rms_norm, gemma_rms_norm, rms_norm


def reference(x, w, eps, residual=None):
    s = x.float() + (residual.float() if residual is not None else 0)
    y = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.float()).bfloat16()
    return y if residual is None else (y, s.bfloat16())


def ulps(a, b):  # bf16 steps between a and b, per element
    return ((a.float() - b.float()).abs() / (b.float().abs() * 2**-7).clamp_min(1e-30)).amax().item()


@pytest.mark.parametrize("shape", [(1, 2048), (7, 100), (3, 2, 33), (512, 1024)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_forward_native(shape, with_residual):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).bfloat16()
    r = torch.randn(*shape, generator=g).bfloat16() if with_residual else None
    x0, r0 = x.clone(), None if r is None else r.clone()
    got, want = rms_norm(x, w, 1e-6, r), reference(x, w, 1e-6, r)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the new residual: bf16(x + r) exactly
        got, want = got[0], want[0]
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert ulps(got, want) <= 1.0  # one rounding step at most (fp32 sums in another order)
    assert torch.equal(x, x0) and (r is None or torch.equal(r, r0))  # inputs untouched


def test_eps_and_zero_rows():
    x = torch.zeros(2, 64).bfloat16()
    w = torch.ones(64).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-5), x)
    x[1] = 1e-3
    assert torch.equal(rms_norm(x, w, 1.0), reference(x, w, 1.0))


def test_bad_arguments_raise_clear_errors():
    w = torch.ones(16).bfloat16()
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.zeros(2, 16).bfloat16(), torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match=r"x must be .*\[\.\.\., 16\]"):
        rms_norm(torch.zeros(2, 15).bfloat16(), w, 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        rms_norm(torch.zeros(2, 16).bfloat16(), w, 1e-6, torch.zeros(3, 16).bfloat16())


def gemma_reference(x, w, eps, residual=None):
    """GemmaRMSNorm.forward_native: the residual added in bf16, then fp32 with the weight 1 + w."""
    if residual is not None:
        x = x + residual
        residual = x
    s = x.float()
    y = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).bfloat16()
    return y if residual is None else (y, residual)


@pytest.mark.parametrize("shape", [(1, 2048), (7, 100), (3, 2, 33), (512, 1024)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_matches_forward_native(shape, with_residual):
    g = torch.Generator().manual_seed(sum(shape) + 1)
    x = (torch.randn(*shape, generator=g) * 3).bfloat16()
    w = (0.1 * torch.randn(shape[-1], generator=g)).bfloat16()  # Gemma stores w, multiplies by 1 + w
    r = torch.randn(*shape, generator=g).bfloat16() if with_residual else None
    got, want = gemma_rms_norm(x, 1.0 + w.float(), 1e-6, r), gemma_reference(x, w, 1e-6, r)
    if with_residual:
        assert torch.equal(got[1], want[1])  # bf16(x + r), the sum that was normalised
        got, want = got[0], want[0]
    assert got.shape == x.shape and ulps(got, want) <= 1.0


def test_gemma_hook_on_sglang_module_follows_weight_updates():
    """The plugin's AROUND hook on SGLang's GemmaRMSNorm equals the module's forward_native, and recomputes its
    cached 1 + w when the weight is written in place (a reload)."""
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    from kt_serve.sglang_plugin.cpu_host import norm as cpu_norm

    g = torch.Generator().manual_seed(5)
    norm = GemmaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.1 * torch.randn(96, generator=g))
    x, r = torch.randn(4, 96, generator=g).bfloat16(), torch.randn(4, 96, generator=g).bfloat16()
    original = GemmaRMSNorm.forward_native
    with torch.no_grad():
        for _ in range(2):
            y, res = cpu_norm.gemma_rms_norm_forward_native(original, norm, x, r)
            want_y, want_res = original(norm, x, r)
            assert torch.equal(res, want_res) and ulps(y, want_y) <= 1.0
            assert ulps(cpu_norm.gemma_rms_norm_forward_native(original, norm, x), original(norm, x)) <= 1.0
            norm.weight.mul_(-3.0)  # the second round must see the new weight


def test_gated_bad_arguments_raise_clear_errors():
    x, z, w = torch.zeros(2, 16).bfloat16(), torch.zeros(2, 16).bfloat16(), torch.ones(16)
    with pytest.raises(ValueError, match=r"weight \(and bias\) must be fp32"):
        gated_rms_norm(x, z, w.bfloat16(), 1e-6, 16)
    with pytest.raises(ValueError, match="x and z must be bf16 with rows of 16 values"):
        gated_rms_norm(x, torch.zeros(2, 15).bfloat16(), w, 1e-6, 16)
    with pytest.raises(ValueError, match=r"the group \(5\) must divide the row \(16\)"):
        gated_rms_norm(x, z, w, 1e-6, 5)
