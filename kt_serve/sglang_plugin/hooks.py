"""Every SGLang target this plugin patches, in one place.

The launcher process only gets the CLI hooks; scheduler processes (spawned children) get the model and LoRA
hooks, so the launcher does not import SGLang's model code.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing

from .config import get_config

logger = logging.getLogger(__name__)

SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
FUSED_MOE = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"
LORA_MANAGER = "sglang.srt.lora.lora_manager.LoRAManager"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
ELEMENTWISE = "sglang.kernels.ops.elementwise.elementwise"
RUNTIME_CONTEXT = "sglang.srt.runtime_context"
DEEPSEEK_ATTENTION = "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry"
FP8_CONFIG = "sglang.srt.layers.quantization.fp8.Fp8Config"
DEEPSEEK_WEIGHT_LOADER = "sglang.srt.models.deepseek_common.deepseek_weight_loader.DeepseekV2WeightLoaderMixin"


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import args, cpu_compat

    if cpu_compat.cpu_only_host():  # before any process imports SGLang's Qwen3.5 model or its GDN backend
        from .qwen35_ops import install_qwen35_cpu_ops

        install_qwen35_cpu_ops()
        from . import cpu_attention

        cpu_attention.add_choice()
    HookRegistry.register(f"{SERVER_ARGS}.add_cli_args", args.add_cli_args_hook, HookType.AFTER)
    HookRegistry.register(f"{SERVER_ARGS}.from_cli_args", cpu_compat.hybrid_cache_on_cpu, HookType.BEFORE)
    HookRegistry.register(f"{SERVER_ARGS}.from_cli_args", args.default_attention_backend_hook, HookType.BEFORE)
    HookRegistry.register(f"{SERVER_ARGS}.from_cli_args", args.from_cli_args_hook, HookType.AFTER)
    if multiprocessing.parent_process() is None:
        return  # launcher / tokenizer process
    _register_worker_hooks(HookRegistry, HookType)


def _register_worker_hooks(HookRegistry, HookType) -> None:
    from . import cpu_compat

    if cpu_compat.cpu_only_host():
        cpu_compat.disable_pin_memory()
        from . import cpu_attention

        cpu_attention.register_backend()
        if get_config().cpu_ops_enabled:
            from . import dense_linear

            HookRegistry.register(f"{MODEL_RUNNER}.load_model", dense_linear.after_load_model, HookType.AFTER)
            HookRegistry.register(f"{dense_linear.UNQUANTIZED_LINEAR}.apply", dense_linear.linear_apply,
                                  HookType.AROUND)
            HookRegistry.register(f"{dense_linear.LOGITS_PROCESSOR}._compute_lm_head", dense_linear.compute_lm_head,
                                  HookType.AROUND)
            from . import cpu_lora

            for op in ("sgemm_lora_a_fwd", "sgemm_lora_b_fwd"):
                HookRegistry.register(f"{cpu_lora.TORCH_LORA_BACKEND}.{op}", getattr(cpu_lora, op), HookType.AROUND)
            if get_config().enabled:
                from . import moe_block

                HookRegistry.register(f"{moe_block.QWEN3_MOE_BLOCK}.forward_normal", moe_block.forward_normal,
                                      HookType.AROUND)
                HookRegistry.register(f"{moe_block.QWEN2_MOE_BLOCK}._forward_router_experts",
                                      moe_block.router_experts, HookType.AROUND)
                from . import decode_step

                HookRegistry.register(f"{decode_step.QWEN2_MOE_MODEL}.forward", decode_step.forward, HookType.AROUND)
            from sglang.srt.utils.common import cpu_has_amx_support

            if not cpu_has_amx_support():  # with AMX, SGLang's forward_cpu runs its own fused kernel
                from . import cpu_norm, cpu_rotary

                HookRegistry.register(f"{cpu_norm.RMS_NORM}.forward_native", cpu_norm.rms_norm_forward_native,
                                      HookType.AROUND)
                HookRegistry.register(f"{cpu_norm.GEMMA_RMS_NORM}.forward_native",
                                      cpu_norm.gemma_rms_norm_forward_native, HookType.AROUND)
                HookRegistry.register(f"{cpu_rotary.ROTARY_EMBEDDING}.forward_native",
                                      cpu_rotary.rotary_forward_native, HookType.AROUND)
                HookRegistry.register(f"{cpu_rotary.QWEN3_MOE_ATTENTION}.apply_qk_norm_rope",
                                      cpu_rotary.apply_qk_norm_rope, HookType.AROUND)
        HookRegistry.register(f"{ELEMENTWISE}.fused_gate_sigmoid_mul_add", cpu_compat.gate_sigmoid_mul_add_cpu,
                              HookType.AROUND)
        HookRegistry.register(f"{ELEMENTWISE}.fused_gate_sigmoid_mul", cpu_compat.gate_sigmoid_mul_cpu,
                              HookType.AROUND)
        HookRegistry.register(f"{DEEPSEEK_ATTENTION}.get_handler", cpu_compat.mla_handler_torch_native,
                              HookType.AROUND)
        from .qwen35_ops import (GATED_DELTA_NET_INIT, RMS_NORM_GATED_FORWARD, lora_safe_fused_input_proj_probe,
                                 rms_norm_gated_forward_hook)

        HookRegistry.register(RMS_NORM_GATED_FORWARD, rms_norm_gated_forward_hook, HookType.AROUND)
        HookRegistry.register(GATED_DELTA_NET_INIT, lora_safe_fused_input_proj_probe, HookType.AFTER)
        from .fp8_linear import dequantize_before_deepseek_post_load, fp8_linear_method_cpu, register_weight_loader_v2

        register_weight_loader_v2()
        HookRegistry.register(f"{FP8_CONFIG}.get_quant_method", fp8_linear_method_cpu, HookType.AROUND)
        HookRegistry.register(f"{DEEPSEEK_WEIGHT_LOADER}.post_load_weights", dequantize_before_deepseek_post_load,
                              HookType.BEFORE)
    from . import mla_lora  # LoRA on every DeepSeek MLA projection (kv_b_proj's absorbed correction in torch on CPU)

    mla_lora.register(HookRegistry, HookType)
    from . import lora_hooks

    # Also with --kt-moe off: adapter names SGLang reads otherwise (Qwen3.5's in_proj_qkv) are mapped, router and
    # gate LoRA applied by the plugin, modules nothing applies refused, and a composite adapter gets a one-line
    # reason instead of SGLang's key error.
    HookRegistry.register(f"{LORA_MANAGER}._load_lora_adapter", lora_hooks.load_lora_adapter, HookType.AROUND)
    HookRegistry.register(f"{LORA_MANAGER}._unload_lora_adapter", lora_hooks.unload_lora_adapter, HookType.AROUND)
    HookRegistry.register(f"{LORA_MANAGER}.prepare_lora_batch", lora_hooks.prepare_lora_batch, HookType.AFTER)
    from . import gate_lora  # LoRA on the router and gates, which SGLang's LoRA manager has no layer for

    HookRegistry.register(f"{MODEL_RUNNER}.load_model", gate_lora.after_load_model, HookType.AFTER)
    config = get_config()
    if not config.enabled:
        return
    HookRegistry.register(f"{RUNTIME_CONTEXT}.publish", keep_shared_experts_separate, HookType.AFTER)
    HookRegistry.register(f"{FUSED_MOE}.__init__", fused_moe_init, HookType.BEFORE)
    HookRegistry.register(f"{MODEL_RUNNER}.load_model", after_load_model, HookType.AFTER)
    HookRegistry.register(f"{LORA_MANAGER}.init_lora_modules", lora_hooks.init_lora_modules, HookType.AROUND)


def keep_shared_experts_separate(context, server_args, *args, role=None, **kwargs):
    """AFTER runtime_context.publish in a scheduler: no shared-expert fusion into the routed FusedMoE.

    SGLang can fuse DeepSeek / Qwen2-MoE shared experts into FusedMoE as extra experts (by default for DeepSeek-V3
    on CUDA). The kernel would then hold them as routed experts that expert adapters do not cover, and SGLang's LoRA
    manager would lose its shared_experts target; kept separate, they run as SGLang's dense MLP (on the GPU).
    """
    if role != "scheduler":
        return context
    if server_args.enforce_shared_experts_fusion:
        raise ValueError("--enforce-shared-experts-fusion: the kt_serve kernel runs routed experts only and keeps "
                         "shared experts in SGLang's MLP; drop the flag or pass --kt-moe off")
    context.override("kt_serve", disable_shared_experts_fusion=True)
    return context


_fused_moe_signature = None


def fused_moe_init(*args, **kwargs):
    """BEFORE FusedMoE.__init__: give bf16 and FP8 MoE layers our quant method (routed experts in the kernel)."""
    global _fused_moe_signature
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    from .experts import KTRoutedExpertsMethod

    if _fused_moe_signature is None:
        _fused_moe_signature = inspect.signature(getattr(FusedMoE.__init__, "__wrapped__", FusedMoE.__init__))
    bound = _fused_moe_signature.bind(*args, **kwargs)
    layer = bound.arguments["self"]
    if getattr(layer, "is_shared_fused_moe", False):
        return None
    if bound.arguments.get("quant_method") is not None:
        raise ValueError("kt_serve: this MoE layer comes with its own quant method; the kt_serve kernel takes bf16 "
                         "and FP8 block-quantized experts; pass --kt-moe off to use SGLang's own MoE path")
    fp8_block = checkpoint_fp8_block(bound.arguments.get("quant_config"), bound.arguments.get("prefix", ""))
    kwargs["quant_method"] = KTRoutedExpertsMethod(fp8_block)
    return args, kwargs


def checkpoint_fp8_block(quant_config, prefix: str):
    """The [rows, cols] of the FP8 scale blocks of this MoE layer's checkpoint experts, or None for bf16 experts.
    Refuses, naming the format and the flags to use, a checkpoint quantization the kernel does not read."""
    if quant_config is None:
        return None
    name = quant_config.get_name()
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    if isinstance(quant_config, Fp8Config):
        from sglang.srt.layers.quantization.utils import is_layer_skipped

        if is_layer_skipped(prefix, quant_config.ignored_layers, fused_mapping=quant_config.packed_modules_mapping):
            return None  # listed under modules_to_not_convert: bf16 experts
        if (quant_config.is_checkpoint_fp8_serialized and quant_config.weight_block_size
                and not getattr(quant_config, "use_mxfp8", False)):
            return tuple(int(v) for v in quant_config.weight_block_size)
        name = "fp8 without block scales" if quant_config.is_checkpoint_fp8_serialized else "fp8 (online)"
    raise ValueError(f"kt_serve: MoE checkpoint quantization '{name}' is not read by the kt_serve kernel (it reads "
                     "bf16 and FP8 block-quantized experts); serve a bf16 or FP8 checkpoint, with "
                     "--kt-expert-dtype int8 or int4 to quantize it at load, or pass --kt-moe off")


def after_load_model(result, model_runner, *args, **kwargs):
    """AFTER ModelRunner.load_model: refuse --kt-expert-lora-path on a model without MoE layers."""
    from .experts import _is_compute_rank, get_registry

    config = get_config()
    if not _is_compute_rank():
        return result
    registry = get_registry()
    if config.expert_lora_path and not registry.layers:
        raise ValueError(f"--kt-expert-lora-path {config.expert_lora_path}: model "
                         f"{model_runner.model_config.model_path} has no MoE layers with routed experts")
    registry.check_global_complete(registry.layers)
    return result
