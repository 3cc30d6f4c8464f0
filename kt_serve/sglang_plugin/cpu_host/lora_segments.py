"""A CPU host's dense-layer LoRA (SGLang's torch_native LoRA backend) in C++: kt_serve/kernel/lora_segments.py.

SGLang's torch_native backend, the one its CPU engine runs, computes a LoRA layer as a Python loop over the batch's
segments (one per run of requests with the same adapter) and, in the expand, over the layer's slices (q, k, v),
each step an addmm with a few indexing ops and a ``.item()``: at 8 decode streams with mixed adapters about a
hundred torch dispatches per LoRA layer, each run cold after the weight streams (evals/bench_serving.py's "kt
mixed" rows). Its two primitives become one C++ call each, with the same arithmetic (fp32 sums, one bf16 rounding
per output); batches it does not take (CUDA-graph batch info, non-bf16 tensors) keep SGLang's. ``--kt-cpu-ops``.
"""

from __future__ import annotations

import logging

import torch

from ..log import log_once

logger = logging.getLogger(__name__)


def _plain(inputs, weights, batch_info) -> bool:
    return (not batch_info.use_cuda_graph and batch_info.seg_lens_cpu is not None
            and isinstance(inputs, torch.Tensor) and inputs.dtype == torch.bfloat16 and inputs.device.type == "cpu"
            and inputs.dim() == 2 and inputs.stride(1) == 1
            and isinstance(weights, torch.Tensor) and weights.dtype == torch.bfloat16 and weights.dim() == 3
            and weights.device.type == "cpu" and weights.numel() > 0 and weights.is_contiguous())


def _log_taken():
    log_once(logger, "dense-layer LoRA on the kt_serve kernel (segmented, one C++ call per shrink / expand)")


def sgemm_lora_a_fwd(original, inputs, weights, batch_info, num_slices=1):
    """AROUND torch_backend.sgemm_lora_a_fwd (the shrink)."""
    if not _plain(inputs, weights, batch_info):
        return original(inputs, weights, batch_info, num_slices)
    from kt_serve.kernel.lora_segments import lora_shrink

    _log_taken()
    return lora_shrink(inputs, weights, batch_info.seg_lens_cpu, batch_info.weight_indices_cpu,
                       batch_info.lora_ranks_cpu, batch_info.scalings_cpu, num_slices)


def sgemm_lora_b_fwd(original, inputs, weights, batch_info, slice_offsets, base_output=None):
    """AROUND torch_backend.sgemm_lora_b_fwd (the expand, added to the base output)."""
    width = int(slice_offsets[-1]) if len(slice_offsets) else 0
    if not _plain(inputs, weights, batch_info) or (base_output is not None and (
            base_output.dtype != torch.bfloat16 or base_output.dim() != 2 or base_output.shape[1] != width
            or base_output.stride(1) != 1 or base_output.device.type != "cpu")):
        return original(inputs, weights, batch_info, slice_offsets, base_output)
    from kt_serve.kernel.lora_segments import lora_expand

    _log_taken()
    out = base_output if base_output is not None else torch.zeros(inputs.shape[0], width, dtype=torch.bfloat16)
    return lora_expand(inputs, weights, batch_info.seg_lens_cpu, batch_info.weight_indices_cpu,
                       batch_info.lora_ranks_cpu, slice_offsets, out)
