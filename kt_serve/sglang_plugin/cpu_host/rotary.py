"""A CPU host's rotary position embedding in one C++ pass (kt_serve/kernel/rotary.py) instead of SGLang's chain of ops.

Without AMX, SGLang's CPU engine runs ``RotaryEmbedding.forward_native``: an index_select of the cache, chunks,
slices, casts, four products, two sums and three concatenations for q and again for k, each a torch dispatch, about
a tenth of a small model's decode step (evals/profile_decode.py). The plain configuration (bf16 q / k, the cache
indexed by position, no offsets, no fused KV write) takes ours, in place as SGLang's accelerator paths rotate
(forward_cuda), with fp32 math on an fp32 cache: on a CPU host
SGLang keeps the cache in bf16 (and multiplies in bf16), so the module's own ``_compute_cos_sin_cache`` is run once
more in fp32 and kept beside it. Every other configuration keeps SGLang's.
Subclasses with a forward_native of their own (DeepSeek's YaRN) are not touched; mRoPE (Qwen3.5) takes ours for text
positions. ``--kt-cpu-ops``, with
norm.py and linear.py.
"""

from __future__ import annotations

import logging

import torch

from ..log import log_once

logger = logging.getLogger(__name__)


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


def fp32_cos_sin_cache(rope) -> torch.Tensor:
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
    from kt_serve.kernel.rotary import rotary_embedding

    log_once(logger, "rotary embedding on the kt_serve kernel (one C++ pass per call)")
    return rotary_embedding(positions, query, key, rope.head_size, fp32_cos_sin_cache(rope), rope.is_neox_style,
                            rope.rotary_dim)


def text_positions(positions: torch.Tensor):
    """A multimodal rotary's positions as one row per token: 1-D as they are, [3, T] where its three sections agree
    (text tokens, every decode token); None where they differ (image or video tokens)."""
    if positions.dim() == 2 and positions.shape[0] == 3:
        if not (torch.equal(positions[0], positions[1]) and torch.equal(positions[0], positions[2])):
            return None
        return positions[0]
    return positions if positions.dim() == 1 else None


def mrope_forward_native(original, rope, positions, query, key, fused_set_kv_buffer_arg=None):
    """AROUND MRotaryEmbedding.forward_native (Qwen3.5's rotary, registered where RotaryEmbedding's is): text
    positions rotate as a plain rotary, on the kernel in fp32 as the one-call decode step does (SGLang's own
    multiplies the bf16 cache in bf16); image and video positions keep SGLang's sections."""
    rows = text_positions(positions) if isinstance(positions, torch.Tensor) else None
    if rows is None or rows.numel() == 0 or not _plain(rope, rows, query, key, None, fused_set_kv_buffer_arg):
        return original(rope, positions, query, key, fused_set_kv_buffer_arg)
    from kt_serve.kernel.rotary import rotary_embedding

    log_once(logger, "multimodal rotary embedding of text positions on the kt_serve kernel (one C++ pass per call)")
    return rotary_embedding(rows, query, key, rope.head_size, fp32_cos_sin_cache(rope), rope.is_neox_style,
                            rope.rotary_dim)


_QK_PLAN = "_kt_qk_norm_rope"  # on the attention module: True when qk_norm_rope runs it, else False


def plain_norm(norm, head_dim: int) -> bool:
    """A plain bf16 RMSNorm over head_dim values (the class whose forward_native norm.py replaces, not a subclass)."""
    from sglang.srt.layers.layernorm import RMSNorm

    w = getattr(norm, "weight", None)
    return (type(norm) is RMSNorm and isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16
            and w.device.type == "cpu" and w.shape == (head_dim,) and w.is_contiguous()
            and norm.hidden_size == head_dim and not getattr(norm, "fp32_residual", False)
            and getattr(norm, "override_orig_dtype", None) is None
            and getattr(norm, "variance_size_override", None) is None
            and not getattr(norm, "cast_x_before_out_mul", False))


def _qk_plan(attn, forward_batch) -> bool:
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
    from sglang.srt.models.utils import enable_fused_set_kv_buffer

    rope = getattr(attn, "rotary_emb", None)
    cache = getattr(rope, "cos_sin_cache", None)
    return (not getattr(attn, "use_fused_qk_norm_rope", False) and not getattr(attn, "use_fused_qk_norm_rope_cpu", False)
            and plain_norm(attn.q_norm, attn.head_dim) and plain_norm(attn.k_norm, attn.head_dim)
            and isinstance(rope, RotaryEmbedding) and type(rope).forward_native is RotaryEmbedding.forward_native
            and not hasattr(rope, "sin_cos_cache") and rope.head_size == attn.head_dim
            and isinstance(cache, torch.Tensor) and cache.dim() == 2 and cache.device.type == "cpu"
            and cache.shape[1] == rope.rotary_dim and rope.rotary_dim % 2 == 0
            and not (attn.compatible_with_fused_kv_buffer and enable_fused_set_kv_buffer(forward_batch)))


def qk_plan(attn, forward_batch) -> bool:
    """Whether qk_norm_rope runs this attention module's q / k norm and rotary (worked out once per module)."""
    plan = getattr(attn, _QK_PLAN, None)
    if plan is None:
        plan = _qk_plan(attn, forward_batch)
        setattr(attn, _QK_PLAN, plan)
    return plan


def apply_qk_norm_rope(original, attn, qkv, positions, forward_batch):
    """AROUND Qwen3MoeAttention.apply_qk_norm_rope: the split, q_norm / k_norm per head and rotary of a CPU host's
    attention in one C++ call (kt_serve.kernel.rotary.qk_norm_rope) instead of SGLang's split, two RMSNorm modules and
    the rotary module, each a run of Python and dispatch that a decode step pays cold after the weight streams."""
    if (not qk_plan(attn, forward_batch) or qkv.dtype != torch.bfloat16 or qkv.device.type != "cpu" or qkv.dim() != 2
            or qkv.stride(-1) != 1 or qkv.shape[0] == 0 or not isinstance(positions, torch.Tensor)
            or positions.numel() != qkv.shape[0]):
        return original(attn, qkv, positions, forward_batch)
    from kt_serve.kernel.rotary import qk_norm_rope

    log_once(logger, "q / k norm and rotary embedding on the kt_serve kernel (one C++ call per layer)")
    rope = attn.rotary_emb
    attn._used_fused_qk_norm_rope_last_call = False  # forward_core then writes the KV cache itself
    return qk_norm_rope(qkv, positions, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.q_norm.weight,
                        attn.k_norm.weight, attn.q_norm.variance_epsilon, attn.k_norm.variance_epsilon,
                        fp32_cos_sin_cache(rope), rope.is_neox_style, rope.rotary_dim)
