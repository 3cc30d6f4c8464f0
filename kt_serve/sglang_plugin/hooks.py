"""Every SGLang target this plugin patches, in one place: the target strings below and the table of what runs where.

The launcher process only gets the CLI hooks and the tokenizer's adapter lookup; scheduler processes (spawned children) get the model and LoRA
hooks, so the launcher does not import SGLang's model code. Each hook's function lives with its concern: the
plugin core (args, experts), adapters/, cpu_host/ (a CPU-only host's engine) and models/ (per-model fixes).
"""

from __future__ import annotations

import multiprocessing

from .config import get_config

# -- the targets ---------------------------------------------------------------------------------------------------
SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
RUNTIME_CONTEXT = "sglang.srt.runtime_context"
FUSED_MOE = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"
LORA_MANAGER = "sglang.srt.lora.lora_manager.LoRAManager"
LORA_UTILS = "sglang.srt.lora.utils"
LORA_ADAPTER = "sglang.srt.lora.lora.LoRAAdapter"
REPLICATED_LORA = "sglang.srt.lora.layers.ReplicatedLinearWithLoRA"
KV_B_CORRECTION = "sglang.srt.lora.deepseek_mla_correction"
TORCH_LORA_BACKEND = "sglang.srt.lora.backend.torch_backend"
UNQUANTIZED_LINEAR = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod"
FP8_CONFIG = "sglang.srt.layers.quantization.fp8.Fp8Config"
LOGITS_PROCESSOR = "sglang.srt.layers.logits_processor.LogitsProcessor"
RMS_NORM = "sglang.srt.layers.layernorm.RMSNorm"
GEMMA_RMS_NORM = "sglang.srt.layers.layernorm.GemmaRMSNorm"
ROTARY_EMBEDDING = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding"
MROTARY_EMBEDDING = "sglang.srt.layers.rotary_embedding.mrope.MRotaryEmbedding"
SILU_AND_MUL = "sglang.srt.layers.activation.SiluAndMul"
ELEMENTWISE = "sglang.kernels.ops.elementwise.elementwise"
QWEN2_MOE_MODEL = "sglang.srt.models.qwen2_moe.Qwen2MoeModel"
QWEN2_MOE_BLOCK = "sglang.srt.models.qwen2_moe.Qwen2MoeSparseMoeBlock"
QWEN3_MOE_BLOCK = "sglang.srt.models.qwen3_moe.Qwen3MoeSparseMoeBlock"
DEEPSEEK_MOE_BLOCK = "sglang.srt.models.deepseek_v2.DeepseekV2MoE"
QWEN3_MOE_ATTENTION = "sglang.srt.models.qwen3_moe.Qwen3MoeAttention"
QWEN35_GATED_DELTA_NET = "sglang.srt.models.qwen3_5.Qwen3_5GatedDeltaNet"
QWEN35_MODEL = "sglang.srt.models.qwen3_5.Qwen3_5ForCausalLM"
FLA_GATED_RMS_NORM = "sglang.kernels.ops.attention.fla.layernorm_gated.RMSNorm"
DEEPSEEK_ATTENTION = "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
INTERNAL_STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
DEEPSEEK_WEIGHT_LOADER = "sglang.srt.models.deepseek_common.deepseek_weight_loader.DeepseekV2WeightLoaderMixin"
WEIGHT_UTILS = "sglang.srt.model_loader.weight_utils"
KV_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import args
    from .cpu_host.compat import cpu_only_host
    from .models import qwen35

    def hook(target, fn, kind):
        HookRegistry.register(target, fn, getattr(HookType, kind))

    if cpu_only_host():  # before any process imports SGLang's Qwen3.5 model or its GDN backend
        from .cpu_host import attention

        qwen35.install_qwen35_cpu_ops()
        attention.add_choice()
    hook(f"{SERVER_ARGS}.add_cli_args", args.add_cli_args_hook, "AFTER")
    hook(f"{SERVER_ARGS}.from_cli_args", qwen35.hybrid_cache_on_cpu, "BEFORE")
    hook(f"{SERVER_ARGS}.from_cli_args", args.default_attention_backend_hook, "BEFORE")
    hook(f"{SERVER_ARGS}.from_cli_args", args.accelerator_launch_hook, "BEFORE")
    hook(f"{SERVER_ARGS}.from_cli_args", args.from_cli_args_hook, "AFTER")
    if multiprocessing.parent_process() is None:
        from .adapters import lora_dir

        hook(f"{TOKENIZER_MANAGER}._resolve_lora_path", lora_dir.find_on_first_use, "BEFORE")
        return  # launcher / tokenizer process
    if cpu_only_host():
        _register_cpu_host_hooks(hook)
    _register_adapter_hooks(hook)
    if get_config().enabled:
        _register_expert_hooks(hook)


def _register_cpu_host_hooks(hook) -> None:
    """A CPU-only host's scheduler: SGLang's missing CPU ops, and (--kt-cpu-ops) its dense path on our kernel."""
    from .cpu_host import attention, compat, linear, moe_block
    from .memory import size_kv_pool
    from .models import deepseek_mla, qwen35

    compat.disable_pin_memory()
    hook(f"{KV_CONFIGURATOR}._profile_available_bytes", size_kv_pool, "AROUND")
    attention.register_backend()
    config = get_config()
    if config.cpu_ops_enabled:
        from sglang.srt.utils.common import cpu_has_amx_support

        from .cpu_host import decode_stack, lora_segments, norm, rotary

        hook(f"{MODEL_RUNNER}.load_model", linear.after_load_model, "AFTER")
        hook(f"{UNQUANTIZED_LINEAR}.apply", linear.linear_apply, "AROUND")
        hook(f"{LOGITS_PROCESSOR}._compute_lm_head", linear.compute_lm_head, "AROUND")
        hook(f"{LOGITS_PROCESSOR}.forward", linear.decode_logits, "AROUND")
        hook(f"{LORA_MANAGER}.init_lora_modules", linear.refuse_lora_on_quantized_lm_head, "AFTER")
        hook(f"{TORCH_LORA_BACKEND}.sgemm_lora_a_fwd", lora_segments.sgemm_lora_a_fwd, "AROUND")
        hook(f"{TORCH_LORA_BACKEND}.sgemm_lora_b_fwd", lora_segments.sgemm_lora_b_fwd, "AROUND")
        if config.enabled:
            hook(f"{QWEN3_MOE_BLOCK}.forward_normal", moe_block.forward_normal, "AROUND")
            hook(f"{QWEN2_MOE_BLOCK}._forward_router_experts", moe_block.router_experts, "AROUND")
            hook(f"{QWEN2_MOE_MODEL}.forward", decode_stack.forward, "AROUND")
            hook(f"{QWEN35_MODEL}.forward", decode_stack.forward, "AROUND")
        if not cpu_has_amx_support():  # with AMX, SGLang's forward_cpu runs its own fused kernel
            hook(f"{RMS_NORM}.forward_native", norm.rms_norm_forward_native, "AROUND")
            hook(f"{GEMMA_RMS_NORM}.forward_native", norm.gemma_rms_norm_forward_native, "AROUND")
            hook(f"{ROTARY_EMBEDDING}.forward_native", rotary.rotary_forward_native, "AROUND")
            hook(f"{MROTARY_EMBEDDING}.forward_native", rotary.mrope_forward_native, "AROUND")
            hook(f"{SILU_AND_MUL}.forward_native", norm.silu_and_mul_forward_native, "AROUND")
            hook(f"{QWEN3_MOE_ATTENTION}.apply_qk_norm_rope", rotary.apply_qk_norm_rope, "AROUND")
    hook(f"{ELEMENTWISE}.fused_gate_sigmoid_mul_add", moe_block.gate_sigmoid_mul_add_cpu, "AROUND")
    hook(f"{ELEMENTWISE}.fused_gate_sigmoid_mul", moe_block.gate_sigmoid_mul_cpu, "AROUND")
    hook(f"{DEEPSEEK_ATTENTION}.get_handler", deepseek_mla.handler_torch_native, "AROUND")
    hook(f"{FLA_GATED_RMS_NORM}.forward", qwen35.rms_norm_gated_forward_hook, "AROUND")
    hook(f"{QWEN35_GATED_DELTA_NET}.__init__", qwen35.lora_safe_fused_input_proj_probe, "AFTER")
    linear.register_weight_loader_v2()
    hook(f"{FP8_CONFIG}.get_quant_method", linear.fp8_linear_method_cpu, "AROUND")
    hook(f"{DEEPSEEK_WEIGHT_LOADER}.post_load_weights", linear.dequantize_before_deepseek_post_load, "BEFORE")


def _register_adapter_hooks(hook) -> None:
    """Every scheduler, also with --kt-moe off: adapter names SGLang reads otherwise (Qwen3.5's in_proj_qkv) are
    mapped, router and gate LoRA and KT-FT's LoRA Experts applied by the plugin, modules nothing applies refused, a composite adapter gets a
    one-line reason instead of SGLang's key error, and LoRA reaches every DeepSeek MLA projection."""
    from .adapters import manager_hooks
    from .models import deepseek_mla

    for block in (QWEN2_MOE_BLOCK, QWEN3_MOE_BLOCK, DEEPSEEK_MOE_BLOCK):
        hook(f"{block}.forward", manager_hooks.moe_block_forward, "AFTER")
    hook(f"{LORA_MANAGER}._load_lora_adapter", manager_hooks.load_lora_adapter, "AROUND")
    hook(f"{LORA_MANAGER}._unload_lora_adapter", manager_hooks.unload_lora_adapter, "AROUND")
    hook(f"{LORA_MANAGER}.prepare_lora_batch", manager_hooks.prepare_lora_batch, "AFTER")
    hook(f"{MODEL_RUNNER}.load_model", manager_hooks.attach_gates, "AFTER")
    hook(f"{LORA_MANAGER}.init_state", deepseek_mla.record_model, "BEFORE")
    hook(f"{LORA_MANAGER}.validate_new_adapter", deepseek_mla.refuse_unsupported, "BEFORE")
    hook(f"{LORA_UTILS}.get_normalized_target_modules", deepseek_mla.normalized_targets, "AROUND")
    hook(f"{LORA_UTILS}.get_default_hidden_dim", deepseek_mla.hidden_dim, "AROUND")
    hook(f"{LORA_UTILS}.auto_detect_lora_target_modules", deepseek_mla.detected_targets, "AFTER")
    hook(f"{LORA_ADAPTER}.normalize_qkv_proj", deepseek_mla.normalize_qkv, "AROUND")
    hook(f"{LORA_ADAPTER}.normalize_fused_qkv_a_proj", deepseek_mla.normalize_fused_a, "AROUND")
    hook(f"{REPLICATED_LORA}.apply_lora", deepseek_mla.replicated_apply_lora, "AROUND")
    hook(f"{KV_B_CORRECTION}.apply_q_correction", deepseek_mla.kv_b_q_correction, "AROUND")
    hook(f"{KV_B_CORRECTION}.apply_v_correction", deepseek_mla.kv_b_v_correction, "AROUND")


def _register_expert_hooks(hook) -> None:
    """--kt-moe on: routed experts in the kernel, expert adapters in its slots."""
    from .adapters import manager_hooks
    from . import checkpoint, experts

    hook(f"{RUNTIME_CONTEXT}.publish", experts.keep_shared_experts_separate, "AFTER")
    for iterator in ("safetensors_weights_iterator", "buffered_multi_thread_safetensors_weights_iterator"):
        hook(f"{WEIGHT_UTILS}.{iterator}", checkpoint.replace_safetensors_iterator, "AROUND")
    hook(f"{FUSED_MOE}.__init__", experts.fused_moe_init, "BEFORE")
    hook(f"{MODEL_RUNNER}.load_model", experts.set_routed_scales, "AFTER")
    hook(f"{MODEL_RUNNER}.load_model", experts.check_global_adapter, "AFTER")
    hook(f"{LORA_MANAGER}.init_lora_modules", manager_hooks.init_lora_modules, "AROUND")
    hook(f"{INTERNAL_STATE}.get_internal_state", manager_hooks.report_adapters, "AFTER")
