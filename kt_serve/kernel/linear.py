"""Dense linear layers on the kernel's packed weights (``kt_serve._kernel.PackedLinear``).

``y = x Wᵀ + b`` with W packed once in one of the kernel's formats (bf16, int8, int4, fp8; see
:mod:`kt_serve.kernel.weights`). A decode step's few rows stream W through the same microkernels as the routed
experts, at the read bandwidth the MoE layers reach, where torch's bf16 GEMV on a CPU reaches about half of it.
The SGLang plugin serves a CPU host's unquantized linear layers and lm_head through it
(:mod:`kt_serve.sglang_plugin.cpu_host.linear`).
"""

from __future__ import annotations

from typing import Optional

import torch

from kt_serve import _kernel
from kt_serve.kernel.weights import WEIGHT_FORMATS

__all__ = ["PackedLinear"]


class PackedLinear:
    """One ``[out_features, in_features]`` weight (and optional bias), packed in ``weight_format``.

    ``forward(x)`` takes bf16 ``[..., in_features]`` on the CPU (any leading shape, rows may be strided) and
    returns ``[..., out_features]`` in bf16, or fp32 with ``out_dtype=torch.float32`` (the sum is fp32 either way,
    the bias added in fp32 unless ``with_bias=False``, rounded once). The caller may free its weight afterwards.
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, weight_format: str = "bf16",
                 group_size: int = 128, isa: str = "auto"):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D tensor [out, in], got {getattr(weight, 'shape', type(weight))}")
        if not weight.is_floating_point():
            raise ValueError(f"weight must be a floating-point tensor, got {weight.dtype}")
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
        w = weight.detach().to(device="cpu", dtype=torch.bfloat16)
        if w.stride(1) != 1:
            w = w.contiguous()
        N, K = w.shape
        if N == 0 or K == 0:
            raise ValueError(f"weight has an empty shape {tuple(w.shape)}")
        # the C++ object (csrc); other kernel calls that take this one read it here
        self.native = _kernel.PackedLinear(N, K, w.data_ptr(), w.stride(0), format=weight_format,
                                      group=int(group_size), isa=isa)
        self.out_features, self.in_features = int(N), int(K)
        self.bias: Optional[torch.Tensor] = None
        if bias is not None:
            if tuple(bias.shape) != (N,):
                raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({N},)")
            self.bias = bias.detach().to(device="cpu", dtype=torch.float32).contiguous()

    @property
    def weight_format(self) -> str:
        return self.native.format

    @property
    def weight_bytes(self) -> int:
        return self.native.weight_bytes

    @property
    def isa(self) -> str:
        return self.native.isa

    def dequantized(self) -> torch.Tensor:
        """W as the kernel holds it, fp32 ``[out, in]`` (slow: for tests)."""
        return torch.tensor([[self.native.at(n, k) for k in range(self.in_features)] for n in range(self.out_features)])

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, with_bias: bool = True) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must be [..., {self.in_features}], got {getattr(x, 'shape', type(x).__name__)}")
        if x.device.type != "cpu" or x.dtype != torch.bfloat16:
            raise ValueError(f"x must be a CPU bf16 tensor, got {x.dtype} on {x.device}")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] and rows.stride(1) != 1:
            rows = rows.contiguous()
        M = int(rows.shape[0])
        y = torch.empty((M, self.out_features), dtype=out_dtype)
        if M:
            bias_ptr = self.bias.data_ptr() if self.bias is not None and with_bias else 0
            self.native.forward(M, rows.data_ptr(), rows.stride(0), bias_ptr, y.data_ptr(), self.out_features,
                                out_dtype == torch.float32)
        return y.reshape(*lead, self.out_features)

    __call__ = forward
