"""Rotary position embedding in one C++ pass (``kt_serve._kernel.rotary_embedding``; csrc/ops/rotary.h), the semantics
of SGLang's ``RotaryEmbedding.forward_native`` for bf16 q / k with fp32 math and one rounding (forward_native
rounds to bf16 after each multiply), in place like SGLang's accelerator paths (forward_cuda, sgl-kernel's CPU op).
The plugin runs a CPU host's rotary layers through it (:mod:`kt_serve.sglang_plugin.cpu_host.rotary`), where torch's
chain of small ops costs a dispatch per op; at decode this wrapper's own work is a few checks and one call.
"""

from __future__ import annotations

import torch

from kt_serve import _kernel

__all__ = ["qk_norm_rope", "rotary_embedding"]


def _row_stride(x: torch.Tensor, name: str, T: int, head_size: int) -> int:
    """Distance between x's token rows, for x [T, heads * head_size] or [T, heads, head_size] with dense heads."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU bf16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() not in (2, 3) or x.shape[0] != T or x.shape[-1] % head_size or (x.dim() == 3 and x.shape[-1] != head_size):
        raise ValueError(f"{name} of shape {tuple(x.shape)} is not [{T}, heads * {head_size}] for {T} positions")
    if x.stride(-1) != 1 or (x.dim() == 3 and x.shape[1] > 1 and x.stride(1) != head_size):
        raise ValueError(f"{name}: the heads of a token must be dense (strides {x.stride()})")
    return x.stride(0)


def _cache_and_positions(cos_sin_cache, positions, rotary_dim: int, head_size: int):
    """(positions as contiguous int64, number of positions) after checking the cache's and the rotary's shape."""
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        raise ValueError(f"rotary_dim must be even and in (0, head_size={head_size}], got {rotary_dim}")
    if (not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2
            or cos_sin_cache.shape[1] != rotary_dim or cos_sin_cache.device.type != "cpu"
            or not cos_sin_cache.is_contiguous()):
        raise ValueError(f"cos_sin_cache must be a contiguous CPU fp32 tensor [max_position, {rotary_dim}], got "
                         f"{getattr(cos_sin_cache, 'dtype', None)} {tuple(getattr(cos_sin_cache, 'shape', ()))}")
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be an integer tensor, got {getattr(positions, 'dtype', None)}")
    pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() else \
        positions.to(torch.int64).contiguous()
    return pos, pos.numel()


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_heads: int, kv_heads: int, head_size: int,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float, k_eps: float,
                 cos_sin_cache: torch.Tensor, is_neox_style: bool, rotary_dim: int | None = None):
    """Qwen3 attention's q / k preparation in one call, in place in ``qkv`` (bf16 [T, (q_heads + 2 kv_heads) *
    head_size], rows any distance apart): each q head RMSNormed by ``q_weight`` (bf16 [head_size]), each k head by
    ``k_weight``, as SGLang's RMSNorm computes them, then :func:`rotary_embedding` of both. Returns the q, k, v
    views of qkv."""
    rotary_dim = head_size if rotary_dim is None else int(rotary_dim)
    pos, T = _cache_and_positions(cos_sin_cache, positions, rotary_dim, head_size)
    q_size, kv_size = q_heads * head_size, kv_heads * head_size
    if (not isinstance(qkv, torch.Tensor) or qkv.dtype != torch.bfloat16 or qkv.device.type != "cpu" or qkv.dim() != 2
            or qkv.shape != (T, q_size + 2 * kv_size) or qkv.stride(-1) != 1):
        raise ValueError(f"qkv must be a CPU bf16 tensor [{T}, {q_size + 2 * kv_size}] with dense rows, got "
                         f"{getattr(qkv, 'dtype', None)} {tuple(getattr(qkv, 'shape', ()))}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if (not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.shape != (head_size,)
                or w.device.type != "cpu" or not w.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous CPU bf16 tensor [{head_size}]")
    if T:
        _kernel.qk_norm_rope(T, qkv.data_ptr(), qkv.stride(0), q_heads, kv_heads, head_size, q_weight.data_ptr(),
                             k_weight.data_ptr(), float(q_eps), float(k_eps), pos.data_ptr(), cos_sin_cache.data_ptr(),
                             cos_sin_cache.shape[0], rotary_dim, bool(is_neox_style))
    return qkv.split([q_size, kv_size, kv_size], dim=-1)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox_style: bool, rotary_dim: int | None = None):
    """Rotates query and key in place and returns them. positions: int64 [T] (any shape of T values); query / key
    bf16 [T, heads * head_size] or [T, heads, head_size], token rows any distance apart (views into qkv);
    cos_sin_cache fp32 [max_position, rotary_dim]: cos in the first half of a row, sin in the second."""
    rotary_dim = head_size if rotary_dim is None else int(rotary_dim)
    pos, T = _cache_and_positions(cos_sin_cache, positions, rotary_dim, head_size)
    q_ld, k_ld = _row_stride(query, "query", T, head_size), _row_stride(key, "key", T, head_size)
    if T:
        q_heads, k_heads = query[0].numel() // head_size, key[0].numel() // head_size
        _kernel.rotary_embedding(T, pos.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], rotary_dim,
                                 head_size, bool(is_neox_style), query.data_ptr(), q_ld, q_heads, key.data_ptr(), k_ld,
                                 k_heads)
    return query, key
