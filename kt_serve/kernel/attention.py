"""Decode attention over a paged KV cache in one C++ call (``kt_serve._kernel.decode_attention``;
csrc/ops/attention.h).

The layout is SGLang's token-to-KV pool: K ``[slots, kv_heads, head_dim]`` and V ``[slots, kv_heads, v_head_dim]``
per layer, and ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` naming the slots of request b's context. The
plugin's CPU attention backend (:mod:`kt_serve.sglang_plugin.cpu_host.attention`) runs a CPU host's decode batches
through it instead of SGLang's torch_native loop over requests.
"""

from __future__ import annotations

import torch

from kt_serve import _kernel

__all__ = ["decode_attention", "run_decode_attention", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 1024  # csrc/isa/kernels.h kMaxHeadDim


def _check(name: str, t, dtype, dims: int):
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != "cpu" or t.dim() != dims:
        raise ValueError(f"{name} must be a CPU {dtype} tensor of {dims} dims, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def _check_heads(**tensors) -> None:
    for name, t in tensors.items():
        if t.stride(1) != t.shape[2]:
            raise ValueError(f"{name}: heads must be contiguous ([..., heads, dim] with stride dim), got {t.stride()}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, *, new_k: torch.Tensor | None = None,
                     new_v: torch.Tensor | None = None, cache_loc: torch.Tensor | None = None,
                     isa: str = "auto") -> torch.Tensor:
    """``out [B, Hq, Dv]``: each request's one query token ``q [B, Hq, D]`` (bf16) attending to its cached keys
    and values (bf16 ``k_cache [slots, Hkv, D]``, ``v_cache [slots, Hkv, Dv]``; Hq a multiple of Hkv), softmax
    in fp32 with ``scale``. ``req_to_token`` int32 ``[reqs, max_context]``; ``req_pool_indices`` and ``seq_lens``
    int64 ``[B]``. Writes into ``out`` (bf16, may be a strided view) when given. With ``new_k [B, Hkv, D]``,
    ``new_v [B, Hkv, Dv]`` (bf16) and ``cache_loc`` (int64 ``[B]``), request b's rows are first stored at cache slot
    ``cache_loc[b]`` (the decode step's KV write), then attended to like every other cached row."""
    _check("q", q, torch.bfloat16, 3)
    _check("k_cache", k_cache, torch.bfloat16, 3)
    _check("v_cache", v_cache, torch.bfloat16, 3)
    _check("req_to_token", req_to_token, torch.int32, 2)
    B, Hq, D = q.shape
    Hkv, Dv = k_cache.shape[1], v_cache.shape[2]
    if k_cache.shape[2] != D or v_cache.shape[1] != Hkv or v_cache.shape[0] != k_cache.shape[0]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} do not fit q "
                         f"{tuple(q.shape)}: expected [slots, Hkv, {D}] and [slots, Hkv, Dv]")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q has {Hq} heads, not a multiple of the cache's {Hkv} KV heads")
    if max(D, Dv) > MAX_HEAD_DIM:
        raise ValueError(f"head dims {D} / {Dv}: at most {MAX_HEAD_DIM}")
    _check_heads(q=q, k_cache=k_cache, v_cache=v_cache)
    idx = req_pool_indices.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    if idx.shape != (B,) or lens.shape != (B,):
        raise ValueError(f"req_pool_indices {tuple(idx.shape)} and seq_lens {tuple(lens.shape)} must be [{B}]")
    if B and (int(lens.max()) > req_to_token.shape[1] or int(idx.max()) >= req_to_token.shape[0]
              or int(idx.min()) < 0):
        raise ValueError(f"req_pool_indices / seq_lens out of req_to_token's {tuple(req_to_token.shape)}")
    if out is None:
        out = q.new_empty((B, Hq, Dv))
    elif out.shape != (B, Hq, Dv) or out.dtype != torch.bfloat16 or out.stride(-1) != 1 or out.stride(1) != Dv:
        raise ValueError(f"out must be bf16 [{B}, {Hq}, {Dv}] with contiguous heads, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    fresh = (new_k, new_v, cache_loc)
    if any(t is not None for t in fresh):
        if any(t is None for t in fresh):
            raise ValueError("new_k, new_v and cache_loc come together")
        _check("new_k", new_k, torch.bfloat16, 3)
        _check("new_v", new_v, torch.bfloat16, 3)
        if new_k.shape != (B, Hkv, D) or new_v.shape != (B, Hkv, Dv):
            raise ValueError(f"new_k {tuple(new_k.shape)} and new_v {tuple(new_v.shape)} must be [{B}, {Hkv}, {D}] "
                             f"and [{B}, {Hkv}, {Dv}]")
        _check_heads(new_k=new_k, new_v=new_v)
        if not isinstance(cache_loc, torch.Tensor) or cache_loc.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cache_loc must be an int32 or int64 tensor [{B}], got {type(cache_loc).__name__} "
                             f"{getattr(cache_loc, 'dtype', '')}")
        cache_loc = cache_loc.to(torch.int64).contiguous()
        if cache_loc.shape != (B,):
            raise ValueError(f"cache_loc {tuple(cache_loc.shape)} must be [{B}]")
    if B:
        run_decode_attention(q, k_cache, v_cache, req_to_token, idx, lens, scale, out, isa, new_k, new_v, cache_loc)
    return out


def run_decode_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale, out,
                         isa: str = "auto", new_k=None, new_v=None, cache_loc=None) -> None:
    """The kernel call itself, without :func:`decode_attention`'s checks: for a caller (the serving backend, once
    per layer) whose tensors already have the layout, dtypes and bounds those checks ask for; ``req_pool_indices``
    and ``seq_lens`` contiguous int64, ``out`` allocated; ``cache_loc`` (with ``new_k`` and ``new_v``) contiguous
    int64 or None. A cache slot outside the pool still raises (nothing stored)."""
    B, Hq, D = q.shape
    Hkv, Dv = k_cache.shape[1], v_cache.shape[2]
    fresh = (0, 0, 0, 0, 0) if cache_loc is None else (new_k.data_ptr(), new_k.stride(0), new_v.data_ptr(),
                                                       new_v.stride(0), cache_loc.data_ptr())
    _kernel.decode_attention(B, Hq, Hkv, D, Dv, q.data_ptr(), q.stride(0), k_cache.data_ptr(), k_cache.stride(0),
                             v_cache.data_ptr(), v_cache.stride(0), k_cache.shape[0], req_to_token.data_ptr(),
                             req_to_token.stride(0), req_pool_indices.data_ptr(), seq_lens.data_ptr(), float(scale),
                             out.data_ptr(), out.stride(0), *fresh, isa)
