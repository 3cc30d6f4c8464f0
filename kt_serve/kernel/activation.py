"""The small elementwise steps around Qwen3.5's projections in C++ (``kt_serve._kernel``; csrc/ops/activation.h), with
the roundings of SGLang's CPU ops: the attention output gate, SiluAndMul, the shared expert's sigmoid gate. The one-call
decode step (:mod:`kt_serve.kernel.decode_stack`) runs the same functions, so a request's tokens are the same
whether its step ran in SGLang's layer loop (the plugin's op hooks call these) or in that call.
"""

from __future__ import annotations

from typing import Optional

import torch

from kt_serve import _kernel

__all__ = ["sigmoid_mul", "silu_mul", "shared_expert_gate_add"]

BF16 = torch.bfloat16


def _dense(t: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == BF16 and t.device.type == "cpu" and t.is_contiguous()


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> Optional[torch.Tensor]:
    """x *= sigmoid(gate) in place (both contiguous bf16 with the same number of values); None where not taken."""
    if not (_dense(x) and _dense(gate)) or x.numel() != gate.numel():
        return None
    _kernel.sigmoid_mul(x.numel(), x.data_ptr(), gate.data_ptr())
    return x


def silu_mul(gate_up: torch.Tensor) -> Optional[torch.Tensor]:
    """silu(gate_up[:, :I]) · gate_up[:, I:] for bf16 [T, 2 I] (unit-stride rows), the SiLU rounded to bf16 before
    the product as SGLang's SiluAndMul.forward_native: a new bf16 [T, I]; None where not taken."""
    if (not isinstance(gate_up, torch.Tensor) or gate_up.dtype != BF16 or gate_up.device.type != "cpu"
            or gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1):
        return None
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, I, dtype=BF16)
    if T:
        _kernel.silu_mul(T, I, gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), I, "auto")
    return out


def shared_expert_gate_add(x: torch.Tensor, weight: torch.Tensor, shared: torch.Tensor, out: torch.Tensor,
                           delta: Optional[torch.Tensor] = None) -> bool:
    """out += bf16(sigmoid(x · weight (+ delta)) · shared), in place: x, shared, out contiguous bf16 [T, H], weight
    bf16 with H values, delta fp32 with T values (the gate's LoRA) or None. False where not taken."""
    if not all(_dense(t) for t in (x, shared, out)) or x.dim() != 2 or shared.shape != x.shape or out.shape != x.shape:
        return False
    T, H = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dtype != BF16 or weight.numel() != H or not weight.is_contiguous():
        return False
    if delta is not None and (delta.dtype != torch.float32 or delta.numel() != T or not delta.is_contiguous()):
        return False
    if T:
        _kernel.shared_expert_gate_add(T, H, x.data_ptr(), weight.data_ptr(),
                                       0 if delta is None else delta.data_ptr(), shared.data_ptr(), out.data_ptr())
    return True
