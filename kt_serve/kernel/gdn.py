"""Gated DeltaNet in C++ (``kt_serve._kernel.gdn_conv_update`` / ``gdn_recurrent_step`` / ``gdn_conv_prefill`` /
``gdn_scan``; csrc/ops/gdn.h): the causal conv1d and the gated delta rule, of one new token per request (decode) and
over whole prompts (prefill), states updated in place in SGLang's mamba pools.
:mod:`kt_serve.sglang_plugin.models.qwen35_gdn` calls these for the inputs they take (bf16 activations, fp32
recurrent states, padding slots negative) and keeps its torch formulas, the readable reference, for the rest.
Each function returns None when the inputs are outside what the kernel takes.
"""

from __future__ import annotations

from typing import Optional

import torch

from kt_serve import _kernel

__all__ = ["conv_prefill", "conv_update", "recurrent_step", "scan"]

BF16 = torch.bfloat16


def _slots(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(torch.int32).contiguous()


def _conv_weight(rows: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The conv weight as [dim, K] when the ops take these inputs (bf16 rows [n, dim] with contiguous values, bf16
    conv states [slots, dim, K-1], a contiguous bf16 bias or none), else None."""
    if rows.dim() != 2 or rows.dtype != BF16 or rows.stride(1) != 1 or conv_states.dtype != BF16 \
            or weight.dtype != BF16 or (bias is not None and (bias.dtype != BF16 or not bias.is_contiguous())):
        return None
    dim, width = rows.shape[1], weight.shape[-1]
    if conv_states.dim() != 3 or conv_states.shape[1] != dim or conv_states.shape[2] != width - 1:
        return None
    w = weight.reshape(dim, width)
    return w if w.is_contiguous() else None


def conv_update(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                silu: bool, indices: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x [batch, dim] bf16; conv_states [slots, dim, K-1] bf16 (any strides); weight [dim, (1,) K] bf16; indices:
    each row's state slot (negative: padding) or None for row i -> slot i. Returns the [batch, dim] output."""
    w = _conv_weight(x, conv_states, weight, bias)
    if w is None:
        return None
    batch, dim = x.shape
    width = w.shape[1]
    idx = _slots(indices if indices is not None else torch.arange(batch))
    out = torch.empty(batch, dim, dtype=BF16)
    if batch:
        s0, s1, s2 = conv_states.stride()
        _kernel.gdn_conv_update(batch, dim, width, x.data_ptr(), x.stride(0), conv_states.data_ptr(),
                                conv_states.shape[0], s0, s1, s2, idx.data_ptr(), w.data_ptr(),
                                0 if bias is None else bias.data_ptr(), bool(silu), out.data_ptr(), dim, "auto")
    return out


def _sequences(cu_seqlens: torch.Tensor, total: int, per_sequence: dict, what: str) -> torch.Tensor:
    """cu_seqlens as int64 (checked: N + 1 offsets rising from 0 to at most ``total``); per_sequence: tensors that must
    hold one value per sequence (None: absent)."""
    cu = cu_seqlens.to(torch.int64).contiguous()
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) > total or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{what}: cu_seqlens must rise from 0 to at most the {total} tokens, got {cu.tolist()}")
    for name, t in per_sequence.items():
        if t is not None and t.numel() != cu.numel() - 1:
            raise ValueError(f"{what}: {name} holds {t.numel()} values for {cu.numel() - 1} sequences")
    return cu


def conv_prefill(rows: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 silu: bool, cu_seqlens: torch.Tensor, indices: Optional[torch.Tensor],
                 has_initial: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Sequences packed in rows [tokens, dim] bf16 (rows contiguous); conv_states [slots, dim, K-1] bf16 (any
    strides); weight [dim, (1,) K] bf16; indices: each sequence's state slot (negative: padding) or None for sequence i
    -> slot i; has_initial: whether each starts from its state (None: none does). Returns the [tokens, dim] output."""
    w = _conv_weight(rows, conv_states, weight, bias)
    if w is None:
        return None
    total, dim = rows.shape
    width = w.shape[1]
    cu = _sequences(cu_seqlens, total, {"cache_indices": indices, "has_initial_state": has_initial}, "conv prefill")
    n = cu.numel() - 1
    idx = _slots(indices if indices is not None else torch.arange(n))
    init = (has_initial if has_initial is not None else torch.zeros(n)).to(torch.uint8).contiguous()
    out = torch.empty(total, dim, dtype=BF16)
    if n:
        s0, s1, s2 = conv_states.stride()
        _kernel.gdn_conv_prefill(n, cu.data_ptr(), dim, width, rows.data_ptr(), rows.stride(0),
                                 conv_states.data_ptr(), conv_states.shape[0], s0, s1, s2, idx.data_ptr(),
                                 init.data_ptr(), w.data_ptr(), 0 if bias is None else bias.data_ptr(), bool(silu),
                                 out.data_ptr(), dim, "auto")
    return out


def _heads(t: torch.Tensor, heads: int, dim: int) -> bool:
    """t [1, batch, heads, dim] bf16 with each row's heads packed (what gdn_recurrent_step reads)."""
    return t.dtype == BF16 and t.shape[2:] == (heads, dim) and t.stride(3) == 1 and t.stride(2) == dim


def recurrent_step(A_log, dt_bias, q, k, v, a, b, states: torch.Tensor, indices: torch.Tensor, l2norm: bool,
                   softplus_beta: float, softplus_threshold: float) -> Optional[torch.Tensor]:
    """One step per request: q, k [1, batch, Hk, Dk], v [1, batch, Hv, Dv], a, b [batch, Hv] (bf16); states: the
    pool as [slots, Hv, Dk, Dv] fp32 (any strides). Returns [batch, 1, Hv, Dv] bf16."""
    if q.dim() != 4 or q.shape[0] != 1 or states.dtype != torch.float32 or states.dim() != 4:
        return None
    _, batch, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if not (_heads(q, hk, dk) and _heads(k, hk, dk) and _heads(v, hv, dv)) or k.shape[:2] != q.shape[:2] \
            or v.shape[:2] != q.shape[:2] or states.shape[1:] != (hv, dk, dv):
        return None
    if any(t.dtype != BF16 or t.shape != (batch, hv) or t.stride(1) != 1 for t in (a, b)) or hv % hk \
            or any(t.numel() != hv or t.dtype not in (BF16, torch.float32) or not t.is_contiguous()
                   for t in (A_log, dt_bias)):
        return None
    idx = _slots(indices)
    out = torch.empty(batch, 1, hv, dv, dtype=BF16)
    if batch:
        s0, s1, s2, s3 = states.stride()
        _kernel.gdn_recurrent_step(batch, hk, hv, dk, dv, q.data_ptr(), q.stride(1), k.data_ptr(), k.stride(1),
                                   v.data_ptr(), v.stride(1), a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0),
                                   A_log.data_ptr(), A_log.dtype == BF16, dt_bias.data_ptr(), dt_bias.dtype == BF16,
                                   states.data_ptr(), states.shape[0], s0, s1, s2, s3,
                                   idx.data_ptr(), bool(l2norm), float(softplus_beta), float(softplus_threshold),
                                   out.data_ptr())
    return out


def scan(query, key, value, g, beta, states: torch.Tensor, indices: Optional[torch.Tensor], cu_seqlens: torch.Tensor,
         l2norm: bool, eps: float, isa: str = "auto") -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill of sequences packed in one row: query, key [1, T, Hk, Dk], value [1, T, Hv, Dv] bf16; g [1, T, Hv]
    fp32 log decay; beta [1, T, Hv] bf16 or fp32; states: the pool as [slots, Hv, Dk, Dv] fp32 (any strides), read and
    written at indices (negative: start from zero, write nothing), or with indices None the N initial states
    themselves, left unchanged. isa: the kernel table ("auto": this CPU's best). Returns (out [1, T, Hv, Dv] bf16,
    final states [N, Hv, Dk, Dv] fp32)."""
    if query.dim() != 4 or query.shape[0] != 1 or states.dtype != torch.float32 or states.dim() != 4:
        return None
    _, total, hk, dk = query.shape
    hv, dv = value.shape[2], value.shape[3]
    if not (_heads(query, hk, dk) and _heads(key, hk, dk) and _heads(value, hv, dv)) or hv % hk \
            or key.shape[:2] != query.shape[:2] or value.shape[:2] != query.shape[:2] \
            or states.shape[1:] != (hv, dk, dv):
        return None
    if g.dtype != torch.float32 or beta.dtype not in (BF16, torch.float32) \
            or any(t.shape != (1, total, hv) or t.stride(2) != 1 for t in (g, beta)):
        return None
    cu = _sequences(cu_seqlens, total, {"initial_state_indices": indices}, "gated delta rule prefill")
    n = cu.numel() - 1
    if indices is None:  # the states are the sequences' own: scan copies, leave them as given
        if states.shape[0] != n:
            return None
        states, idx = states.clone(), torch.arange(n, dtype=torch.int32)
    else:
        idx = _slots(indices)
    out = torch.empty(1, total, hv, dv, dtype=BF16)
    final = torch.empty(n, hv, dk, dv)
    if n:
        s0, s1, s2, s3 = states.stride()
        _kernel.gdn_scan(n, cu.data_ptr(), hk, hv, dk, dv, query.data_ptr(), query.stride(1), key.data_ptr(),
                         key.stride(1), value.data_ptr(), value.stride(1), g.data_ptr(), g.stride(1), beta.data_ptr(),
                         beta.dtype == BF16, beta.stride(1), states.data_ptr(), states.shape[0], s0, s1, s2, s3,
                         idx.data_ptr(), bool(l2norm), float(eps), final.data_ptr(), out.data_ptr(), isa)
    return out, final
