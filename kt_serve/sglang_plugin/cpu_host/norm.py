"""A CPU host's RMSNorm layers in one C++ pass (kt_serve/kernel/norm.py) instead of SGLang's chain of torch ops.

Without AMX, SGLang's CPU engine dispatches RMSNorm to ``forward_native``: an upcast, an add, a downcast, a square,
a mean, an rsqrt and two multiplies, each a torch dispatch; at decode that is a few percent of the step per norm
(evals/profile_decode.py). The plain bf16 configuration (no fp32 residual, no variance override, no fused
quantization) takes ours, with the same arithmetic; every other configuration keeps SGLang's. Gemma's RMSNorm
(Qwen3.5's layer norms: the weight 1 + w in fp32, the residual added in bf16) takes ours too, unless a call
brings a post-residual addition.
``--kt-cpu-ops auto|on|off``, with linear.py. :func:`fp32_weight` is shared with the gated norm (models/qwen35.py).
SiluAndMul, the elementwise step between a shared expert's projections, takes its C++ pass here too.
"""

from __future__ import annotations

import logging

import torch

from ..log import log_once

logger = logging.getLogger(__name__)


def _plain(norm, x, residual, post_residual_addition, quant_linear) -> bool:
    w = getattr(norm, "weight", None)
    return (post_residual_addition is None and quant_linear is None and isinstance(w, torch.Tensor)
            and w.dtype == torch.bfloat16 and w.device.type == "cpu" and x.dtype == torch.bfloat16
            and x.device.type == "cpu" and x.shape[-1] == norm.hidden_size == w.shape[0]
            and not getattr(norm, "fp32_residual", False) and getattr(norm, "override_orig_dtype", None) is None
            and getattr(norm, "variance_size_override", None) is None
            and not getattr(norm, "cast_x_before_out_mul", False)
            and (residual is None or (residual.dtype == torch.bfloat16 and residual.shape == x.shape)))


def rms_norm_forward_native(original, norm, x, residual=None, post_residual_addition=None, quant_linear=None):
    """AROUND RMSNorm.forward_native (registered on CPU hosts without AMX, where SGLang dispatches to it)."""
    if not _plain(norm, x, residual, post_residual_addition, quant_linear):
        return original(norm, x, residual, post_residual_addition, quant_linear)
    from kt_serve.kernel.norm import rms_norm

    log_once(logger, "RMSNorm on the kt_serve kernel (one C++ pass per call)")
    return rms_norm(x, norm.weight.data, norm.variance_epsilon, residual)


def fp32_weight(norm, plus_one: bool = False) -> torch.Tensor:
    """The norm's weight in fp32 (1 + w for Gemma's), as forward_native multiplies; computed once per weight version
    (a reload recomputes it)."""
    return fp32_weight_of(norm.weight, plus_one)


_FP32_WEIGHTS: dict = {}  # (weight address, plus_one) -> (its version, the fp32 weight)


def fp32_weight_of(w: torch.Tensor, plus_one: bool = False) -> torch.Tensor:
    """fp32_weight for a norm's weight tensor (SGLang hands some fused ops the weight, not the module)."""
    value = lambda: ((1.0 if plus_one else 0.0) + w.detach().float()).contiguous()  # noqa: E731
    if w.is_inference():  # an inference-mode tensor tracks no version: computed every call
        return value()
    key = (w.data_ptr(), plus_one)
    cached = _FP32_WEIGHTS.get(key)
    if cached is None or cached[0] != (w._version, w.shape):
        cached = _FP32_WEIGHTS[key] = ((w._version, w.shape), value())
    return cached[1]


def gemma_rms_norm_forward_native(original, norm, x, residual=None, post_residual_addition=None):
    """AROUND GemmaRMSNorm.forward_native (Qwen3.5's layer norms; registered where RMSNorm's is)."""
    w = getattr(norm, "weight", None)
    if not (post_residual_addition is None and isinstance(w, torch.Tensor) and w.device.type == "cpu"
            and x.dtype == torch.bfloat16 and x.device.type == "cpu" and w.dim() == 1 and x.shape[-1] == w.shape[0]
            and (residual is None or (residual.dtype == torch.bfloat16 and residual.shape == x.shape))):
        return original(norm, x, residual, post_residual_addition)
    from kt_serve.kernel.norm import gemma_rms_norm

    log_once(logger, "Gemma RMSNorm on the kt_serve kernel (one C++ pass per call)")
    return gemma_rms_norm(x, fp32_weight(norm, plus_one=True), norm.variance_epsilon, residual)


def silu_and_mul_forward_native(original, op, x):
    """AROUND SiluAndMul.forward_native (shared experts' and dense MLPs' activation; registered where RMSNorm's is):
    bf16 [T, 2 I] in one C++ pass with forward_native's roundings, the function the one-call decode step runs (a
    request's tokens then do not depend on which of the two ran its step)."""
    from kt_serve.kernel.activation import silu_mul

    out = silu_mul(x) if x.device.type == "cpu" and x.dim() == 2 else None
    if out is None:
        return original(op, x)
    log_once(logger, "SiluAndMul on the kt_serve kernel (one C++ pass per call)")
    return out
