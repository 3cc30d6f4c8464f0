"""Host memory at start-up: refuse in seconds what will not fit (kt_serve/plan.py counts it from the checkpoint's
headers), and on a CPU-only host size SGLang's KV pool from what the plugin knows it needs besides.

SGLang sizes the KV pool after loading as "memory available now − pre-load available × (1 − mem_fraction_static)",
and on a CPU host its default fraction (0.716 on a 24 GiB host) holds back 28% of the pre-load memory for
activations it expects on a GPU: a whole model that fits with gigabytes to spare is refused after minutes of loading
("Loaded weights leave no GPU memory for the KV cache … Raise --mem-fraction-static"). Unless the user sets
--mem-fraction-static, the plugin holds back instead what this server needs beside the KV pool: activations of a
prefill chunk, runtime slack (plan.py) and the expert adapters' budget once sized.
"""

from __future__ import annotations

import logging
import os

from .config import get_config, local_model_config

logger = logging.getLogger(__name__)


def plan_options(server_args, config):
    from kt_serve.plan import ServeOptions

    from .config import ExpertBudget
    from .cpu_host.compat import cpu_only_host

    budget = ExpertBudget.parse(config.max_expert_loras)
    chunk = getattr(server_args, "chunked_prefill_size", None)
    return ServeOptions(
        expert_dtype=config.expert_dtype, dense_dtype=config.dense_dtype, lm_head_dtype=config.lm_head_dtype,
        group_size=config.expert_group_size, tp_size=int(getattr(server_args, "tp_size", 1) or 1),
        max_total_tokens=getattr(server_args, "max_total_tokens", None),
        chunked_prefill_size=chunk if chunk and chunk > 0 else 4096, cpu_host=cpu_only_host(),
        cpu_ops=config.cpu_ops_enabled and cpu_only_host(),
        expert_adapter_bytes=budget.nbytes if not budget.auto else None)


def check_fits(server_args, config, user_mem_fraction) -> tuple[str | None, int]:
    """In the launcher, before anything loads: (the refusal, one line then the table, or None; on a CPU-only host
    without --mem-fraction-static, the bytes the KV sizing must hold back for this server's runtime, else 0)."""
    model_path = getattr(server_args, "model_path", None)
    text = local_model_config(model_path)
    if text is None or not any(name.endswith(".safetensors") for name in os.listdir(model_path)):
        return None, 0  # a hub id, or not safetensors: SGLang reports what it cannot read
    from kt_serve import plan as planning

    options = plan_options(server_args, config)
    message = planning.refusal(model_path, options)
    if message is not None or not options.cpu_host or user_mem_fraction is not None:
        return message, 0
    text = text.get("text_config") or text
    return None, planning.RUNTIME_FLOOR + planning.activation_bytes(text, options.chunked_prefill_size)


def size_kv_pool(original, configurator, pre_model_load_memory, *args, **kwargs):
    """AROUND KVCacheConfigurator._profile_available_bytes (CPU-only host, --mem-fraction-static not given): the
    fraction that holds back this server's runtime reserve and its expert adapters' budget, nothing more."""
    reserve = get_config().kv_reserve_bytes
    if reserve <= 0 or pre_model_load_memory <= 0:
        return original(configurator, pre_model_load_memory, *args, **kwargs)
    from sglang.srt.runtime_context import get_schedule

    from .adapters.registry import get_registry

    pool = get_registry().experts
    adapters = (pool.budget.nbytes or 0) if pool.layers else 0
    held_gb = (reserve + adapters) / 2**30
    fraction = max(0.0, min(1.0, 1 - held_gb / pre_model_load_memory))
    logger.info("kt_serve: KV pool sized holding back %.2f GiB (activations and runtime %.2f, expert adapters %.2f) "
                "instead of SGLang's --mem-fraction-static %.3f of the pre-load memory (pass the flag to choose)",
                held_gb, reserve / 2**30, adapters / 2**30, get_schedule().mem_fraction_static)
    try:
        with get_schedule().override(mem_fraction_static=fraction):
            return original(configurator, pre_model_load_memory, *args, **kwargs)
    except ValueError as exc:
        if "leave no GPU memory" not in str(exc):
            raise
        import psutil

        raise ValueError(f"kt_serve: after loading, {psutil.virtual_memory().available / 2**30:.1f} GiB of host "
                         f"memory are left, less than the {held_gb:.1f} GiB this server holds back for activations "
                         "and expert adapters besides a KV cache; serve smaller formats (--kt-expert-dtype int4, "
                         "--kt-dense-dtype int8), a smaller --kt-max-expert-loras, or check `python -m kt_serve.plan`"
                         ) from None
