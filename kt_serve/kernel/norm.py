"""RMSNorm in one C++ pass (``kt_serve._kernel.rms_norm``; csrc/ops/norm.h), the semantics of SGLang's
``RMSNorm.forward_native`` for bf16: ``s = x (+ residual)`` in fp32, the new residual ``bf16(s)``, the output
``bf16(s · rsqrt(mean(s²) + eps) · w)``. The plugin runs a CPU host's RMSNorm layers through it
(:mod:`kt_serve.sglang_plugin.cpu_host.norm`), where torch's chain of small ops costs a dispatch per op.
"""

from __future__ import annotations

from typing import Optional

import torch

from kt_serve import _kernel

__all__ = ["rms_norm", "gemma_rms_norm", "gated_rms_norm", "gemma_rms_norm_heads"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """``y`` for ``x`` bf16 ``[..., H]`` and ``weight`` bf16 ``[H]``; with ``residual`` (bf16, x's shape) also
    the new residual: returns ``(y, residual_out)``. New tensors; the inputs are not written."""
    return _norm(_kernel.rms_norm, torch.bfloat16, x, weight, eps, residual)


def gemma_rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float,
                   residual: Optional[torch.Tensor] = None):
    """Gemma's RMSNorm (SGLang's ``GemmaRMSNorm.forward_native``: Qwen3.5's layer norms): as :func:`rms_norm` with
    the fp32 weight ``1 + w`` and the residual added in bf16 before normalising."""
    return _norm(_kernel.rms_norm_gemma, torch.float32, x, weight_plus_one, eps, residual)


def gemma_rms_norm_heads(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor:
    """Gemma's RMSNorm of every head of x, in place (Qwen3.5's q_norm / k_norm): x bf16 ``[T, heads · head_dim]``
    with unit stride in its rows, weight fp32 ``1 + w`` ``[head_dim]``; fp32 throughout, one rounding. Returns x."""
    if (x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % head_dim
            or weight_plus_one.dtype != torch.float32 or tuple(weight_plus_one.shape) != (head_dim,)
            or not weight_plus_one.is_contiguous()):
        raise ValueError(f"gemma_rms_norm_heads: x bf16 [T, heads * {head_dim}] (unit-stride rows) and an fp32 "
                         f"weight [{head_dim}] expected, got {x.dtype} {tuple(x.shape)}, "
                         f"{weight_plus_one.dtype} {tuple(weight_plus_one.shape)}")
    if x.shape[0]:
        _kernel.rms_norm_heads(x.shape[0], x.shape[1] // head_dim, head_dim, x.data_ptr(), x.stride(0),
                               weight_plus_one.data_ptr(), True, float(eps))
    return x


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                   bias: Optional[torch.Tensor] = None, sigmoid_gate: bool = False) -> torch.Tensor:
    """fla's gated RMSNorm with the norm before the gate (Qwen3.5's GDN output norm): per group of ``group`` values,
    ``norm(x) · weight (+ bias)``, times ``silu(z)`` (or ``sigmoid(z)``). x bf16 ``[..., N]``, z bf16 with x's
    number of values, weight / bias fp32 ``[N]``. Returns a new bf16 tensor of x's shape."""
    N = int(weight.shape[-1]) if isinstance(weight, torch.Tensor) and weight.dim() == 1 else None
    if N is None or weight.dtype != torch.float32 or (bias is not None and (bias.dtype != torch.float32
                                                                            or bias.shape != weight.shape)):
        raise ValueError(f"weight (and bias) must be fp32 tensors [N], got {getattr(weight, 'shape', weight)}")
    if x.dtype != torch.bfloat16 or z.dtype != torch.bfloat16 or x.shape[-1] != N or z.numel() != x.numel():
        raise ValueError(f"x and z must be bf16 with rows of {N} values and as many values, got {tuple(x.shape)} "
                         f"{x.dtype} and {tuple(z.shape)} {z.dtype}")
    if group <= 0 or N % group:
        raise ValueError(f"the group ({group}) must divide the row ({N})")
    xc, zc, w = x.contiguous(), z.contiguous(), weight.contiguous()
    b = None if bias is None else bias.contiguous()
    out = torch.empty_like(xc)
    M = xc.numel() // N
    if M:
        _kernel.rms_norm_gated(M, N, int(group), xc.data_ptr(), zc.data_ptr(), w.data_ptr(),
                               0 if b is None else b.data_ptr(), float(eps), bool(sigmoid_gate), out.data_ptr(), "auto")
    return out


def _norm(kernel_fn, w_dtype, x, weight, eps, residual):
    H = int(weight.shape[-1]) if isinstance(weight, torch.Tensor) and weight.dim() == 1 else None
    if H is None or weight.dtype != w_dtype or weight.device.type != "cpu":
        raise ValueError(f"weight must be a CPU {w_dtype} tensor [H], got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != H:
        raise ValueError(f"x must be a CPU bf16 tensor [..., {H}], got {getattr(x, 'shape', type(x).__name__)}")
    if residual is not None and (residual.dtype != torch.bfloat16 or residual.shape != x.shape
                                 or residual.device.type != "cpu"):
        raise ValueError(f"residual must be a CPU bf16 tensor of x's shape {tuple(x.shape)}")
    x = x.contiguous()
    w = weight.contiguous()
    y = torch.empty_like(x)
    M = x.numel() // H
    if residual is None:
        if M:
            kernel_fn(M, H, x.data_ptr(), 0, H, w.data_ptr(), float(eps), y.data_ptr(), 0)
        return y
    r = residual.contiguous()
    r_out = torch.empty_like(x)
    if M:
        kernel_fn(M, H, x.data_ptr(), r.data_ptr(), H, w.data_ptr(), float(eps), y.data_ptr(), r_out.data_ptr())
    return y, r_out
