"""A MoE decoder stack's decode step in one C++ call (``kt_serve._kernel.DecodeStack``; csrc/ops/decode_stack.h), for
Qwen3-MoE and Qwen3.5-MoE.

Per layer: input norm (+ residual), a token mixer — attention (qkv projection, per-head q / k norm and rotary,
attention over the paged KV cache with this step's K and V stored first, o projection; Qwen3.5's output gate) or a
Gated DeltaNet (in_proj_qkvz / in_proj_ba, causal conv and recurrent step on the request's pool states, gated norm,
out_proj) — post-mixer norm (+ residual) and the MoE block (router gate, softmax top-k, routed experts with their
expert-LoRA slots, Qwen3.5's gated shared expert); then the final norm. The same kernel ops as
:mod:`kt_serve.kernel.norm`, :class:`kt_serve.kernel.linear.PackedLinear`, :mod:`kt_serve.kernel.rotary`,
:mod:`kt_serve.kernel.attention`, :mod:`kt_serve.kernel.gdn` and
:meth:`kt_serve.kernel.experts.MoEExperts.forward_routed`, in SGLang's order: a CPU decode step pays no Python
between them (:mod:`kt_serve.sglang_plugin.cpu_host.decode_stack` serves decode batches through it).

A norm weight is a bf16 tensor (RMSNorm's w) or an fp32 one (Gemma's 1 + w, the residual summed in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from kt_serve import _kernel
from kt_serve.kernel.linear import PackedLinear
from kt_serve.kernel.experts import MoEExperts
from kt_serve.kernel.lora_segments import segment_args

__all__ = ["DecodeStack", "MoEBlock"]

BF16 = torch.bfloat16


def _vector(name: str, t, n: int, dtypes=(BF16,)) -> torch.Tensor:
    if (not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.device.type != "cpu" or tuple(t.shape) != (n,)
            or not t.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous CPU {' or '.join(map(str, dtypes))} tensor [{n}], got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    return t


def _norm(name: str, t, n: int, eps: float):
    t = _vector(name, t, n, (BF16, torch.float32))
    plain = t.dtype == BF16
    return _kernel.NormWeight(t.data_ptr() if plain else 0, 0 if plain else t.data_ptr(), float(eps)), t


def _projection(layer: PackedLinear):
    return _kernel.Projection(layer.native, layer.bias.data_ptr() if layer.bias is not None else 0)


def _cache(name: str, t, kv_heads: int, head_dim: int) -> torch.Tensor:
    if (not isinstance(t, torch.Tensor) or t.dtype != BF16 or t.device.type != "cpu" or t.dim() != 3
            or t.shape[1:] != (kv_heads, head_dim) or t.stride(2) != 1 or t.stride(1) != head_dim):
        raise ValueError(f"{name} must be a CPU bf16 tensor [slots, {kv_heads}, {head_dim}] with dense heads, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    return t


@dataclass
class MoEBlock:
    """A layer's MoE block: router gate [experts, hidden] (no bias), routed experts, and optionally a shared SwiGLU
    expert (gate_up [2 I, hidden], down [hidden, I]) scaled by sigmoid(x · shared_expert_gate), bf16 [hidden]."""
    gate: PackedLinear
    experts: MoEExperts
    top_k: int
    renormalize: bool
    shared_gate_up: Optional[PackedLinear] = None
    shared_down: Optional[PackedLinear] = None
    shared_expert_gate: Optional[torch.Tensor] = None


class DecodeStack:
    """The decoder layers of one model, added in order; :meth:`forward` runs a decode step.

    It holds the tensors it was given (norm weights, cos/sin caches, KV caches, state pools): they must not be
    replaced while it is in use (SGLang allocates its pools once)."""

    def __init__(self, hidden: int, final_norm: torch.Tensor, final_eps: float, isa: str = "auto"):
        self.hidden = int(hidden)
        norm, t = _norm("final_norm", final_norm, self.hidden, final_eps)
        self._keep: list = [t, norm]
        self.native = _kernel.DecodeStack(self.hidden, norm, isa)  # other kernel calls that take it read it here
        self._experts: list[MoEExperts] = []
        self._max_tokens = None  # the fewest tokens any layer's experts take

    @property
    def num_layers(self) -> int:
        return self.native.num_layers

    @property
    def max_tokens(self) -> int:
        """The most requests a step takes (the fewest any layer's experts take)."""
        return self._max_tokens or 0

    def _layer_norms(self, input_norm, input_eps, post_norm, post_eps):
        (a, ta), (b, tb) = (_norm("input_norm", input_norm, self.hidden, input_eps),
                            _norm("post_norm", post_norm, self.hidden, post_eps))
        self._keep += [ta, tb]
        return a, b

    def _moe(self, moe: MoEBlock):
        if moe.gate.bias is not None:
            raise ValueError("the router gate must have no bias")
        shared = [moe.shared_gate_up, moe.shared_down]
        if (moe.shared_gate_up is None) != (moe.shared_down is None):
            raise ValueError("a shared expert needs both its gate_up and down projections")
        gate_w = 0
        if moe.shared_expert_gate is not None:
            if moe.shared_gate_up is None:
                raise ValueError("a shared expert gate without a shared expert")
            gate_w = _vector("shared_expert_gate", moe.shared_expert_gate, self.hidden).data_ptr()
            self._keep.append(moe.shared_expert_gate)
        projections = [None if p is None else _projection(p) for p in shared]
        block = _kernel.MoEBlock(moe.gate.native, moe.experts.native, int(moe.top_k), bool(moe.renormalize),
                                 *projections, gate_w)
        self._keep += [moe.gate, moe.experts, *shared, *projections, block]
        self._experts.append(moe.experts)
        self._max_tokens = min(self._max_tokens or moe.experts.max_tokens, moe.experts.max_tokens)
        return block

    def add_attention_layer(self, *, input_norm: torch.Tensor, input_eps: float, post_norm: torch.Tensor,
                            post_eps: float, qkv: PackedLinear, o_proj: PackedLinear, q_heads: int, kv_heads: int,
                            head_dim: int, q_norm: torch.Tensor, q_eps: float, k_norm: torch.Tensor, k_eps: float,
                            cos_sin: torch.Tensor, rotary_dim: int, neox: bool, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, scale: float, moe: MoEBlock, output_gate: bool = False) -> None:
        """An attention layer. qkv [(q_heads (x2 with output_gate: per head [q | gate]) + 2 kv_heads) head_dim,
        hidden]; q / k norms [head_dim]; cos_sin fp32 [max_position, rotary_dim] (cos then sin,
        :func:`kt_serve.kernel.rotary.rotary_embedding`); k_cache / v_cache bf16 [slots, kv_heads, head_dim]."""
        inorm, pnorm = self._layer_norms(input_norm, input_eps, post_norm, post_eps)
        (qn, tq), (kn, tk) = _norm("q_norm", q_norm, head_dim, q_eps), _norm("k_norm", k_norm, head_dim, k_eps)
        if (not isinstance(cos_sin, torch.Tensor) or cos_sin.dtype != torch.float32 or cos_sin.dim() != 2
                or cos_sin.shape[1] != rotary_dim or not cos_sin.is_contiguous()):
            raise ValueError(f"cos_sin must be a contiguous fp32 tensor [max_position, {rotary_dim}]")
        k_cache, v_cache = _cache("k_cache", k_cache, kv_heads, head_dim), _cache("v_cache", v_cache, kv_heads, head_dim)
        if k_cache.shape[0] != v_cache.shape[0]:
            raise ValueError(f"k_cache has {k_cache.shape[0]} slots, v_cache {v_cache.shape[0]}")
        qkv_p, o_p = _projection(qkv), _projection(o_proj)
        self.native.add_attention_layer(inorm, pnorm, qkv_p, o_p, int(q_heads), int(kv_heads), int(head_dim),
                                        bool(output_gate), qn, kn, cos_sin.data_ptr(), cos_sin.shape[0],
                                        int(rotary_dim), bool(neox), k_cache.data_ptr(), k_cache.stride(0),
                                        v_cache.data_ptr(), v_cache.stride(0), k_cache.shape[0], float(scale),
                                        self._moe(moe))
        self._keep += [tq, tk, cos_sin, k_cache, v_cache, qkv, o_proj, qkv_p, o_p]

    def add_gdn_layer(self, *, input_norm: torch.Tensor, input_eps: float, post_norm: torch.Tensor, post_eps: float,
                      in_proj_qkvz: PackedLinear, in_proj_ba: PackedLinear, out_proj: PackedLinear, key_heads: int,
                      value_heads: int, key_dim: int, value_dim: int, conv_weight: torch.Tensor,
                      conv_bias: Optional[torch.Tensor], conv_silu: bool, conv_states: torch.Tensor,
                      ssm_states: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                      norm_eps: float, sigmoid_gate: bool, moe: MoEBlock) -> None:
        """A Gated DeltaNet layer (:mod:`kt_serve.kernel.gdn`): in_proj_qkvz rows [q | k | v | z], in_proj_ba [b | a];
        conv_weight bf16 [2 key_heads key_dim + value_heads value_dim, K]; conv_states bf16 [slots, that, K - 1] and
        ssm_states fp32 [slots, value_heads, key_dim, value_dim] (SGLang's mamba pools, any strides); A_log,
        dt_bias [value_heads] fp32 or bf16; norm_weight fp32 [value_dim] (the gated norm's)."""
        inorm, pnorm = self._layer_norms(input_norm, input_eps, post_norm, post_eps)
        conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        if (not isinstance(conv_weight, torch.Tensor) or conv_weight.dtype != BF16 or conv_weight.dim() != 2
                or conv_weight.shape[0] != conv_dim or not conv_weight.is_contiguous()):
            raise ValueError(f"conv_weight must be a contiguous bf16 tensor [{conv_dim}, K]")
        K = conv_weight.shape[1]
        if conv_bias is not None:
            _vector("conv_bias", conv_bias, conv_dim)
        if conv_states.dtype != BF16 or conv_states.dim() != 3 or tuple(conv_states.shape[1:]) != (conv_dim, K - 1):
            raise ValueError(f"conv_states must be bf16 [slots, {conv_dim}, {K - 1}]")
        if (ssm_states.dtype != torch.float32 or ssm_states.dim() != 4
                or tuple(ssm_states.shape[1:]) != (value_heads, key_dim, value_dim)):
            raise ValueError(f"ssm_states must be fp32 [slots, {value_heads}, {key_dim}, {value_dim}]")
        params = [_vector(n, t, value_heads, (BF16, torch.float32)) for n, t in (("A_log", A_log), ("dt_bias", dt_bias))]
        _vector("norm_weight", norm_weight, value_dim, (torch.float32,))
        projections = [_projection(p) for p in (in_proj_qkvz, in_proj_ba, out_proj)]
        self.native.add_gdn_layer(inorm, pnorm, *projections, int(key_heads), int(value_heads), int(key_dim),
                                  int(value_dim), int(K), conv_weight.data_ptr(),
                                  0 if conv_bias is None else conv_bias.data_ptr(), bool(conv_silu),
                                  conv_states.data_ptr(), [conv_states.shape[0], *conv_states.stride()],
                                  ssm_states.data_ptr(), [ssm_states.shape[0], *ssm_states.stride()],
                                  params[0].data_ptr(), params[0].dtype == BF16, params[1].data_ptr(),
                                  params[1].dtype == BF16, norm_weight.data_ptr(), float(norm_eps), bool(sigmoid_gate),
                                  self._moe(moe))
        self._keep += [conv_weight, conv_bias, conv_states, ssm_states, *params, norm_weight, in_proj_qkvz,
                       in_proj_ba, out_proj, *projections]

    def set_lora(self, layer: int, name: str, lora) -> None:
        """SGLang's LoRA buffers of layer ``layer``'s projection ``name`` (qkv, o; in_proj_qkvz, in_proj_ba,
        out_proj; shared_gate_up, shared_down) as ``(A, B, slice_offsets)``: A bf16 [adapters, slices · max_rank,
        in], B bf16 [adapters, out, max_rank], offsets the slices' output columns (SGLang's ``output_offset_cpu``).
        :meth:`forward` applies them with its ``lora``."""
        a, b, offsets = lora
        for part, t in (("A", a), ("B", b)):
            if (not isinstance(t, torch.Tensor) or t.dtype != BF16 or t.device.type != "cpu" or t.dim() != 3
                    or not t.is_contiguous()):
                raise ValueError(f"layer {layer} {name} LoRA {part} must be a contiguous CPU bf16 tensor "
                                 f"[adapters, rows, cols], got {getattr(t, 'dtype', type(t).__name__)}")
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"layer {layer} {name} LoRA: A holds {a.shape[0]} adapters, B {b.shape[0]}")
        self.native.set_lora(int(layer), name, a.data_ptr(), a.shape[1], b.data_ptr(), b.shape[1], b.shape[2],
                             a.shape[0], [int(v) for v in offsets])
        self._keep += [a, b]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, cache_loc: torch.Tensor,
                state_slots: Optional[torch.Tensor] = None, slots: Union[None, int, torch.Tensor] = None,
                lora=None) -> torch.Tensor:
        """A decode step of B requests, one token each. x: bf16 [B, hidden] embeddings, overwritten by (and
        returned as) the final norm's output. positions, req_pool_indices, seq_lens (this step's token included),
        cache_loc (where this step's K and V go): int64 [B], contiguous; req_to_token int32 [requests, context].
        state_slots: int32 [B], each request's slot in the GDN layers' state pools (negative: a padding row).
        slots: expert-LoRA slot for every request (int, -1 none) or int32 [B]. lora: the segments of SGLang's LoRA
        batch for the :meth:`set_lora` buffers, ``(seg_lens, weight_indices, ranks, scalings)`` (int32, int32,
        int32 per adapter, fp32 per adapter), or None for no dense LoRA."""
        B = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
        if B < 0 or x.dtype != BF16 or x.device.type != "cpu" or x.shape[1] != self.hidden or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous CPU bf16 tensor [B, {self.hidden}], got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        if self._max_tokens is not None and B > self._max_tokens:
            raise ValueError(f"x has {B} tokens, more than the experts' max_tokens={self._max_tokens}")
        for name, t in (("positions", positions), ("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens),
                        ("cache_loc", cache_loc)):
            _vector(name, t, B, (torch.int64,))
        if state_slots is not None:
            _vector("state_slots", state_slots, B, (torch.int32,))
        elif self.native.has_gdn:
            raise ValueError("a stack with GDN layers needs each request's state_slots")
        if (not isinstance(req_to_token, torch.Tensor) or req_to_token.dtype != torch.int32 or req_to_token.dim() != 2
                or not req_to_token.is_contiguous()):
            raise ValueError("req_to_token must be a contiguous int32 tensor [requests, context]")
        if B == 0:
            return x
        slots_ptr, uniform = self._experts[0].slots_arg(slots, B) if self.num_layers else (0, -1)
        segments = (0, 0, 0, 0, 0, 0) if lora is None else segment_args(*lora, adapters=lora[2].numel())
        self.native.forward(B, x.data_ptr(), positions.data_ptr(), req_to_token.data_ptr(), req_to_token.shape[0],
                            req_to_token.shape[1], req_pool_indices.data_ptr(), seq_lens.data_ptr(),
                            cache_loc.data_ptr(), 0 if state_slots is None else state_slots.data_ptr(), slots_ptr,
                            uniform, *segments)
        return x
