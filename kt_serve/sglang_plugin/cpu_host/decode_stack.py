"""A CPU host's decode step in one kernel call (kt_serve/kernel/decode_stack.py) instead of SGLang's layer loop, for
Qwen3-MoE and Qwen3.5-MoE.

With the plugin's CPU ops every piece of a decode layer already runs in our kernel (packed projections and router,
C++ norms, q / k norm + rotary, kt_cpu attention with its KV write, the GDN conv and recurrent step, the MoE block),
yet timing a step inside the server (evals/profile_decode.py --timers) left a fifth of a Qwen3 step and nearly a
third of a Qwen3.5 one in the Python between those calls: SGLang's layer boundaries and residual stream, module calls, the
attention backends' dispatch, the GDN glue, each run cold after the weight streams that evicted the interpreter's
working set. A decode batch that every layer's fast path would take now runs as the token embeddings then one
:class:`kt_serve.kernel.decode_stack.DecodeStack` call (all layers and the final norm), then SGLang's logits
processor.

The stack is worked out once per model (and again if SGLang reallocates a pool it reads); a model it cannot take
keeps SGLang's loop, with the reason logged once: another model, pipeline or tensor parallelism, layers not packed
(AMX hosts keep SGLang's own kernels), another attention backend or KV pool, aux hidden-state capture, a block the
MoE fast path refuses (moe_block.py). Per step, prefill / extend / idle batches, two-batch overlap, routed-expert
capture, padded rows, GDN state tracking for the radix cache, multimodal positions that differ between sections,
router / shared-expert-gate / in_proj_ba LoRA and KT-FT's LoRA Experts keep the loop too. Expert LoRA runs in the
stack (the kernel's slots), and so does the LoRA SGLang's wrappers add to the layers' projections (q/k/v, o,
in_proj_qkvz, out_proj, the shared expert's): the stack reads their buffers in SGLang's LoRA memory pool and the
batch's segments from its torch_native backend (as lora_segments.py does).
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
    __slots__ = ("stack", "buffers", "gate_keys", "lora_backend", "lora_reason")

    def __init__(self, stack, buffers, gate_keys, lora_backend, lora_reason):
        # buffers: [(a function returning SGLang's current tensor, the tensor the stack took)]
        self.stack, self.buffers, self.gate_keys = stack, buffers, gate_keys
        # SGLang's LoRA backend of the layers' wrapped projections (None: none wrapped), or why the stack cannot
        # apply their LoRA
        self.lora_backend, self.lora_reason = lora_backend, lora_reason


class _Refused(Exception):
    """Why SGLang's layer loop must run this model's decode steps."""


# -- the parts of a layer ----------------------------------------------------------------------------------------
def _packed(i: int, what: str, module):
    packed = packed_of(getattr(module, "base_layer", module))
    if packed is None:
        raise _Refused(f"layer {i}'s {what} is not a packed layer")
    return packed


def _norm_weight(what: str, norm, n: int) -> torch.Tensor:
    """An RMSNorm's bf16 weight, or a Gemma RMSNorm's fp32 1 + weight (what the kernel's norms take)."""
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    from .norm import fp32_weight
    from .rotary import plain_norm

    if plain_norm(norm, n):
        return norm.weight.data
    w = getattr(norm, "weight", None)
    if type(norm) is GemmaRMSNorm and isinstance(w, torch.Tensor) and w.shape == (n,) and w.device.type == "cpu":
        return fp32_weight(norm, plus_one=True)
    raise _Refused(f"{what} is neither a plain bf16 RMSNorm nor a Gemma RMSNorm")


_LORA_BUFFERS = {"QKVParallelLinearWithLoRA": ("A_buffer_qkv", "B_buffer_qkv")}


def _layer_lora(i: int, layer, projections: dict):
    """(the stack's set_lora calls [(name, (A, B, offsets))], [(getter, tensor)] it reads, SGLang's LoRA backend
    or None, or why the stack cannot apply this layer's LoRA). projections: stack name -> the layer's module."""
    from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
    from sglang.srt.lora.layers import BaseLayerWithLoRA

    wrapped = [m for m in layer.modules() if isinstance(m, BaseLayerWithLoRA)]
    if not wrapped:
        return [], [], None, None
    for m in wrapped:
        if not any(m is p for p in projections.values()):
            return [], [], None, f"layer {i}'s {type(m).__name__} (SGLang's LoRA on a module the stack does not run)"
    calls, buffers, backend = [], [], wrapped[0].lora_backend
    for name, module in projections.items():
        if not isinstance(module, BaseLayerWithLoRA):
            continue
        a_attr, b_attr = _LORA_BUFFERS.get(type(module).__name__, ("A_buffer", "B_buffer"))
        a, b = getattr(module, a_attr, None), getattr(module, b_attr, None)
        if (not module.set_lora or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor)
                or module.lora_backend is not backend or not isinstance(backend, TorchNativeLoRABackend)):
            return [], [], None, f"layer {i}'s {name} LoRA is not SGLang's torch_native segmented LoRA"
        calls.append((name, (a, b, module.output_offset_cpu.tolist())))
        buffers += [(lambda m=module, at=a_attr: getattr(m, at, None), a),
                    (lambda m=module, at=b_attr: getattr(m, at, None), b)]
    return calls, buffers, backend, None


def _moe(i: int, mlp, H: int):
    """(the layer's kernel MoEBlock, its gate LoRA keys)."""
    from sglang.srt.models.qwen2_moe import Qwen2MoeMLP, Qwen2MoeSparseMoeBlock

    from kt_serve.kernel.decode_stack import MoEBlock

    from .moe_block import block_plan

    plan = block_plan(mlp)
    if isinstance(plan, str):
        raise _Refused(f"layer {i}'s MoE block: {plan}")
    block, keys = MoEBlock(plan.gate, plan.experts, plan.top_k, plan.renormalize), [plan.gate_key]
    if type(mlp) is not Qwen2MoeSparseMoeBlock or mlp.shared_expert is None:
        return block, keys
    shared, gate = mlp.shared_expert, mlp.shared_expert_gate
    if mlp.enable_shared_expert_fusion or type(shared) is not Qwen2MoeMLP or type(shared.act_fn).__name__ != "SiluAndMul":
        raise _Refused(f"layer {i}'s shared expert is not a plain SwiGLU MLP")
    block.shared_gate_up = _packed(i, "shared expert gate_up_proj", shared.gate_up_proj)
    block.shared_down = _packed(i, "shared expert down_proj", shared.down_proj)
    if gate is not None:
        w = getattr(gate, "weight", None)
        if (not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.numel() != H
                or getattr(gate, "bias", None) is not None):
            raise _Refused(f"layer {i}'s shared expert gate is not a bf16 [1, hidden] weight without bias")
        block.shared_expert_gate = w.data.reshape(H)
        keys.append((i, "mlp.shared_expert_gate"))
    return block, keys


def _attention(i: int, attn, radix, backend, forward_batch, gated: bool):
    """The add_attention_layer arguments of Qwen3's self_attn or Qwen3.5's attention layer (both hold qkv_proj,
    o_proj, q_norm, k_norm, rotary_emb, attn), and the KV cache buffers it reads."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
    from sglang.srt.layers.rotary_embedding.mrope import MRotaryEmbedding
    from sglang.srt.models.utils import enable_fused_set_kv_buffer

    from .rotary import fp32_cos_sin_cache

    D, rope = attn.head_dim, attn.rotary_emb
    if type(rope) not in (RotaryEmbedding, MRotaryEmbedding) or rope.head_size != D or rope.rotary_dim % 2:
        raise _Refused(f"layer {i}'s rotary embedding is not a plain (or text-only multimodal) rotary")
    if getattr(attn, "use_fused_qk_norm_rope", False) or getattr(attn, "use_fused_qk_norm_rope_cpu", False) or (
            getattr(attn, "compatible_with_fused_kv_buffer", False) and enable_fused_set_kv_buffer(forward_batch)):
        raise _Refused(f"layer {i}'s attention fuses its q / k norm, rotary or KV write elsewhere")
    if backend.layer_plan(radix) != (None, True):
        raise _Refused(f"layer {i}'s attention or KV write is not on the kernel")
    if (radix.tp_q_head_num, radix.tp_k_head_num, radix.qk_head_dim, radix.v_head_dim) != (
            attn.num_heads, attn.num_kv_heads, D, D):
        raise _Refused(f"layer {i}'s attention heads differ from its projections")
    pool = backend.token_to_kv_pool
    k_cache, v_cache = pool.get_key_buffer(radix.layer_id), pool.get_value_buffer(radix.layer_id)
    args = dict(qkv=_packed(i, "qkv_proj", attn.qkv_proj), o_proj=_packed(i, "o_proj", attn.o_proj),
                q_heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=D, output_gate=gated,
                q_norm=_norm_weight(f"layer {i}'s q_norm", attn.q_norm, D), q_eps=attn.q_norm.variance_epsilon,
                k_norm=_norm_weight(f"layer {i}'s k_norm", attn.k_norm, D), k_eps=attn.k_norm.variance_epsilon,
                cos_sin=fp32_cos_sin_cache(rope), rotary_dim=rope.rotary_dim, neox=rope.is_neox_style,
                k_cache=k_cache, v_cache=v_cache, scale=radix.scaling)
    lid = radix.layer_id
    buffers = [(lambda: pool.get_key_buffer(lid), k_cache), (lambda: pool.get_value_buffer(lid), v_cache)]
    return args, buffers


def _gdn(i: int, la, linear_backend):
    """The add_gdn_layer arguments of a Qwen3.5 Gated DeltaNet module, and the state buffers it reads."""
    from ..models.qwen35_gdn import kv_view
    from .norm import fp32_weight

    Hk, Hv, Dk, Dv, K = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel_size
    if la.attn_tp_size != 1:
        raise _Refused("tensor-parallel linear attention")
    if la.activation not in ("silu", "swish"):
        raise _Refused(f"layer {i}'s GDN conv activation {la.activation!r} (the kernel's is SiLU)")
    norm = la.norm
    if (not norm.norm_before_gate or norm.group_size not in (None, Dv) or getattr(norm, "bias", None) is not None
            or norm.activation not in ("swish", "silu", "sigmoid")):
        raise _Refused(f"layer {i}'s GDN output norm is not a gated RMSNorm before its SiLU / sigmoid gate")
    conv_dim = 2 * Hk * Dk + Hv * Dv
    conv_w = la.conv1d.weight.data.reshape(conv_dim, K)
    cache = linear_backend.req_to_token_pool.mamba2_layer_cache(la.layer_id)
    conv_states, ssm_pool = cache.conv[0], cache.temporal
    if conv_w.dtype != torch.bfloat16 or conv_states.dtype != torch.bfloat16 or ssm_pool.dtype != torch.float32:
        raise _Refused(f"layer {i}'s GDN conv weight / states are not bf16 or its recurrent states not fp32")
    lid = la.layer_id
    args = dict(in_proj_qkvz=_packed(i, "in_proj_qkvz", la.in_proj_qkvz), in_proj_ba=_packed(i, "in_proj_ba", la.in_proj_ba),
                out_proj=_packed(i, "out_proj", la.out_proj), key_heads=Hk, value_heads=Hv, key_dim=Dk, value_dim=Dv,
                conv_weight=conv_w.contiguous(), conv_bias=la.conv1d.bias, conv_silu=True, conv_states=conv_states,
                ssm_states=kv_view(ssm_pool, Dk, Dv), A_log=la.A_log.data, dt_bias=la.dt_bias.data,
                norm_weight=fp32_weight(norm), norm_eps=norm.eps, sigmoid_gate=norm.activation == "sigmoid")
    pool = linear_backend.req_to_token_pool
    buffers = [(lambda: pool.mamba2_layer_cache(lid).conv[0], conv_states),
               (lambda: pool.mamba2_layer_cache(lid).temporal, ssm_pool)]
    return args, buffers


# -- the model ---------------------------------------------------------------------------------------------------
def _layers(model):
    """[(layer, kind, mixer module)] of a Qwen3-MoE or Qwen3.5-MoE model, kind "attention" / "gated" / "gdn"."""
    from sglang.srt.models.qwen3_moe import Qwen3MoeAttention, Qwen3MoeDecoderLayer, Qwen3MoeModel
    from sglang.srt.models.qwen3_5 import (Qwen3_5AttentionDecoderLayer, Qwen3_5ForCausalLM,
                                           Qwen3_5LinearDecoderLayer)

    if type(model) is Qwen3MoeModel:
        out = []
        for i, layer in enumerate(model.layers):
            if type(layer) is not Qwen3MoeDecoderLayer or type(layer.self_attn) is not Qwen3MoeAttention:
                raise _Refused(f"layer {i} is not a Qwen3-MoE decoder layer")
            out.append((layer, "attention", layer.self_attn))
        return out
    if isinstance(model, Qwen3_5ForCausalLM):
        out = []
        for i, layer in enumerate(model.layers):
            if type(layer) is Qwen3_5LinearDecoderLayer:
                out.append((layer, "gdn", layer.linear_attn))
            elif type(layer) is Qwen3_5AttentionDecoderLayer:
                out.append((layer, "gated" if layer.attn_output_gate else "attention", layer))
            else:
                raise _Refused(f"layer {i} is not a Qwen3.5 decoder layer")
        return out
    raise _Refused(f"{type(model).__name__} is neither a Qwen3-MoE nor a Qwen3.5-MoE model")


def _build(model, forward_batch):
    """The model's _Stack, or a string saying why SGLang's layer loop must run its decode steps."""
    try:
        return _build_stack(model, forward_batch)
    except _Refused as why:
        return str(why)


def _build_stack(model, forward_batch):
    from sglang.srt.model_executor.forward_context import get_attn_backend
    from sglang.srt.runtime_context import get_parallel

    from kt_serve.kernel.decode_stack import DecodeStack

    from .attention import backend_class

    if model.pp_group.world_size != 1 or get_parallel().attn_tp_size != 1:
        raise _Refused("pipeline or tensor parallelism")
    if model.start_layer != 0 or model.end_layer != len(model.layers) or not len(model.layers):
        raise _Refused("a partial layer range")
    layers = _layers(model)
    backend = get_attn_backend()
    full, linear = getattr(backend, "full_attn_backend", backend), getattr(backend, "linear_attn_backend", None)
    if not isinstance(full, backend_class()):
        raise _Refused(f"attention backend {type(full).__name__}, not kt_cpu")
    H = model.config.hidden_size
    stack = DecodeStack(H, _norm_weight("the final norm", model.norm, H), model.norm.variance_epsilon)
    buffers, gate_keys, lora_backend, lora_reason = [], [], None, None
    for i, (layer, kind, mixer) in enumerate(layers):
        if getattr(layer, "_is_layer_to_capture", False):
            raise _Refused("aux hidden-state capture")
        if not getattr(layer, "is_layer_sparse", True):
            raise _Refused(f"layer {i} has a dense MLP")
        moe, keys = _moe(i, layer.mlp, H)
        norms = dict(input_norm=_norm_weight(f"layer {i}'s input_layernorm", layer.input_layernorm, H),
                     input_eps=layer.input_layernorm.variance_epsilon,
                     post_norm=_norm_weight(f"layer {i}'s post_attention_layernorm", layer.post_attention_layernorm, H),
                     post_eps=layer.post_attention_layernorm.variance_epsilon)
        if kind == "gdn":
            if linear is None or not hasattr(linear, "req_to_token_pool"):
                raise _Refused("GDN layers without SGLang's linear-attention backend")
            args, layer_buffers = _gdn(i, mixer, linear)
            stack.add_gdn_layer(**norms, **args, moe=moe)
            projections = {"in_proj_qkvz": mixer.in_proj_qkvz, "in_proj_ba": mixer.in_proj_ba,
                           "out_proj": mixer.out_proj}
            keys.append((i, "linear_attn.in_proj_ba"))
        else:
            args, layer_buffers = _attention(i, mixer, mixer.attn, full, forward_batch, kind == "gated")
            stack.add_attention_layer(**norms, **args, moe=moe)
            projections = {"qkv": mixer.qkv_proj, "o": mixer.o_proj}
        shared = getattr(layer.mlp, "shared_expert", None)
        if shared is not None:
            projections.update(shared_gate_up=shared.gate_up_proj, shared_down=shared.down_proj)
        calls, lora_buffers, layer_backend, reason = _layer_lora(i, layer, projections)
        for name, lora in calls:
            stack.set_lora(i, name, lora)
        buffers += layer_buffers + lora_buffers
        gate_keys += keys
        lora_backend, lora_reason = lora_backend or layer_backend, lora_reason or reason
    return _Stack(stack, buffers, tuple(gate_keys), lora_backend, lora_reason)


def _moved(plan: _Stack) -> bool:
    """Whether SGLang has replaced a pool or LoRA buffer since the stack took its address."""
    for current, tensor in plan.buffers:
        now = current()
        if now is not tensor and (not isinstance(now, torch.Tensor) or now.data_ptr() != tensor.data_ptr()):
            return True
    return False


def _state_slots(forward_batch, backend, B: int):
    """(the GDN layers' state slot per request, int32 [B], or None without them; why this batch keeps the loop)."""
    linear = getattr(backend, "linear_attn_backend", None)
    if linear is None:
        return None, None
    meta = getattr(linear, "forward_metadata", None)
    slots = getattr(meta, "mamba_cache_indices", None)
    if not isinstance(slots, torch.Tensor) or slots.shape != (B,):
        return None, "a decode batch without its GDN state slots"
    if getattr(forward_batch, "mamba_track_mask", None) is not None or getattr(meta, "replayssm_write_pos", None) is not None:
        return None, "GDN states tracked for the radix cache"
    return slots.to(torch.int32).contiguous(), None


def _positions(positions: torch.Tensor, B: int):
    """The step's positions as int64 [B] (a multimodal [3, B] only where its three sections agree, as for text)."""
    from .rotary import text_positions

    rows = text_positions(positions)
    if rows is None or rows.dtype != torch.int64 or rows.shape != (B,):
        return None
    return rows.contiguous()


def _step_reason(plan: _Stack, B: int, forward_batch, full) -> str | None:
    """Why this decode batch of B requests keeps SGLang's layer loop, or None."""
    from .moe_block import batch_reason, router_lora_reason

    if B > plan.stack.max_tokens:
        return "a batch larger than the experts' max_tokens"
    if full.step_req_indices is None or full.step_req_indices.shape[0] != B:
        return "a decode batch without its attention metadata"
    loc = forward_batch.out_cache_loc
    if loc.dtype != torch.int64 or loc.shape != (B,) or not loc.is_contiguous():
        return "cache locations that are not int64 [batch]"
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


def forward(original, model, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None, *args,
            **kw):
    """AROUND Qwen2MoeModel.forward (which Qwen3MoeModel inherits) and Qwen3_5ForCausalLM.forward (whose extra
    argument, deepstack embeddings, comes positionally or by name)."""
    deepstack = args[0] if args else kw.get("input_deepstack_embeds")
    if (len(args) > 1 or set(kw) - {"input_deepstack_embeds"} or pp_proxy_tensors is not None
            or (deepstack is not None and deepstack.numel() > 0) or not forward_batch.forward_mode.is_decode()
            or getattr(forward_batch, "can_run_tbo", False)):
        return original(model, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors, *args, **kw)
    from sglang.srt.model_executor.forward_context import get_attn_backend

    B = int(input_embeds.shape[0] if input_embeds is not None else input_ids.shape[0])
    if B == 0:
        return original(model, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors, *args, **kw)
    backend = get_attn_backend()
    plan = model.__dict__.get(_PLAN)
    if plan is None or (not isinstance(plan, str) and _moved(plan)):
        plan = model.__dict__[_PLAN] = _build(model, forward_batch)
    if isinstance(plan, str):
        log_once(logger, f"decode steps keep SGLang's layer loop: {plan}")
        return original(model, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors, *args, **kw)
    full = getattr(backend, "full_attn_backend", backend)
    step_positions = _positions(positions, B)
    reason = None if step_positions is not None else "positions that are not one per request (or multimodal " \
                                                     "sections that differ)"
    reason = reason or _step_reason(plan, B, forward_batch, full)
    state_slots, lora = None, None
    if reason is None:
        state_slots, reason = _state_slots(forward_batch, backend, B)
    if reason is None:
        lora, reason = _lora_segments(plan)
    if reason is None and input_embeds is not None and (input_embeds.dtype != torch.bfloat16
                                                        or input_embeds.shape != (B, plan.stack.hidden)):
        reason = "input embeddings that are not bf16 [batch, hidden]"
    if reason is not None:
        log_once(logger, f"this decode batch keeps SGLang's layer loop: {reason}")
        return original(model, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors, *args, **kw)
    log_once(logger, f"decode steps in one kernel call ({plan.stack.num_layers} layers and the final norm)")
    if lora is not None:
        log_once(logger, "decode steps apply SGLang's LoRA of the layers' projections inside that call (segmented, "
                 "as its torch_native backend)")
    x = (model.embed_tokens(input_ids) if input_embeds is None else input_embeds).contiguous()
    if input_embeds is not None and x.data_ptr() == input_embeds.data_ptr():
        x = x.clone()  # the stack writes its output over x: never over the caller's tensor
    slots = get_registry().slots_for(B)
    return plan.stack.forward(x, step_positions, full.req_to_token_pool.req_to_token, full.step_req_indices,
                              full.step_seq_lens, forward_batch.out_cache_loc, state_slots, slots, lora)
