"""A CPU host's MoE block router path (router gate, softmax top-k, routed experts) in one kernel call.

Two block kinds: Qwen3-MoE's ``Qwen3MoeSparseMoeBlock.forward_normal`` (the whole block), and the router path of
``Qwen2MoeSparseMoeBlock`` (Qwen2-MoE, Qwen3.5-MoE), ``_forward_router_experts``, whose shared expert and its
sigmoid gate keep running as SGLang's modules around it.

SGLang runs the block as the gate's linear layer, its TopK op (a softmax, a top-k and a renormalisation, each a
torch dispatch, inside select_experts' checks for EPLB, capture and shared slots) and a dispatch through FusedMoE
to our experts method. At decode the expert weights streamed just before have evicted the interpreter's working
set from the caches, so each of those Python steps runs cold: timing a Qwen3-30B-A3B-shaped decode step inside the
server put the block at 0.8 ms per layer beyond its two weight streams (evals/bench_cpu_ops.py --cold shows the
effect on single ops). When the block is plain, :meth:`kt_serve.kernel.experts.MoEExperts.forward_routed` runs all of it
in C++ with SGLang's routing arithmetic (bf16 gate logits, fp32 softmax over all experts, top-k, renormalised as
the model asks); with router LoRA in a request's adapter, SGLang's gate module (which the plugin's gate LoRA wraps)
gives the logits and the kernel routes from them. Anything else keeps SGLang's path, with the reason logged once:
EPLB or expert-location dispatch, routed-expert capture, an expert distribution recording, padded token counts,
grouped / biased / custom routing, shared top-k slots, waterfill, tensor or expert parallelism.
``--kt-cpu-ops auto|on|off`` with linear.py, which packs the gate.

Also here, on every CPU host: SGLang's fused shared-expert gate ops (Qwen2-MoE / Qwen3.5), which have no CPU
driver, with the gate LoRA of the requests' adapters.
"""

from __future__ import annotations

import logging

import torch

from ..adapters.registry import get_registry
from ..log import log_once

logger = logging.getLogger(__name__)
_PLAN = "_kt_moe_block"  # on the block: its _Plan, or the reason it has none


class _Plan:
    __slots__ = ("gate", "experts", "top_k", "renormalize", "gate_key")

    def __init__(self, gate, experts, top_k: int, renormalize: bool, gate_key):
        self.gate, self.experts, self.top_k, self.renormalize, self.gate_key = (gate, experts, top_k, renormalize,
                                                                               gate_key)


def block_plan(block):
    """The block's _Plan, or a string saying why SGLang's own path must run it (worked out once per block)."""
    plan = getattr(block, _PLAN, None)
    if plan is None:
        plan = _plan(block)
        setattr(block, _PLAN, plan)
    return plan


def _plan(block):
    from sglang.srt.eplb.expert_distribution import (_ExpertDistributionRecorderNoop,
                                                     get_global_expert_distribution_recorder)
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo
    from sglang.srt.environ import envs

    from ..experts import KTRoutedExpertsMethod
    from .linear import packed_of

    experts, topk, gate = getattr(block, "experts", None), getattr(block, "topk", None), getattr(block, "gate", None)
    method = getattr(experts, "quant_method", None)
    if not isinstance(method, KTRoutedExpertsMethod) or method.experts is None:
        return "its routed experts are not on the kt_serve kernel"
    if getattr(experts, "moe_tp_size", 1) != 1 or getattr(experts, "moe_ep_size", 1) != 1:
        return "tensor or expert parallel MoE"
    if getattr(experts, "_dwdp_bound", False):
        return "DWDP weight prefetch"
    packed = packed_of(gate)
    if packed is None or packed.bias is not None:
        return "its router gate is not a packed bf16 layer without bias"
    cfg = getattr(topk, "topk_config", None)
    if cfg is None or cfg.scoring_func != "softmax" or cfg.use_grouped_topk or cfg.custom_routing_function \
            or cfg.correction_bias is not None or cfg.num_shared_topk_slots != 0 \
            or (cfg.routed_scaling_factor is not None and cfg.apply_routed_scaling_factor_on_output):
        return "routing other than plain softmax top-k"
    if getattr(topk, "enable_waterfill", False) or getattr(topk, "waterfill_balancer", None) is not None:
        return "waterfill balancing"
    if ExpertLocationDispatchInfo.init_new(block.layer_id) is not None:
        return "expert-location dispatch (EPLB)"
    if envs.SGLANG_SIMULATE_UNIFORM_EXPERTS.get() or envs.SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS.get():
        return "simulated expert routing"
    if not isinstance(get_global_expert_distribution_recorder(), _ExpertDistributionRecorderNoop):
        return "expert distribution recording"
    return _Plan(packed, method.experts, int(cfg.top_k), bool(cfg.renormalize), (block.layer_id, "mlp.gate"))


def batch_reason(num_tokens: int):
    """Why a batch of num_tokens must take SGLang's router path in every block, or None."""
    from sglang.srt.model_executor.forward_context import get_forward_context, has_forward_context
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    if get_global_experts_capturer() is not None:
        return "routed-expert capture"
    bound = get_forward_context().moe_num_token_non_padded if has_forward_context() else None
    real = bound() if bound is not None else None
    if real is not None and int(real) < num_tokens:  # SGLang would mask the padded rows' experts
        return "padded rows in the batch"
    return None


def router_lora_reason(gate_keys) -> str | None:
    """Why blocks whose gates are ``gate_keys`` must take SGLang's path now: an adapter of the batch with LoRA on
    one of them."""
    return "gate LoRA (router, shared-expert gate or in_proj_ba) in a request's adapter" \
        if get_registry().router_lora_in_batch(gate_keys) else None


def _routed(block, x: torch.Tensor):
    """The block's routed output for the rows x from one kernel call, or None where SGLang's path must run."""
    plan = block_plan(block)
    if isinstance(plan, str):
        reason = plan
    elif x.dim() != 2 or x.device.type != "cpu" or x.dtype != torch.bfloat16:
        reason = "an input that is not a CPU bf16 [tokens, hidden] tensor"
    else:
        reason = batch_reason(x.shape[0])
    if reason is not None:
        log_once(logger, f"MoE blocks keep SGLang's router path: {reason}")
        return None
    x = x if x.is_contiguous() else x.contiguous()
    slots = get_registry().slots_for(x.shape[0])
    gate = plan.gate
    if router_lora_reason((plan.gate_key,)) is not None:
        # the gate module (which the plugin's gate LoRA wraps) gives the logits; routing and experts stay the
        # kernel's, so the batch's other requests get what a batch without router LoRA gives them
        log_once(logger, "MoE blocks with router LoRA: SGLang's gate module for the logits, then one kernel call")
        logits = block.gate(x)
        logits = logits[0] if isinstance(logits, tuple) else logits
        if logits.dtype != torch.bfloat16 or logits.shape != (x.shape[0], plan.experts.num_experts):
            return None
        gate = logits.contiguous()
    else:
        log_once(logger, "MoE blocks in one kernel call (router gate, softmax top-k, routed experts)")
    return plan.experts.forward_routed(x, gate, plan.top_k, plan.renormalize, slots)


def forward_normal(original, block, hidden_states: torch.Tensor):
    """AROUND Qwen3MoeSparseMoeBlock.forward_normal."""
    if hidden_states.shape[0] == 0:  # an empty batch: nothing to route, nothing to say
        return original(block, hidden_states)
    out = _routed(block, hidden_states)
    return original(block, hidden_states) if out is None else out


def router_experts(original, block, hidden_states: torch.Tensor, *, defer_finalize: bool = False):
    """AROUND Qwen2MoeSparseMoeBlock._forward_router_experts (its caller adds the shared expert)."""
    if defer_finalize or block.enable_shared_expert_fusion or hidden_states.shape[0] == 0:
        return original(block, hidden_states, defer_finalize=defer_finalize)
    out = _routed(block, hidden_states)
    return original(block, hidden_states, defer_finalize=defer_finalize) if out is None else out


# -- the shared-expert gate ---------------------------------------------------------------------------------
def _shared_expert_gate(hidden_states, gate_weight):
    """sigmoid of the shared-expert gate (fp32), with the gate LoRA of the requests' adapters: SGLang hands the
    fused op the gate's weight, not the module, so gate_lora finds its LoRA by that weight."""
    logit = hidden_states.float() @ gate_weight.float().reshape(-1, 1)
    get_registry().gates.add_delta_by_weight(gate_weight, hidden_states, logit)
    return torch.sigmoid(logit)


def gate_sigmoid_mul_add_cpu(original, hidden_states, gate_weight, shared_output, final_hidden_states):
    """AROUND fused_gate_sigmoid_mul_add: the Triton kernel has no CPU driver (Qwen2-MoE shared-expert gate). bf16
    in C++ (what the one-call decode step runs, so its tokens equal this loop's), else in torch."""
    if hidden_states.device.type != "cpu":
        return original(hidden_states, gate_weight, shared_output, final_hidden_states)
    from kt_serve.kernel.activation import shared_expert_gate_add

    delta = None
    if get_registry().gates.adapters:  # the gate LoRA of the requests' adapters, as a logit delta
        delta = torch.zeros(hidden_states.shape[0], 1)
        get_registry().gates.add_delta_by_weight(gate_weight, hidden_states, delta)
    if shared_expert_gate_add(hidden_states, gate_weight, shared_output, final_hidden_states, delta):
        return
    gate = _shared_expert_gate(hidden_states, gate_weight)
    final_hidden_states.add_((gate * shared_output.float()).to(final_hidden_states.dtype))


def gate_sigmoid_mul_cpu(original, hidden_states, gate_weight, shared_output, *args, **kwargs):
    """AROUND fused_gate_sigmoid_mul (out-of-place variant of the above)."""
    if hidden_states.device.type != "cpu" or args or kwargs:
        return original(hidden_states, gate_weight, shared_output, *args, **kwargs)
    return (_shared_expert_gate(hidden_states, gate_weight) * shared_output.float()).to(shared_output.dtype)
