"""Plugin settings (one dataclass, read from the environment in every process) and the served checkpoint's own
config.json.

The launcher's CLI hook (args.py) exports the flags as ``KT_SERVE_*`` variables before SGLang spawns its
schedulers, which inherit the environment; ``Engine(...)`` users set the variables directly.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields

from kt_serve.kernel.threads import share_cores_with_torch

ENV_PREFIX = "KT_SERVE_"
DENSE_FORMATS = ("bf16", "int8", "int4")

AUTO_FRACTION = 4          # auto budget: a quarter of the memory available once the model is loaded
BYTE_BUDGET_SLOTS = 64     # kernel slots per layer under a byte budget (a slot costs a pointer until used)
_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


@dataclass(frozen=True)
class ExpertBudget:
    """How many expert adapters stay resident: ``slots`` adapters, or ``nbytes`` of kernel memory (auto: sized
    from the memory available once the model is loaded)."""

    slots: int | None = None
    nbytes: int | None = None
    auto: bool = False

    @classmethod
    def parse(cls, text) -> "ExpertBudget":
        value = str(text).strip().lower()
        if value == "auto":
            return cls(auto=True)
        if value.isdigit():
            if int(value) < 1:
                raise ValueError(f"--kt-max-expert-loras={text}: expected >= 1 adapters")
            return cls(slots=int(value))
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b)", value)
        if match is None or float(match.group(1)) <= 0:
            raise ValueError(f"--kt-max-expert-loras={text}: expected a number of adapters (8), a size (24GiB, "
                             f"512MiB) or auto")
        return cls(nbytes=int(float(match.group(1)) * _UNITS[match.group(2)]))

    @property
    def kernel_slots(self) -> int:
        return self.slots if self.slots is not None else BYTE_BUDGET_SLOTS

    def resolved(self, available_bytes: int) -> "ExpertBudget":
        return ExpertBudget(nbytes=available_bytes // AUTO_FRACTION, auto=True) if self.auto else self

    def describe(self) -> str:
        if self.slots is not None:
            return f"{self.slots} adapters"
        if self.nbytes is None:
            return "auto (unresolved)"
        return f"{size_text(self.nbytes)}" + (f" (auto: 1/{AUTO_FRACTION} of the memory available after load)"
                                        if self.auto else "")


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


@dataclass(frozen=True)
class KTServeConfig:
    # routed experts in our kernel ("on"), or SGLang's own MoE path ("off", e.g. as a benchmark baseline)
    moe: str = "on"
    # expert adapter applied to every request that does not bring its own expert half (reference semantics)
    expert_lora_path: str | None = None
    # kernel worker threads (0: the kernel's default, all physical cores)
    threads: int = 0
    # expert adapters resident in the kernel at once (global adapter included): a count, a size ("24GiB") or auto
    max_expert_loras: str = "auto"
    # where composite adapters are split into their SGLang (non-expert) half
    lora_cache_dir: str | None = None
    # adapters found by name on first use: a request for <served>:<name> loads <lora_dir>/<name>
    lora_dir: str | None = None
    # format of the routed experts in the kernel: auto (the checkpoint's: bf16 or fp8), bf16, fp8, int8, int4
    expert_dtype: str = "auto"
    # K values per int4 scale (and per fp8 scale when a bf16 checkpoint is quantized to fp8)
    expert_group_size: int = 128
    # a CPU host's bf16 linear layers, lm_head and RMSNorm on the kt_serve kernel: auto (= on with --kt-moe on)
    cpu_ops: str = "auto"
    # format of those linear layers once packed (not the routers nor lm_head): bf16, or int8 / int4 quantized at load
    dense_dtype: str = "bf16"
    # format of the packed lm_head: bf16, or int8 / int4 quantized at load
    lm_head_dtype: str = "bf16"
    # packed-weight cache of the routed experts: a directory, auto (under $KT_SERVE_CACHE or ~/.cache/kt_serve) or off
    weight_cache: str = "auto"
    # set by the launcher on a CPU-only host (memory.py): what the KV pool sizing holds back (0: SGLang's fraction)
    kv_reserve_bytes: int = 0

    def __post_init__(self):
        if self.moe not in ("on", "off"):
            raise ValueError(f"--kt-moe={self.moe!r}: expected 'on' or 'off'")
        ExpertBudget.parse(self.max_expert_loras)
        from kt_serve.kernel.weights import WEIGHT_FORMATS, valid_group_size

        if self.expert_dtype != "auto" and self.expert_dtype not in WEIGHT_FORMATS:
            raise ValueError(f"--kt-expert-dtype={self.expert_dtype!r}: expected auto, {', '.join(WEIGHT_FORMATS)}")
        if not valid_group_size(self.expert_group_size):
            raise ValueError(f"--kt-expert-group-size={self.expert_group_size}: expected a positive multiple of 64")
        if self.cpu_ops not in ("auto", "on", "off"):
            raise ValueError(f"--kt-cpu-ops={self.cpu_ops!r}: expected auto, on or off")
        for flag, value in (("--kt-dense-dtype", self.dense_dtype), ("--kt-lm-head-dtype", self.lm_head_dtype)):
            if value not in DENSE_FORMATS:
                raise ValueError(f"{flag}={value!r}: expected {', '.join(DENSE_FORMATS)}")
            if value != "bf16" and not self.cpu_ops_enabled:
                raise ValueError(f"{flag} {value} quantizes layers --kt-cpu-ops packs; it needs --kt-cpu-ops on (or "
                                 "auto with --kt-moe on)")
        if self.moe == "off" and self.expert_lora_path:
            raise ValueError("--kt-expert-lora-path needs --kt-moe on (expert LoRA runs in the kt_serve kernel)")

    @property
    def enabled(self) -> bool:
        return self.moe == "on"

    @property
    def cpu_ops_enabled(self) -> bool:
        return self.cpu_ops == "on" or (self.cpu_ops == "auto" and self.enabled)

    @staticmethod
    def env_name(field: str) -> str:
        return ENV_PREFIX + field.upper()

    @classmethod
    def from_env(cls, environ=os.environ) -> "KTServeConfig":
        kw = {}
        for f in fields(cls):
            raw = environ.get(cls.env_name(f.name))
            if raw is None or raw == "":
                continue
            kw[f.name] = int(raw) if f.type == "int" else raw
        return cls(**kw)

    def export(self, environ=os.environ) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                environ.pop(self.env_name(f.name), None)
            else:
                environ[self.env_name(f.name)] = str(value)
        if self.enabled:
            share_cores_with_torch(environ)


_config: KTServeConfig | None = None


def get_config() -> KTServeConfig:
    global _config
    if _config is None:
        _config = KTServeConfig.from_env()
    return _config


def local_model_config(model_path) -> dict | None:
    """A local checkpoint's config.json, or None (a hub id, or unreadable: SGLang reports that itself)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError, TypeError):
        return None
    return config if isinstance(config, dict) else None
