"""Run-time fixes for SGLang's CPU engine on a host without any accelerator (scheduler processes only).

Import-time problems (CUDA-linked torchvision, missing sgl_kernel, SGLANG_USE_CPU_ENGINE) are fixed by
launch/cpu_shims/install_shims.py, because they bite before any plugin runs. Everything here is a no-op when CUDA
is available.
"""

from __future__ import annotations

import functools
import os

import torch

# torch factories that SGLang's LoRA code calls with pin_memory=True (lora/layers.py, mem_pool.py, torch_backend.py)
_PIN_MEMORY_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like",
                         "ones_like", "full_like", "as_tensor", "empty_strided", "randn", "rand")


def cpu_only_host() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and not torch.cuda.is_available()


def split_cores_between_ranks(server_args, environ=os.environ) -> None:
    """SGLang's CPU engine gives each rank one NUMA node's cores and refuses more ranks than nodes unless
    SGLANG_CPU_OMP_THREADS_BIND names cores per rank (sglang/srt/utils/numa_utils.py). With fewer nodes than
    ranks (e.g. --tp-size 2 on a one-node host) split the physical cores evenly instead. Runs in the launcher,
    before the schedulers are spawned; a user's own setting wins."""
    if not cpu_only_host() or environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        return
    from sglang.srt.utils.common import get_cpu_ids_by_node

    ranks = server_args.tp_size * server_args.pp_size * server_args.dp_size
    nodes = get_cpu_ids_by_node()
    cpus = [c for node in nodes for c in node.split(",")]
    if ranks <= len(nodes) or ranks > len(cpus):
        return  # SGLang's default binding works, or it explains why no binding can
    per = len(cpus) // ranks
    environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(",".join(cpus[i * per:(i + 1) * per]) for i in range(ranks))


def _drop_pin_memory(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    wrapper._kt_serve_no_pin = True
    return wrapper


def disable_pin_memory() -> None:
    """pin_memory=True raises on CPU-only torch (sglang#31894); pinning has no meaning without a device anyway."""
    if getattr(torch.Tensor.pin_memory, "_kt_serve_no_pin", False):
        return
    for name in _PIN_MEMORY_FACTORIES:
        setattr(torch, name, _drop_pin_memory(getattr(torch, name)))

    def pin_memory(self, *args, **kwargs):
        return self

    def is_pinned(self, *args, **kwargs):
        return False

    pin_memory._kt_serve_no_pin = True
    torch.Tensor.pin_memory = pin_memory
    torch.Tensor.is_pinned = is_pinned


def _shared_expert_gate(hidden_states, gate_weight):
    """sigmoid of the shared-expert gate (fp32), with the gate LoRA of the requests' adapters: SGLang hands the
    fused op the gate's weight, not the module, so gate_lora finds its LoRA by that weight."""
    from .gate_lora import get_gate_lora

    logit = hidden_states.float() @ gate_weight.float().reshape(-1, 1)
    get_gate_lora().add_delta_by_weight(gate_weight, hidden_states, logit)
    return torch.sigmoid(logit)


def gate_sigmoid_mul_add_cpu(original, hidden_states, gate_weight, shared_output, final_hidden_states):
    """AROUND fused_gate_sigmoid_mul_add: the Triton kernel has no CPU driver (Qwen2-MoE shared-expert gate)."""
    if hidden_states.device.type != "cpu":
        return original(hidden_states, gate_weight, shared_output, final_hidden_states)
    gate = _shared_expert_gate(hidden_states, gate_weight)
    final_hidden_states.add_((gate * shared_output.float()).to(final_hidden_states.dtype))


def gate_sigmoid_mul_cpu(original, hidden_states, gate_weight, shared_output, *args, **kwargs):
    """AROUND fused_gate_sigmoid_mul (out-of-place variant of the above)."""
    if hidden_states.device.type != "cpu" or args or kwargs:
        return original(hidden_states, gate_weight, shared_output, *args, **kwargs)
    return (_shared_expert_gate(hidden_states, gate_weight) * shared_output.float()).to(shared_output.dtype)


def mla_handler_torch_native(original, registry, backend_name):
    """AROUND DeepSeek's AttentionBackendRegistry.get_handler: absorbed MLA on the torch_native backend.

    SGLang registers no DeepSeek handler for torch_native (the CPU default), so it falls back to Triton's, which
    picks MHA for a prefill; torch_native's MHA then reads the MLA latent cache as per-head K and fails ("Expected
    size ... [4, 32] but got: [4, 48]"). The absorbed MLA path, which decode uses anyway, reads that cache right.
    """
    if backend_name != "torch_native":
        return original(registry, backend_name)
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    return lambda attn, forward_batch: AttnForwardMethod.MLA


def local_model_config(model_path) -> dict | None:
    """A local checkpoint's config.json, or None (a hub id, or unreadable: SGLang reports that itself)."""
    import json

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError, TypeError):
        return None
    return config if isinstance(config, dict) else None


def _hybrid_linear_attention(model_path) -> bool:
    """Whether a local checkpoint mixes linear-attention (GDN / Mamba) layers with full attention (Qwen3.5)."""
    config = local_model_config(model_path)
    if config is None:
        return False
    text = config.get("text_config") or config
    return "linear_attention" in (text.get("layer_types") or []) or "full_attention_interval" in text


def hybrid_cache_on_cpu(*args, **kwargs):
    """BEFORE ServerArgs.from_cli_args: on a CPU host, a hybrid linear-attention model keeps its radix cache with
    the no_buffer Mamba strategy and no overlap schedule.

    SGLang's "auto" strategy picks extra_buffer whenever the overlap schedule is on, then refuses it on a CPU
    ("extra_buffer requires platform support for Mamba cache state snapshots"). An explicit strategy, or
    --disable-radix-cache, is the user's and stays.
    """
    import argparse

    namespace = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, argparse.Namespace)), None)
    if (namespace is None or not cpu_only_host() or getattr(namespace, "disable_radix_cache", False)
            or getattr(namespace, "mamba_radix_cache_strategy", None) != "auto"
            or not _hybrid_linear_attention(getattr(namespace, "model_path", None))):
        return None
    namespace.mamba_radix_cache_strategy = "no_buffer"
    if not getattr(namespace, "disable_overlap_schedule", False):
        namespace.disable_overlap_schedule = True
    import logging

    logging.getLogger(__name__).warning(
        "kt_serve: hybrid linear-attention model on a CPU host: radix cache with --mamba-radix-cache-strategy "
        "no_buffer and --disable-overlap-schedule (SGLang's extra_buffer needs GPU state snapshots)")
    return None
