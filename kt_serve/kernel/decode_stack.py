"""A Qwen3-MoE decoder stack's decode step in one C++ call (``kt_serve._kernel.DecodeStack``; csrc/ops/decode_stack.h).

Per layer: input RMSNorm (+ residual), qkv projection, per-head q / k RMSNorm and rotary, attention over the paged
KV cache (the step's K and V stored at their slots first), o projection, post-attention RMSNorm (+ residual) and
the MoE block (router gate, softmax top-k, routed experts with their expert-LoRA slots); then the final RMSNorm.
The same kernel ops as :mod:`kt_serve.kernel.norm`, :class:`kt_serve.kernel.linear.PackedLinear`,
:mod:`kt_serve.kernel.rotary`, :mod:`kt_serve.kernel.attention` and
:meth:`kt_serve.kernel.experts.MoEExperts.forward_routed`, in SGLang's order: a CPU decode
step pays no Python between them (:mod:`kt_serve.sglang_plugin.cpu_host.decode_stack` serves Qwen3-MoE decode batches
through it).
"""

from __future__ import annotations

from typing import Union

import torch

from kt_serve import _kernel
from kt_serve.kernel.linear import PackedLinear
from kt_serve.kernel.experts import MoEExperts
from kt_serve.kernel.lora_segments import segment_args

__all__ = ["DecodeStack"]


def _vector(name: str, t, n: int, dtype=torch.bfloat16) -> torch.Tensor:
    if (not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != "cpu" or tuple(t.shape) != (n,)
            or not t.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor [{n}], got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    return t


def _cache(name: str, t, kv_heads: int, head_dim: int) -> torch.Tensor:
    if (not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.dim() != 3
            or t.shape[1:] != (kv_heads, head_dim) or t.stride(2) != 1 or t.stride(1) != head_dim):
        raise ValueError(f"{name} must be a CPU bf16 tensor [slots, {kv_heads}, {head_dim}] with dense heads, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    return t


def _bias(layer: PackedLinear) -> int:
    return layer.bias.data_ptr() if layer.bias is not None else 0


class DecodeStack:
    """The decoder layers of one model, added in order with :meth:`add_layer`; :meth:`forward` runs a decode step.

    It holds the tensors it was given (norm weights, cos/sin caches, KV caches): they must not be replaced while it
    is in use (SGLang allocates its KV pool once)."""

    def __init__(self, hidden: int, q_heads: int, kv_heads: int, head_dim: int, final_norm: torch.Tensor,
                 final_eps: float, isa: str = "auto"):
        self.hidden, self.q_heads, self.kv_heads, self.head_dim = int(hidden), int(q_heads), int(kv_heads), int(head_dim)
        self._tensors = [_vector("final_norm", final_norm, self.hidden)]
        # the C++ object (csrc); other kernel calls that take this one read it here
        self.native = _kernel.DecodeStack(self.hidden, self.q_heads, self.kv_heads, self.head_dim,
                                          final_norm.data_ptr(), float(final_eps), isa)
        self._experts: list[MoEExperts] = []
        self._max_tokens = None  # the fewest tokens any layer's experts take

    @property
    def num_layers(self) -> int:
        return self.native.num_layers

    def add_layer(self, *, input_norm: torch.Tensor, input_eps: float, qkv: PackedLinear, q_norm: torch.Tensor,
                  q_eps: float, k_norm: torch.Tensor, k_eps: float, cos_sin: torch.Tensor, rotary_dim: int,
                  neox: bool, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, o_proj: PackedLinear,
                  post_norm: torch.Tensor, post_eps: float, gate: PackedLinear, experts: MoEExperts, top_k: int,
                  renormalize: bool) -> None:
        """One layer: norms bf16 [hidden] (q / k norms [head_dim]); cos_sin fp32 [max_position, rotary_dim] (cos
        then sin, :func:`kt_serve.kernel.rotary.rotary_embedding`); k_cache / v_cache bf16 [slots, kv_heads, head_dim];
        gate a PackedLinear [experts, hidden] without bias."""
        H, D = self.hidden, self.head_dim
        norms = [_vector("input_norm", input_norm, H), _vector("post_norm", post_norm, H),
                 _vector("q_norm", q_norm, D), _vector("k_norm", k_norm, D)]
        if (not isinstance(cos_sin, torch.Tensor) or cos_sin.dtype != torch.float32 or cos_sin.dim() != 2
                or cos_sin.shape[1] != rotary_dim or not cos_sin.is_contiguous()):
            raise ValueError(f"cos_sin must be a contiguous fp32 tensor [max_position, {rotary_dim}]")
        k_cache, v_cache = _cache("k_cache", k_cache, self.kv_heads, D), _cache("v_cache", v_cache, self.kv_heads, D)
        if k_cache.shape[0] != v_cache.shape[0]:
            raise ValueError(f"k_cache has {k_cache.shape[0]} slots, v_cache {v_cache.shape[0]}")
        if gate.bias is not None:
            raise ValueError("the router gate must have no bias")
        self.native.add_layer(input_norm.data_ptr(), float(input_eps), qkv.native, _bias(qkv), q_norm.data_ptr(),
                              float(q_eps), k_norm.data_ptr(), float(k_eps), cos_sin.data_ptr(), cos_sin.shape[0],
                              int(rotary_dim), bool(neox), k_cache.data_ptr(), k_cache.stride(0), v_cache.data_ptr(),
                              v_cache.stride(0), k_cache.shape[0], float(scale), o_proj.native, _bias(o_proj),
                              post_norm.data_ptr(), float(post_eps), gate.native, experts.native, int(top_k),
                              bool(renormalize))
        self._tensors += [*norms, cos_sin, k_cache, v_cache] + [b for b in (qkv.bias, o_proj.bias) if b is not None]
        self._experts.append(experts)
        self._max_tokens = min(self._max_tokens or experts.max_tokens, experts.max_tokens)

    def set_lora(self, layer: int, *, qkv=None, o=None) -> None:
        """SGLang's LoRA buffers of layer ``layer``'s projections, each ``(A, B, slice_offsets)`` or None: A bf16
        [adapters, slices · max_rank, in] (q/k/v: 3 slices, o: 1), B bf16 [adapters, out, max_rank], offsets the
        slices' output columns (SGLang's ``output_offset_cpu``). :meth:`forward` applies them with its ``lora``."""
        args = []
        for name, lora, width in (("qkv", qkv, (self.q_heads + 2 * self.kv_heads) * self.head_dim),
                                  ("o", o, self.hidden)):
            if lora is None:
                args += [0, 0, 0, 0, 0, 0, [0, width]]
                continue
            a, b, offsets = lora
            for part, t in (("A", a), ("B", b)):
                if (not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.device.type != "cpu"
                        or t.dim() != 3 or not t.is_contiguous()):
                    raise ValueError(f"layer {layer} {name} LoRA {part} must be a contiguous CPU bf16 tensor "
                                     f"[adapters, rows, cols], got {getattr(t, 'dtype', type(t).__name__)}")
            if a.shape[0] != b.shape[0]:
                raise ValueError(f"layer {layer} {name} LoRA: A holds {a.shape[0]} adapters, B {b.shape[0]}")
            offsets = [int(v) for v in offsets]
            args += [a.data_ptr(), a.shape[1], b.data_ptr(), b.shape[1], b.shape[2], a.shape[0], offsets]
            self._tensors += [a, b]
        self.native.set_lora(int(layer), *args)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, cache_loc: torch.Tensor,
                slots: Union[None, int, torch.Tensor] = None, lora=None) -> torch.Tensor:
        """A decode step of B requests, one token each. x: bf16 [B, hidden] embeddings, overwritten by (and
        returned as) the final norm's output. positions, req_pool_indices, seq_lens (this step's token included),
        cache_loc (where this step's K and V go): int64 [B], contiguous; req_to_token int32 [requests, context].
        slots: expert-LoRA slot for every request (int, -1 none) or int32 [B]. lora: the segments of SGLang's LoRA
        batch for the layers' :meth:`set_lora` buffers, ``(seg_lens, weight_indices, ranks, scalings)`` (int32,
        int32, int32 per adapter, fp32 per adapter), or None for no dense LoRA."""
        B = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
        if (B < 0 or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[1] != self.hidden
                or not x.is_contiguous()):
            raise ValueError(f"x must be a contiguous CPU bf16 tensor [B, {self.hidden}], got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        if self._max_tokens is not None and B > self._max_tokens:
            raise ValueError(f"x has {B} tokens, more than the experts' max_tokens={self._max_tokens}")
        for name, t in (("positions", positions), ("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens),
                        ("cache_loc", cache_loc)):
            _vector(name, t, B, torch.int64)
        if (not isinstance(req_to_token, torch.Tensor) or req_to_token.dtype != torch.int32 or req_to_token.dim() != 2
                or not req_to_token.is_contiguous()):
            raise ValueError("req_to_token must be a contiguous int32 tensor [requests, context]")
        if B == 0:
            return x
        slots_ptr, uniform = self._experts[0].slots_arg(slots, B) if self.num_layers else (0, -1)
        segments = (0, 0, 0, 0, 0, 0) if lora is None else segment_args(*lora, adapters=lora[2].numel())
        self.native.forward(B, x.data_ptr(), positions.data_ptr(), req_to_token.data_ptr(), req_to_token.shape[0],
                            req_to_token.shape[1], req_pool_indices.data_ptr(), seq_lens.data_ptr(),
                            cache_loc.data_ptr(), slots_ptr, uniform, *segments)
        return x
