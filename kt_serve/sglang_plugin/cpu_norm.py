"""A CPU host's RMSNorm layers in one C++ pass (kt_serve/norm.py) instead of SGLang's chain of torch ops.

Without AMX, SGLang's CPU engine dispatches RMSNorm to ``forward_native``: an upcast, an add, a downcast, a square,
a mean, an rsqrt and two multiplies, each a torch dispatch; at decode that is a few percent of the step per norm
(evals/profile_decode.py). The plain bf16 configuration (no fp32 residual, no variance override, no fused
quantization) takes ours, with the same arithmetic; every other configuration keeps SGLang's.
``--kt-cpu-ops auto|on|off``, with dense_linear.py.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)
RMS_NORM = "sglang.srt.layers.layernorm.RMSNorm"
_logged = False


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
    from kt_serve.norm import rms_norm

    global _logged
    if not _logged:
        _logged = True
        logger.info("kt_serve: RMSNorm on the kt_serve kernel (one C++ pass per call)")
    return rms_norm(x, norm.weight.data, norm.variance_epsilon, residual)
