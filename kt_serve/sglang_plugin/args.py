"""The ``--kt-*`` server flags: added to SGLang's parser, read back after parsing, exported to the schedulers.

SGLang's ``from_cli_args`` keeps only dataclass fields, so an unknown flag would be dropped silently; the AFTER hook
on it reads our flags from the namespace, validates them and exports them (config.py) before any child is spawned.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from kt_serve.kernel.weights import WEIGHT_FORMATS

from . import accelerator
from .config import DENSE_FORMATS, KTServeConfig, local_model_config
from .cpu_host import compat

logger = logging.getLogger(__name__)

# (flag, dest, argparse kwargs); dest names equal KTServeConfig fields.
FLAGS = [
    ("--kt-moe", "moe", dict(choices=["on", "off"], default="on",
                              help="kt_serve: run routed experts in the kt_serve CPU kernel ('on', default) or in "
                                   "SGLang's own MoE path ('off')")),
    ("--kt-expert-lora-path", "expert_lora_path",
     dict(default=None, help="kt_serve: expert LoRA dir (KT SFT output, merged or expert-only PEFT adapter) applied "
                             "to every request that does not select a composite adapter with its own expert half")),
    ("--kt-threads", "threads", dict(type=int, default=0,
                                     help="kt_serve: CPU threads of the MoE kernel (0 = all physical cores)")),
    ("--kt-max-expert-loras", "max_expert_loras",
     dict(default="auto", help="kt_serve: expert adapters resident in the kernel at once (the global one "
                               "included): a count (8), a size (24GiB) or 'auto' (default: a quarter of the memory "
                               "available once the model is loaded); more are registered and loaded on use, the "
                               "least recently used (--lora-eviction-policy) evicted")),
    ("--kt-expert-dtype", "expert_dtype",
     dict(choices=["auto", *WEIGHT_FORMATS], default="auto",
          help="kt_serve: format of the routed experts in the kernel: 'auto' (default) keeps the checkpoint's "
               "(bf16, or FP8 with its block scales); int8 (per channel) and int4 (per group) quantize bf16 or FP8 "
               "checkpoints at load, layer by layer")),
    ("--kt-expert-group-size", "expert_group_size",
     dict(type=int, default=128, help="kt_serve: K values per int4 scale (a multiple of 64; default 128)")),
    ("--kt-cpu-ops", "cpu_ops",
     dict(choices=["auto", "on", "off"], default="auto",
          help="kt_serve: on a CPU host, run the bf16 linear layers (attention, shared experts, router), lm_head, "
               "RMSNorm and (without AMX, as --attention-backend kt_cpu) decode attention on the kt_serve kernel "
               "('auto', default: with --kt-moe on)")),
    ("--kt-dense-dtype", "dense_dtype",
     dict(choices=list(DENSE_FORMATS), default="bf16",
          help="kt_serve: with --kt-cpu-ops on a CPU host without AMX, quantize the packed linear layers (attention "
               "projections, shared experts, dense MLPs; not the routers nor lm_head) at load: int8 per channel, "
               "int4 per group of --kt-expert-group-size (default: bf16, as the checkpoint)")),
    ("--kt-lm-head-dtype", "lm_head_dtype",
     dict(choices=list(DENSE_FORMATS), default="bf16",
          help="kt_serve: with --kt-cpu-ops on a CPU host without AMX, quantize the packed lm_head at load: int8 per "
               "channel, int4 per group of --kt-expert-group-size (default: bf16). With a 150k-250k vocabulary it is "
               "read whole every decode step")),
    ("--kt-weight-cache", "weight_cache",
     dict(default="auto", help="kt_serve: packed-weight cache of the routed experts: the first start writes each MoE "
                               "layer as the kernel packed it (format and group size included), later starts read it "
                               "instead of the checkpoint's experts (no quantization); a stale or corrupt file is "
                               "rebuilt. A directory, 'auto' (default: $KT_SERVE_CACHE/packed_experts, else "
                               "~/.cache/kt_serve/packed_experts) or 'off'")),
    ("--kt-lora-cache-dir", "lora_cache_dir",
     dict(default=None, help="kt_serve: where composite adapters are split (default: a per-user temp dir)")),
    ("--kt-lora-dir", "lora_dir",
     dict(default=None, help="kt_serve: a directory of adapters found by name on first use: a request for model "
                             "'<served>:<name>' that no adapter answers loads DIR/<name> (needs --enable-lora)")),
]


def _existing_options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def add_cli_args_hook(result, parser, *args, **kwargs):
    """AFTER ServerArgs.add_cli_args(parser): add our flags (skipping any a fork already defines)."""
    group = parser.add_argument_group("kt_serve (routed experts on the kt_serve CPU kernel)")
    existing = _existing_options(parser)
    for flag, dest, kw in FLAGS:
        if flag in existing:  # e.g. sglang-kt defines --kt-expert-lora-path; reuse its value
            continue
        group.add_argument(flag, dest=f"kt_serve_{dest}", **kw)
    return result


def namespace_of(args, kwargs) -> argparse.Namespace | None:
    """The parsed CLI namespace among a from_cli_args hook's arguments."""
    return next((a for a in list(args) + list(kwargs.values()) if isinstance(a, argparse.Namespace)), None)


def _flag_values(namespace: argparse.Namespace) -> dict:
    """Our flags' values on the namespace (under our dest, or under a fork's own name for the same flag)."""
    values = {}
    for flag, dest, _ in FLAGS:
        for attr in (f"kt_serve_{dest}", flag[2:].replace("-", "_")):
            if getattr(namespace, attr, None) is not None:
                values[dest] = getattr(namespace, attr)
                break
    return values


def config_from_namespace(namespace: argparse.Namespace) -> KTServeConfig:
    """Our flags as a config; under the accelerator emulation without the CPU host's fast paths (--kt-cpu-ops),
    which a GPU host never runs."""
    values = _flag_values(namespace)
    if accelerator.emulated():
        if values.get("cpu_ops") == "on":
            raise SystemExit(f"--kt-cpu-ops on: {accelerator.EMULATION_ENV}=1 runs the accelerator host's code, "
                             "which has no CPU-host fast paths")
        values["cpu_ops"] = "off"
    return KTServeConfig(**values)


def default_attention_backend_hook(*args, **kwargs):
    """BEFORE ServerArgs.from_cli_args(namespace): the kt_cpu attention backend by default where it applies
    (cpu_host/attention.py), set on the namespace so SGLang resolves it like a user's --attention-backend."""
    namespace = namespace_of(args, kwargs)
    if namespace is not None:
        from .cpu_host.attention import default_on_cpu

        default_on_cpu(namespace, config_from_namespace(namespace).cpu_ops_enabled)
    return None


def accelerator_launch_hook(*args, **kwargs):
    """BEFORE ServerArgs.from_cli_args(namespace), with the kernel on: parallel layouts it does not serve refused
    (before SGLang resolves them), and on an accelerator the CUDA graph backends decided, logged once
    (accelerator.py)."""
    namespace = namespace_of(args, kwargs)
    if namespace is None or not config_from_namespace(namespace).enabled:
        return None
    lora = bool(getattr(namespace, "enable_lora", None) or getattr(namespace, "lora_paths", None))
    message = accelerator.unsupported_parallel_layout(namespace, lora)
    if message:
        raise SystemExit(message)
    if accelerator.accelerator_device(namespace):
        turned_off = accelerator.decide_graph_backends(namespace)
        if turned_off:
            logger.warning("kt_serve: CUDA graphs turned off for %s (SGLang's default captures them): the routed "
                           "experts run in the kt_serve CPU kernel, which a graph cannot capture yet",
                           " and ".join(turned_off))
    return None


def from_cli_args_hook(server_args, *args, **kwargs):
    """AFTER ServerArgs.from_cli_args(namespace): validate our flags, export them for the schedulers."""
    config = config_from_namespace(namespace_of(args, kwargs))
    if config.expert_lora_path:
        path = os.path.abspath(config.expert_lora_path)
        if not os.path.isdir(path):
            raise SystemExit(f"--kt-expert-lora-path {config.expert_lora_path}: not a directory")
        config = dataclasses.replace(config, expert_lora_path=path)
    if config.lora_dir:
        path = os.path.abspath(config.lora_dir)
        if not os.path.isdir(path):
            raise SystemExit(f"--kt-lora-dir {config.lora_dir}: not a directory")
        if not (getattr(server_args, "enable_lora", None) or getattr(server_args, "lora_paths", None)):
            raise SystemExit("--kt-lora-dir needs --enable-lora (and --max-lora-rank / --lora-target-modules "
                             "covering the adapters, when no --lora-paths are given)")
        config = dataclasses.replace(config, lora_dir=path)
    message = unsupported_architecture(getattr(server_args, "model_path", None))
    if config.enabled:
        message = message or unsupported_quantization(server_args)
    message = message or unpacked_dense_layers(config, server_args)
    if message:
        raise SystemExit(message)
    if config.enabled:
        from .memory import check_fits

        message, reserve = check_fits(server_args, config, getattr(namespace_of(args, kwargs), "mem_fraction_static",
                                                                    None))
        if message:
            raise SystemExit(message)
        config = dataclasses.replace(config, kv_reserve_bytes=reserve)
    config.export()
    compat.split_cores_between_ranks(server_args)
    if config.enabled:
        # An idle SGLang scheduler polls its sockets in a busy loop, holding a whole core that the kernel's threads
        # (and, on a small host, every other process) need; sleep_on_idle blocks in zmq poll instead, which returns
        # as soon as the next request arrives.
        server_args.sleep_on_idle = True
    return server_args


def unpacked_dense_layers(config, server_args=None) -> str | None:
    """Why --kt-dense-dtype / --kt-lm-head-dtype cannot be honoured here (the layers they quantize are packed on
    CPU-only hosts without AMX; elsewhere SGLang's own kernels run them in bf16; a LoRA-wrapped lm_head runs as
    SGLang's), or None."""
    from sglang.srt.utils.common import cpu_has_amx_support

    for flag, value in (("--kt-dense-dtype", config.dense_dtype), ("--kt-lm-head-dtype", config.lm_head_dtype)):
        if value == "bf16":
            continue
        if not compat.cpu_only_host() or cpu_has_amx_support():
            return (f"{flag} {value}: the kt_serve kernel runs the linear layers on CPU-only hosts without AMX; "
                    "here SGLang's own kernels run them in bf16 (drop the flag)")
        targets = {str(t) for t in (getattr(server_args, "lora_target_modules", None) or [])}
        if flag == "--kt-lm-head-dtype" and targets & {"lm_head", "all"}:
            return (f"{flag} {value}: --lora-target-modules {' '.join(sorted(targets))} puts LoRA on lm_head, which "
                    "SGLang's LoRA layer then runs in bf16; leave lm_head out of the targets or drop the flag")
    return None


KERNEL_READS = ("the kt_serve kernel reads bf16 checkpoints and FP8 block-quantized ones (quant_method fp8 with "
                "weight_block_size): serve one of those, with --kt-expert-dtype int8 or int4 to quantize the routed "
                "experts at load, or pass --kt-moe off to leave the experts to SGLang")


# Architectures stock SGLang 0.5.23 has no model class for, though a sibling layout of the same family is served:
# it would fall back to its generic TransformersForCausalLM (no FusedMoE, so no kernel and no expert adapter).
UNSERVED_ARCHITECTURES = {
    "Qwen3_5MoeForCausalLM": "a text-only Qwen3.5-MoE checkpoint (what transformers' Qwen3_5MoeForCausalLM saves); "
                             "SGLang 0.5.23 serves Qwen3.5-MoE as the official Qwen3_5MoeForConditionalGeneration "
                             "layout only (model.language_model.* weights, text_config, processor files)",
}


def unsupported_architecture(model_path) -> str | None:
    """One line refusing a local checkpoint whose architecture SGLang would serve through its generic fallback."""
    for arch in (local_model_config(model_path) or {}).get("architectures") or []:
        if arch in UNSERVED_ARCHITECTURES:
            return f"kt_serve: {model_path} is {UNSERVED_ARCHITECTURES[arch]}"
    return None


def checkpoint_quantization(model_path: str):
    """(quant_method, its config dict, where it was found) of a local checkpoint, or None (bf16, or not local)."""
    config = local_model_config(model_path)
    if config is None:
        return None
    for scope, cfg in (("", config), ("text_config.", config.get("text_config") or {})):
        for key in ("quantization_config", "compression_config"):
            q = cfg.get(key) if isinstance(cfg, dict) else None
            if isinstance(q, dict):
                return str(q.get("quant_method") or "modelopt"), q, f"config.json {scope}{key}"
    if os.path.exists(os.path.join(model_path, "hf_quant_config.json")):
        return "modelopt", {}, "hf_quant_config.json"
    return None


def unsupported_quantization(server_args) -> str | None:
    """One line refusing a quantization the kernel does not read (AWQ, GPTQ, per-tensor FP8, --quantization ...),
    naming the format and the flags; None where the checkpoint is bf16 or FP8 block-quantized."""
    found = checkpoint_quantization(getattr(server_args, "model_path", None))
    flag = getattr(server_args, "quantization", None)
    if found is None:
        if flag:
            return (f"kt_serve: --quantization {flag} on a bf16 checkpoint is not run by the kt_serve kernel; "
                    f"{KERNEL_READS} (or --kt-expert-dtype fp8 for FP8 experts)")
        return None
    method, q, where = found
    if method == "fp8" and q.get("weight_block_size") and flag in (None, "fp8"):
        return None
    what = f"'{method}'" + (" without weight_block_size (per-tensor FP8)" if method == "fp8" else "")
    if flag and flag != method:
        what += f" with --quantization {flag}"
    return f"kt_serve: {server_args.model_path} is quantized as {what} ({where}); {KERNEL_READS}"
