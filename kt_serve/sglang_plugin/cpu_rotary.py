"""A CPU host's rotary position embedding in one C++ pass (kt_serve/rotary.py) instead of SGLang's chain of ops.

Without AMX, SGLang's CPU engine runs ``RotaryEmbedding.forward_native``: an index_select of the cache, chunks,
slices, casts, four products, two sums and three concatenations for q and again for k, each a torch dispatch, about
a tenth of a small model's decode step (evals/profile_decode.py). The plain configuration (bf16 q / k, the cache
indexed by position, no offsets, no fused KV write) takes ours, in place as SGLang's accelerator paths rotate
(forward_cuda), with fp32 math on an fp32 cache: on a CPU host
SGLang keeps the cache in bf16 (and multiplies in bf16), so the module's own ``_compute_cos_sin_cache`` is run once
more in fp32 and kept beside it. Every other configuration keeps SGLang's.
Subclasses with a forward_native of their own (DeepSeek's YaRN, mRoPE) are not touched. ``--kt-cpu-ops``, with
cpu_norm.py and dense_linear.py.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)
ROTARY_EMBEDDING = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding"
_logged = False


def _plain(rope, positions, query, key, offsets, fused_set_kv_buffer_arg) -> bool:
    cache = getattr(rope, "cos_sin_cache", None)
    rotary_dim, head_size = getattr(rope, "rotary_dim", None), getattr(rope, "head_size", None)
    return (offsets is None and fused_set_kv_buffer_arg is None and not hasattr(rope, "sin_cos_cache")
            and isinstance(cache, torch.Tensor) and cache.dtype in (torch.float32, torch.bfloat16)
            and cache.device.type == "cpu"
            and cache.dim() == 2 and isinstance(rotary_dim, int) and isinstance(head_size, int)
            and cache.shape[1] == rotary_dim and rotary_dim % 2 == 0 and 0 < rotary_dim <= head_size
            and isinstance(positions, torch.Tensor) and positions.dtype in (torch.int32, torch.int64)
            and all(isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                    and x.dim() >= 2 and x.shape[0] == positions.numel() and x.numel() % (x.shape[0] * head_size) == 0
                    for x in (query, key)))


def _fp32_cache(rope) -> torch.Tensor:
    """The module's cos/sin cache in fp32, computed once (SGLang's own is bf16 on a CPU host)."""
    cache = rope.__dict__.get("_kt_cos_sin_fp32")
    if cache is None or cache.shape != rope.cos_sin_cache.shape:
        cache = rope.cos_sin_cache.contiguous()
        if cache.dtype != torch.float32:
            exact = rope._compute_cos_sin_cache() if hasattr(rope, "_compute_cos_sin_cache") else None
            fits = isinstance(exact, torch.Tensor) and exact.shape == cache.shape
            cache = exact.float().contiguous() if fits else cache.float().contiguous()
        rope.__dict__["_kt_cos_sin_fp32"] = cache
    return cache


def rotary_forward_native(original, rope, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
    """AROUND RotaryEmbedding.forward_native (registered on CPU hosts without AMX, where SGLang dispatches to it)."""
    if not _plain(rope, positions, query, key, offsets, fused_set_kv_buffer_arg) or positions.numel() == 0:
        return original(rope, positions, query, key, offsets, fused_set_kv_buffer_arg)
    from kt_serve.rotary import rotary_embedding

    global _logged
    if not _logged:
        _logged = True
        logger.info("kt_serve: rotary embedding on the kt_serve kernel (one C++ pass per call)")
    return rotary_embedding(positions, query, key, rope.head_size, _fp32_cache(rope), rope.is_neox_style,
                            rope.rotary_dim)
