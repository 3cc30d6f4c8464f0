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


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import args

    HookRegistry.register(f"{SERVER_ARGS}.add_cli_args", args.add_cli_args_hook, HookType.AFTER)
    HookRegistry.register(f"{SERVER_ARGS}.from_cli_args", args.from_cli_args_hook, HookType.AFTER)
    if multiprocessing.parent_process() is None:
        return  # launcher / tokenizer process
    _register_worker_hooks(HookRegistry, HookType)


def _register_worker_hooks(HookRegistry, HookType) -> None:
    from . import cpu_compat

    if cpu_compat.cpu_only_host():
        cpu_compat.disable_pin_memory()
        HookRegistry.register(f"{ELEMENTWISE}.fused_gate_sigmoid_mul_add", cpu_compat.gate_sigmoid_mul_add_cpu,
                              HookType.AROUND)
        HookRegistry.register(f"{ELEMENTWISE}.fused_gate_sigmoid_mul", cpu_compat.gate_sigmoid_mul_cpu,
                              HookType.AROUND)
        HookRegistry.register(f"{DEEPSEEK_ATTENTION}.get_handler", cpu_compat.mla_handler_torch_native,
                              HookType.AROUND)
    config = get_config()
    if not config.enabled:
        return
    from . import lora_hooks

    HookRegistry.register(f"{RUNTIME_CONTEXT}.publish", keep_shared_experts_separate, HookType.AFTER)
    HookRegistry.register(f"{FUSED_MOE}.__init__", fused_moe_init, HookType.BEFORE)
    HookRegistry.register(f"{MODEL_RUNNER}.load_model", after_load_model, HookType.AFTER)
    HookRegistry.register(f"{LORA_MANAGER}._load_lora_adapter", lora_hooks.load_lora_adapter, HookType.AROUND)
    HookRegistry.register(f"{LORA_MANAGER}._unload_lora_adapter", lora_hooks.unload_lora_adapter, HookType.AROUND)
    HookRegistry.register(f"{LORA_MANAGER}.prepare_lora_batch", lora_hooks.prepare_lora_batch, HookType.AFTER)
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
    """BEFORE FusedMoE.__init__: give unquantized MoE layers our quant method (routed experts in the kernel)."""
    global _fused_moe_signature
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    from .experts import KTRoutedExpertsMethod

    if _fused_moe_signature is None:
        _fused_moe_signature = inspect.signature(getattr(FusedMoE.__init__, "__wrapped__", FusedMoE.__init__))
    bound = _fused_moe_signature.bind(*args, **kwargs)
    layer = bound.arguments["self"]
    if getattr(layer, "is_shared_fused_moe", False):
        return None
    if bound.arguments.get("quant_method") is not None or bound.arguments.get("quant_config") is not None:
        raise ValueError("kt_serve: quantized MoE checkpoints are not supported by the kt_serve kernel "
                         "(bf16 experts only); pass --kt-moe off to use SGLang's own MoE path")
    kwargs["quant_method"] = KTRoutedExpertsMethod()
    return args, kwargs


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
