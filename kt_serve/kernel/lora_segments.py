"""Segmented LoRA of SGLang's LoRA batch in C++ (``kt_serve._kernel.lora_shrink`` / ``lora_expand``;
csrc/ops/lora_segments.h): the semantics of SGLang's torch_native ``sgemm_lora_a_fwd`` / ``sgemm_lora_b_fwd`` for bf16,
one call per layer instead of a Python loop of torch ops over segments and slices. The plugin runs a CPU host's
torch_native LoRA backend through it (:mod:`kt_serve.sglang_plugin.cpu_host.lora_segments`).

Segments: ``seg_lens`` int32 [n] consecutive token counts, ``weight_indices`` int32 [n] the adapter of each,
``ranks`` int32 and ``scalings`` fp32 per adapter (rank 0: no LoRA for that segment).
"""

from __future__ import annotations

import torch

from kt_serve import _kernel

__all__ = ["lora_expand", "lora_shrink"]


def segment_args(seg_lens, weight_indices, ranks, scalings, adapters: int) -> tuple:
    """The kernel's segment arguments; their values (sums, index ranges, ranks) are checked in C++."""
    for name, t, dtype in (("seg_lens", seg_lens, torch.int32), ("weight_indices", weight_indices, torch.int32),
                           ("ranks", ranks, torch.int32), ("scalings", scalings, torch.float32)):
        if t is None and name == "scalings":
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != "cpu" or t.dim() != 1 \
                or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU {dtype} vector, got {getattr(t, 'dtype', t)}")
    n = seg_lens.numel()
    if weight_indices.numel() < n:
        raise ValueError(f"weight_indices has {weight_indices.numel()} entries for {n} segments")
    if scalings is not None and scalings.numel() < ranks.numel():
        raise ValueError(f"scalings has {scalings.numel()} entries for {ranks.numel()} ranks")
    return (n, min(adapters, ranks.numel()), seg_lens.data_ptr(), weight_indices.data_ptr(), ranks.data_ptr(),
            0 if scalings is None else scalings.data_ptr())


def _rows(x: torch.Tensor, name: str, width: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2 \
            or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(f"{name} must be a CPU bf16 tensor [T, {width}] with dense rows, got "
                         f"{getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}")


def lora_shrink(x: torch.Tensor, weights: torch.Tensor, seg_lens, weight_indices, ranks, scalings,
                num_slices: int = 1, isa: str = "auto") -> torch.Tensor:
    """``out[t, :num_slices·r] = scaling · x[t] @ weights[a, :num_slices·r]ᵀ`` for each token t of a segment with
    adapter a of rank r; zero elsewhere. x bf16 [T, K]; weights bf16 [adapters, num_slices · max_rank, K]."""
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.bfloat16 or weights.dim() != 3 \
            or not weights.is_contiguous():
        raise ValueError("weights must be a contiguous bf16 tensor [adapters, num_slices * max_rank, in]")
    A, w_rows, K = weights.shape
    _rows(x, "x", K)
    T = x.shape[0]
    seg = segment_args(seg_lens, weight_indices, ranks, scalings, A)
    out = torch.empty(T, w_rows, dtype=torch.bfloat16)
    if T:
        _kernel.lora_shrink(*seg, T, K, x.data_ptr(), x.stride(0), weights.data_ptr(), w_rows, int(num_slices),
                            out.data_ptr(), w_rows, isa)
    return out


def lora_expand(a: torch.Tensor, weights: torch.Tensor, seg_lens, weight_indices, ranks, slice_offsets,
                out: torch.Tensor, isa: str = "auto") -> torch.Tensor:
    """Adds to ``out`` bf16 [T, slice_offsets[-1]] (rows dense), in place, ``a[t, i·r:(i+1)·r] @ weights[adapter,
    off[i]:off[i+1], :r]ᵀ`` for every slice i. a bf16 [T, ≥ slices · r] (lora_shrink's output); weights bf16
    [adapters, ≥ off[-1], max_rank]; slice_offsets int [slices + 1]. Returns out."""
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.bfloat16 or weights.dim() != 3 \
            or not weights.is_contiguous():
        raise ValueError("weights must be a contiguous bf16 tensor [adapters, out, max_rank]")
    off = slice_offsets
    if not isinstance(off, torch.Tensor) or off.dtype != torch.int32 or off.device.type != "cpu" \
            or not off.is_contiguous():  # SGLang's are int32 already: no conversion per layer
        off = torch.as_tensor(off).to(device="cpu", dtype=torch.int32).contiguous()
    A, rows, max_rank = weights.shape
    slices = off.numel() - 1
    width = int(off[-1]) if slices >= 1 else -1
    if not 0 <= width <= rows:
        raise ValueError(f"slice_offsets must rise from 0 to at most the weights' {rows} rows, got {off.tolist()}")
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        raise ValueError(f"a must be a 2-D tensor, got {getattr(a, 'shape', type(a).__name__)}")
    T = a.shape[0]
    _rows(a, "a", a.shape[1])
    _rows(out, "out", width)
    if out.shape[0] != T:
        raise ValueError(f"out has {out.shape[0]} rows for {T} tokens")
    seg = segment_args(seg_lens, weight_indices, ranks, None, A)
    if T:
        _kernel.lora_expand(*seg[:5], T, a.data_ptr(), a.stride(0), weights.data_ptr(), rows, max_rank,
                            off.data_ptr(), slices, out.data_ptr(), out.stride(0), isa)
    return out
