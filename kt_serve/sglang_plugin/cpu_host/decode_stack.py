"""A CPU host's Qwen3-MoE decode step in one kernel call (kt_serve/kernel/decode_stack.py) instead of SGLang's layer
loop.

With the plugin's CPU ops every piece of a decode layer already runs in our kernel (packed q/k/v/o and router,
C++ RMSNorm, q / k norm + rotary, kt_cpu attention with its KV write, the MoE block), yet timing a step inside the
server (evals/profile_decode.py --timers) left about a fifth of it in the Python between those calls: SGLang's
layer boundaries and residual stream, module calls, the attention backend's dispatch, each run cold after the
weight streams that evicted the interpreter's working set. A decode batch that every layer's fast path would take
now runs as ``embed_tokens`` then one :class:`kt_serve.kernel.decode_stack.DecodeStack` call (all layers and the final
norm), then SGLang's logits processor; the same kernel ops in the same order, so the same numbers.

The stack is worked out once per model (and again if SGLang reallocates the KV pool); a model it cannot take keeps
SGLang's loop, with the reason logged once: a model other than Qwen3-MoE, pipeline or tensor parallelism, layers
not packed (AMX hosts keep SGLang's own kernels), another attention backend or KV pool, aux hidden-state capture,
or a block the MoE fast path refuses (moe_block.py). Per step, prefill / extend / idle batches, input embeddings,
two-batch overlap, routed-expert capture, padded rows and router LoRA keep the loop too. Expert LoRA runs in the
stack (the kernel's slots), and so does the LoRA SGLang's wrappers add to q/k/v and o: the stack reads their
buffers in SGLang's LoRA memory pool and the batch's segments from its torch_native backend (as lora_segments.py does);
an adapter with LoRA on other layer modules keeps the loop.
"""

from __future__ import annotations

import logging

import torch

from ..adapters.registry import get_registry
from ..log import log_once
from .linear import packed_of

logger = logging.getLogger(__name__)
_PLAN = "_kt_decode_stack"  # on the model: its _Stack, or the reason it has none


class _Stack:
    __slots__ = ("stack", "buffers", "gate_keys", "max_tokens", "lora_backend", "lora_reason")

    def __init__(self, stack, buffers, gate_keys, max_tokens: int, lora_backend, lora_reason):
        self.stack, self.buffers, self.gate_keys, self.max_tokens = stack, buffers, gate_keys, max_tokens
        # SGLang's LoRA backend of the layers' wrapped projections (None: none wrapped), or why the stack cannot
        # apply their LoRA
        self.lora_backend, self.lora_reason = lora_backend, lora_reason


_LORA_BUFFERS = {"qkv_proj": ("A_buffer_qkv", "B_buffer_qkv"), "o_proj": ("A_buffer", "B_buffer")}


def _layer_lora(i: int, layer, attn):
    """(the stack's set_lora arguments, [(module, attribute, tensor)] it reads, SGLang's LoRA backend or None, or
    why the stack cannot apply this layer's LoRA)."""
    from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
    from sglang.srt.lora.layers import BaseLayerWithLoRA

    wrapped = [m for m in layer.modules() if isinstance(m, BaseLayerWithLoRA)]
    if not wrapped:
        return {}, [], None, None
    named = {name: getattr(attn, name) for name in _LORA_BUFFERS}
    for m in wrapped:
        if not any(m is w for w in named.values()):
            return {}, [], None, f"layer {i}'s {type(m).__name__} (SGLang's LoRA outside q/k/v and o)"
    args, buffers, backend = {}, [], wrapped[0].lora_backend
    for name, module in named.items():
        if not isinstance(module, BaseLayerWithLoRA):
            continue
        a_attr, b_attr = _LORA_BUFFERS[name]
        a, b = getattr(module, a_attr, None), getattr(module, b_attr, None)
        if (not module.set_lora or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor)
                or module.lora_backend is not backend or not isinstance(backend, TorchNativeLoRABackend)):
            return {}, [], None, f"layer {i}'s {name} LoRA is not SGLang's torch_native segmented LoRA"
        args[name.removesuffix("_proj")] = (a, b, module.output_offset_cpu.tolist())
        buffers += [(module, a_attr, a), (module, b_attr, b)]
    return args, buffers, backend, None


def _build(model, forward_batch):
    """The model's _Stack, or a string saying why SGLang's layer loop must run its decode steps."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.model_executor.forward_context import get_attn_backend
    from sglang.srt.models.qwen3_moe import Qwen3MoeAttention, Qwen3MoeDecoderLayer, Qwen3MoeModel

    from kt_serve.kernel.decode_stack import DecodeStack

    from .attention import backend_class
    from .moe_block import block_plan
    from .rotary import fp32_cos_sin_cache, plain_norm, qk_plan

    if type(model) is not Qwen3MoeModel:
        return f"{type(model).__name__} is not a Qwen3-MoE model"
    if model.pp_group.world_size != 1 or get_parallel().attn_tp_size != 1:
        return "pipeline or tensor parallelism"
    if model.start_layer != 0 or model.end_layer != len(model.layers) or not len(model.layers):
        return "a partial layer range"
    backend = get_attn_backend()
    if not isinstance(backend, backend_class()):
        return f"attention backend {type(backend).__name__}, not kt_cpu"
    pool, H = backend.token_to_kv_pool, model.config.hidden_size
    if not plain_norm(model.norm, H):
        return "a final norm other than a plain bf16 RMSNorm"
    stack, buffers, gate_keys, max_tokens, lora_backend, lora_reason = None, [], [], None, None, None
    for i, layer in enumerate(model.layers):
        attn, radix = getattr(layer, "self_attn", None), getattr(getattr(layer, "self_attn", None), "attn", None)
        if type(layer) is not Qwen3MoeDecoderLayer or type(attn) is not Qwen3MoeAttention:
            return f"layer {i} is not a Qwen3-MoE decoder layer"
        if getattr(layer, "_is_layer_to_capture", False):
            return "aux hidden-state capture"
        moe = block_plan(layer.mlp) if getattr(layer, "is_layer_sparse", False) else "a dense MLP layer"
        if isinstance(moe, str):
            return f"layer {i}'s MoE block: {moe}"
        # the stack applies SGLang's q/k/v and o LoRA itself (_layer_lora): the base layers' packed weights
        qkv, o = (packed_of(getattr(m, "base_layer", m)) for m in (attn.qkv_proj, attn.o_proj))
        if qkv is None or o is None:
            return f"layer {i}'s attention projections are not packed layers"
        if not (plain_norm(layer.input_layernorm, H) and plain_norm(layer.post_attention_layernorm, H)):
            return f"layer {i}'s norms are not plain bf16 RMSNorms"
        if not qk_plan(attn, forward_batch):
            return f"layer {i}'s q / k norm and rotary are not on the kernel"
        if backend.layer_plan(radix) != (None, True):
            return f"layer {i}'s attention or KV write is not on the kernel"
        D = attn.head_dim
        if (radix.tp_q_head_num, radix.tp_k_head_num, radix.qk_head_dim, radix.v_head_dim) != (
                attn.num_heads, attn.num_kv_heads, D, D):
            return f"layer {i}'s attention heads differ from its projections"
        if stack is None:
            stack = DecodeStack(H, attn.num_heads, attn.num_kv_heads, D, model.norm.weight.data,
                                model.norm.variance_epsilon)
        rope = attn.rotary_emb
        k_cache, v_cache = pool.get_key_buffer(radix.layer_id), pool.get_value_buffer(radix.layer_id)
        stack.add_layer(input_norm=layer.input_layernorm.weight.data, input_eps=layer.input_layernorm.variance_epsilon,
                        qkv=qkv, q_norm=attn.q_norm.weight.data, q_eps=attn.q_norm.variance_epsilon,
                        k_norm=attn.k_norm.weight.data, k_eps=attn.k_norm.variance_epsilon,
                        cos_sin=fp32_cos_sin_cache(rope),
                        rotary_dim=rope.rotary_dim, neox=rope.is_neox_style, k_cache=k_cache, v_cache=v_cache,
                        scale=radix.scaling, o_proj=o, post_norm=layer.post_attention_layernorm.weight.data,
                        post_eps=layer.post_attention_layernorm.variance_epsilon, gate=moe.gate, experts=moe.experts,
                        top_k=moe.top_k, renormalize=moe.renormalize)
        buffers += [(pool, ("get_key_buffer", radix.layer_id), k_cache),
                    (pool, ("get_value_buffer", radix.layer_id), v_cache)]
        lora, lora_buffers, layer_backend, reason = _layer_lora(i, layer, attn)
        if lora:
            stack.set_lora(i, **lora)
        buffers += lora_buffers
        lora_backend, lora_reason = lora_backend or layer_backend, lora_reason or reason
        gate_keys.append(moe.gate_key)
        max_tokens = min(max_tokens or moe.experts.max_tokens, moe.experts.max_tokens)
    return _Stack(stack, buffers, tuple(gate_keys), max_tokens, lora_backend, lora_reason)


def _moved(plan: _Stack) -> bool:
    """Whether SGLang has replaced a KV cache or LoRA buffer since the stack took its address."""
    for owner, attr, tensor in plan.buffers:
        now = getattr(owner, attr[0])(attr[1]) if isinstance(attr, tuple) else getattr(owner, attr, None)
        if now is not tensor and (not isinstance(now, torch.Tensor) or now.data_ptr() != tensor.data_ptr()):
            return True
    return False


def _step_reason(plan: _Stack, B: int, positions, forward_batch, backend) -> str | None:
    """Why this decode batch of B requests keeps SGLang's layer loop, or None."""
    from .moe_block import batch_reason, router_lora_reason

    if B > plan.max_tokens:
        return "a batch larger than the experts' max_tokens"
    if backend.step_req_indices is None or backend.step_req_indices.shape[0] != B:
        return "a decode batch without its attention metadata"
    loc = forward_batch.out_cache_loc
    if (loc.dtype != torch.int64 or loc.shape != (B,) or not loc.is_contiguous() or positions.dtype != torch.int64
            or positions.shape != (B,) or not positions.is_contiguous()):
        return "cache locations or positions that are not int64 [batch]"
    if get_registry().lora_experts.in_batch():
        return "LoRA Experts in a request's adapter (applied after each MoE block of the layer loop)"
    return batch_reason(B) or router_lora_reason(plan.gate_keys)


def _lora_segments(plan: _Stack):
    """(SGLang's LoRA segments for the stack, or None when no request's adapter has LoRA in the layers; why the
    stack cannot apply it, or None)."""
    current = get_registry().batch
    if plan.lora_backend is None or current is None or not current.layer_lora:
        return None, None
    if plan.lora_reason is not None:
        return None, plan.lora_reason
    info = plan.lora_backend.get_batch_info()
    if info is None or info.use_cuda_graph or info.seg_lens_cpu is None:
        return None, "a LoRA batch without its CPU segments"
    return (info.seg_lens_cpu, info.weight_indices_cpu, info.lora_ranks_cpu, info.scalings_cpu), None


def forward(original, model, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None, **kw):
    """AROUND Qwen2MoeModel.forward (which Qwen3MoeModel inherits)."""
    if (kw or input_embeds is not None or pp_proxy_tensors is not None or not forward_batch.forward_mode.is_decode()
            or input_ids.shape[0] == 0 or getattr(forward_batch, "can_run_tbo", False)):
        return original(model, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors, **kw)
    from sglang.srt.model_executor.forward_context import get_attn_backend

    backend = get_attn_backend()
    plan = model.__dict__.get(_PLAN)
    if plan is None or (not isinstance(plan, str) and _moved(plan)):
        plan = model.__dict__[_PLAN] = _build(model, forward_batch)
    if isinstance(plan, str):
        log_once(logger, f"decode steps keep SGLang's layer loop: {plan}")
        return original(model, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
    reason = _step_reason(plan, int(input_ids.shape[0]), positions, forward_batch, backend)
    lora = None
    if reason is None:
        lora, reason = _lora_segments(plan)
    if reason is not None:
        log_once(logger, f"this decode batch keeps SGLang's layer loop: {reason}")
        return original(model, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
    log_once(logger, f"decode steps in one kernel call ({plan.stack.num_layers} layers and the final norm)")
    if lora is not None:
        log_once(logger, "decode steps apply SGLang's q/k/v and o LoRA inside that call (segmented, as its "
                 "torch_native backend)")
    x = model.embed_tokens(input_ids).contiguous()
    slots = get_registry().slots_for(x.shape[0])
    return plan.stack.forward(x, positions, backend.req_to_token_pool.req_to_token, backend.step_req_indices,
                              backend.step_seq_lens, forward_batch.out_cache_loc, slots, lora)
