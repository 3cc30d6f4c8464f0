"""Hooks on SGLang's LoRAManager, ModelRunner and MoE blocks: composite adapters loaded into the registry, the
batch's adapters handed to it per forward, gate modules wrapped at model load, LoRA Experts added to the MoE blocks'
outputs, and the MoE wrapping guard."""

from __future__ import annotations

import logging

import msgspec

from ..config import get_config
from .batch import forward_batch_seq_lens
from .registry import get_registry
from .split import split_composite

logger = logging.getLogger(__name__)


def load_lora_adapter(original, manager, lora_ref, *args, **kwargs):
    """AROUND LoRAManager._load_lora_adapter (start-up --lora-paths and /load_lora_adapter both land here).

    A composite dir is split: the expert half goes into a kernel slot keyed by lora_id, gate LoRA (router, gates)
    into gate_lora, SGLang loads the rest. Any failure returns SGLang's failure result (HTTP 400) with nothing
    left loaded.
    """
    from kt_serve.formats.sglang_modules import gdn_dims

    def failed(e):
        message = str(e) if str(e).startswith(str(lora_ref.lora_path)) else f"{lora_ref.lora_path}: {e}"
        return manager.create_lora_update_result(success=False, error_message=message)

    try:
        split = split_composite(lora_ref.lora_path, gdn_dims(manager.base_hf_config))
    except Exception as e:  # unreadable or malformed adapter dir, or a module nothing can apply
        return failed(e)
    if split.experts is not None and not get_config().enabled:
        return failed(ValueError("routed-expert LoRA needs --kt-moe on"))
    registry = get_registry()
    registry.experts.max_per_batch = manager.max_loras_per_batch
    try:
        experts_loaded = registry.load(lora_ref.lora_id, lora_ref.lora_path, split, name=lora_ref.lora_name,
                                       pinned=bool(lora_ref.pinned))
    except Exception as e:
        return failed(e)
    result = original(manager, msgspec.structs.replace(lora_ref, lora_path=split.sglang_path), *args, **kwargs)
    if not result.success:
        registry.unload(lora_ref.lora_id)
    elif experts_loaded or split.gates:
        entry = registry.experts.entries.get(lora_ref.lora_id)
        logger.info("kt_serve: adapter %s: expert half %s, %d gate LoRA modules in the plugin, the rest in SGLang",
                    lora_ref.lora_name, "none" if entry is None else "registered" if entry.slot is None
                    else f"in kernel slot {entry.slot}", len(split.gates))
    return result


def unload_lora_adapter(original, manager, lora_ref, *args, **kwargs):
    """AROUND LoRAManager._unload_lora_adapter (also SGLang's --max-loaded-loras eviction): the expert half and the
    gate LoRA go with SGLang's half."""
    result = original(manager, lora_ref, *args, **kwargs)
    get_registry().unload(lora_ref.lora_id)
    return result


def prepare_lora_batch(result, manager, forward_batch, *args, **kwargs):
    """AFTER LoRAManager.prepare_lora_batch: the batch's expert halves made resident, then the adapter of each token
    for this forward (kernel slots; the gate LoRA's token groups)."""
    get_registry().prepare_batch(
        forward_batch.lora_ids, forward_batch_seq_lens(forward_batch),
        layer_lora=any(_has_layer_lora(manager, uid) for uid in set(forward_batch.lora_ids) if uid),
        expert_slots=get_config().enabled)
    return result


def _has_layer_lora(manager, uid) -> bool:
    """Whether SGLang's half of adapter uid has weights inside the decoder layers (q/k/v/o, MLPs): the decode stack
    (cpu_host/decode_stack.py) then applies them from SGLang's LoRA buffers, or keeps SGLang's loop where it cannot;
    an adapter with none (its LoRA on embeddings or lm_head only, which run outside the stack) needs neither. Cached
    per adapter."""
    known = manager.__dict__.setdefault("_kt_layer_lora", {})
    if uid not in known:
        adapter = manager.loras.get(uid)
        known[uid] = adapter is None or any(layer.weights for layer in adapter.layers)
    return known[uid]


class _NotAFusedMoE:
    """Stands in for FusedMoE while SGLang picks LoRA targets, so no routed-expert layer gets wrapped."""


def init_lora_modules(original, manager, *args, **kwargs):
    """AROUND LoRAManager.init_lora_modules: never wrap FusedMoE (notes: the gate_up_proj + down_proj trigger).

    A non-expert adapter that trains shared-expert or dense MLPs targets gate_up_proj and down_proj, which makes
    SGLang wrap every FusedMoE in its Triton expert-LoRA runner; our kernel applies expert LoRA instead.
    """
    if not get_config().enabled:
        return original(manager, *args, **kwargs)
    import sglang.srt.lora.lora_manager as lora_manager_module

    saved = lora_manager_module.FusedMoE
    lora_manager_module.FusedMoE = _NotAFusedMoE
    try:
        return original(manager, *args, **kwargs)
    finally:
        lora_manager_module.FusedMoE = saved


def attach_gates(result, model_runner, *args, **kwargs):
    """AFTER ModelRunner.load_model: with --enable-lora, wrap the gating projections of the loaded model and note
    its MoE blocks for LoRA Experts."""
    if getattr(model_runner.server_args, "enable_lora", False):
        registry = get_registry()
        registry.gates.attach(model_runner.model, model_runner.server_args)
        registry.lora_experts.attach(model_runner.model, model_runner.model_config.dtype, model_runner.device)
    return result


def report_adapters(result, controller, *args, **kwargs):
    """AFTER the scheduler's get_internal_state (/get_server_info): the expert adapters registered, resident and
    pinned here, with their bytes, the budget and the load / eviction counts."""
    if get_config().enabled:
        result.internal_state["kt_expert_adapters"] = get_registry().experts.info()
    return result


def moe_block_forward(result, block, *args, **kwargs):
    """AFTER <MoE block>.forward(hidden_states, ...): the batch's LoRA Experts added to the block's output."""
    hidden_states = args[0] if args else kwargs["hidden_states"]
    get_registry().lora_experts.add_to_output(block, hidden_states, result)
    return result
