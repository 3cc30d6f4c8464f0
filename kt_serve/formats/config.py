"""adapter_config.json rules of the generated adapters, LoRA alpha precedence, and the base-model check."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Mapping

from .experts import ExpertGeometry
from .names import ADAPTER_CONFIG_FILE, EXPERT_TARGET_MODULES, FormatError, ordered_target_modules, target_module_leaf
from .safetensors_io import read_json


def resolve_alpha(config: Mapping, lora_alpha: float | None, manifest: Mapping | None, directory: Path) -> float:
    """Input config value, else the caller's (`--lora-alpha`), else the KT manifest's; else an error."""
    if "lora_alpha" in config:
        alpha = config["lora_alpha"]
    elif lora_alpha is not None:
        alpha = lora_alpha
    elif manifest and isinstance(manifest.get("lora"), Mapping) and "alpha" in manifest["lora"]:
        alpha = manifest["lora"]["alpha"]
    else:
        raise FormatError(directory / ADAPTER_CONFIG_FILE,
                          "no lora_alpha in adapter_config.json or kt_adapter_manifest.json; "
                          "pass --lora-alpha to preserve runtime scaling")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise FormatError(directory / ADAPTER_CONFIG_FILE, f"lora_alpha must be a positive number, got {alpha!r}")
    return alpha


def _adapter_config(config: Mapping, *, rank: int, alpha: float, base_model_name_or_path: str,
                    target_modules: Iterable[str]) -> dict:
    """Starts from the input config so other PEFT fields survive (reference converter rule)."""
    out = dict(config)
    out["peft_type"] = out.get("peft_type", "LORA")
    out["r"] = rank
    out["lora_alpha"] = alpha
    out["target_modules"] = ordered_target_modules(target_modules)
    out["bias"] = out.get("bias", "none")
    out["task_type"] = out.get("task_type", "CAUSAL_LM")
    out["base_model_name_or_path"] = base_model_name_or_path
    if out.get("target_parameters"):
        out["target_parameters"] = None  # generated adapters hold experts per expert, never as 3-D parameters
    return out


def nonexpert_targets(keys: Iterable[str]) -> set[str]:
    return {leaf for leaf in map(target_module_leaf, keys) if leaf is not None}


def merged_config(config: Mapping, *, rank: int, alpha: float, base_model_name_or_path: str,
                  nonexpert_keys: Iterable[str]) -> dict:
    """Input-config targets (leaf) + leaves of the non-expert keys + gate/up/down_proj."""
    targets = nonexpert_targets(nonexpert_keys) | set(EXPERT_TARGET_MODULES)
    existing = config.get("target_modules", [])
    if isinstance(existing, list):
        targets.update(str(name).split(".")[-1] for name in existing)
    return _adapter_config(config, rank=rank, alpha=alpha, base_model_name_or_path=base_model_name_or_path,
                           target_modules=targets)


def expert_config(config: Mapping, *, rank: int, alpha: float, base_model_name_or_path: str) -> dict:
    return _adapter_config(config, rank=rank, alpha=alpha, base_model_name_or_path=base_model_name_or_path,
                           target_modules=EXPERT_TARGET_MODULES)


def nonexpert_config(config: Mapping, *, rank: int, alpha: float, base_model_name_or_path: str,
                     nonexpert_keys: Iterable[str]) -> dict:
    """Only the leaves of its own keys; input-config targets are not added (reference rule)."""
    return _adapter_config(config, rank=rank, alpha=alpha, base_model_name_or_path=base_model_name_or_path,
                           target_modules=nonexpert_targets(nonexpert_keys))


# Base model config.json field names per family: Qwen2/3-MoE, Qwen3.5-MoE (nested text_config), DeepSeek-V2/V3.
_MODEL_FIELDS = {
    "layers": ("num_hidden_layers",),
    "E": ("num_experts", "n_routed_experts", "num_local_experts"),
    "H": ("hidden_size",),
    "I": ("moe_intermediate_size",),
}


def resolve_base_model_config(name_or_path: str) -> tuple[Path | None, str | None]:
    """config.json of a local model dir or of a hub id already in the HF cache (offline); else (None, note)."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        config = local / "config.json"
        return (config, None) if config.is_file() else (None, f"{local} has no config.json; shapes not checked")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json")
    except Exception:  # not a valid repo id, or no usable cache
        cached = None
    if isinstance(cached, str):
        return Path(cached), None
    return None, (f"base model {name_or_path!r} is neither a local directory nor in the Hugging Face cache; "
                  "recorded in adapter_config.json without checking shapes")


def check_base_model(config_path: Path, layers: list[int], geometry: ExpertGeometry | None,
                     nonexpert: Mapping | None = None) -> None:
    """Expert layers, expert count, hidden and moe intermediate size must match the base model's config.json; on a
    hybrid model (Qwen3.5's ``layer_types``), each non-expert LoRA key's attention kind and GDN shapes too."""
    model = read_json(config_path)
    model = model.get("text_config", model) if isinstance(model.get("text_config"), dict) else model
    if nonexpert:
        check_hybrid_layers(config_path, model, nonexpert)

    def field(key):
        for name in _MODEL_FIELDS[key]:
            if isinstance(model.get(name), int):
                return name, model[name]
        return None, None

    name, num_layers = field("layers")
    if num_layers is not None and layers and max(layers) >= num_layers:
        raise FormatError(config_path, f"{name}={num_layers} but the adapter has expert LoRA for layer {max(layers)}")
    dense = set(model.get("mlp_only_layers") or [])
    dense.update(range(model.get("first_k_dense_replace") or 0))
    if dense.intersection(layers):
        raise FormatError(config_path, f"layer {min(dense.intersection(layers))} is a dense MLP layer in the base "
                                       "model but the adapter has expert LoRA for it")
    if geometry is None:
        return
    for key, value in (("E", geometry.num_experts), ("H", geometry.hidden), ("I", geometry.intermediate)):
        name, expected = field(key)
        if expected is not None and expected != value:
            raise FormatError(config_path, f"{name}={expected} but the adapter's expert LoRA has {key}={value}")


# Qwen3.5 Gated DeltaNet LoRA: (module, side) -> the config dims its rows (B) or columns (A) must have.
_GDN_SHAPES = {
    ("in_proj_qkv", "B"): lambda kd, vd: 2 * kd + vd, ("in_proj_z", "B"): lambda kd, vd: vd,
    ("out_proj", "A"): lambda kd, vd: vd,
}
_ATTENTION_KIND = {"linear_attn": "linear_attention", "self_attn": "full_attention"}


def check_hybrid_layers(config_path: Path, model: Mapping, nonexpert: Mapping) -> None:
    """Every ``layers.N.linear_attn.*`` / ``layers.N.self_attn.*`` LoRA must sit on a layer of that kind, and GDN
    LoRA shapes must fit ``linear_*`` dims (a Qwen3-MoE adapter put on a Qwen3.5 base, or another size, is refused)."""
    kinds = model.get("layer_types")
    if not isinstance(kinds, list):
        return
    import re

    kd = (model.get("linear_key_head_dim") or 0) * (model.get("linear_num_key_heads") or 0)
    vd = (model.get("linear_value_head_dim") or 0) * (model.get("linear_num_value_heads") or 0)
    pattern = re.compile(r"(?:^|\.)layers\.(\d+)\.(linear_attn|self_attn)\.([^.]+)\.lora_([AB])\.")
    for key, tensor in nonexpert.items():
        m = pattern.search(key)
        if m is None:
            continue
        layer, block, module, side = int(m[1]), m[2], m[3], m[4]
        if layer >= len(kinds):
            raise FormatError(config_path, f"layer_types has {len(kinds)} layers but the adapter has {key}")
        if kinds[layer] != _ATTENTION_KIND[block]:
            raise FormatError(config_path, f"layer {layer} is {kinds[layer]} in the base model but the adapter has "
                                           f"{block} LoRA for it ({key})")
        want = _GDN_SHAPES.get((module, side))
        if block == "linear_attn" and want is not None and kd and vd:
            got = tuple(tensor.shape)[0 if side == "B" else 1]
            if got != want(kd, vd):
                raise FormatError(config_path, f"{key} has {got} {'rows' if side == 'B' else 'columns'}; the base "
                                               f"model's {module} has {want(kd, vd)} (linear_key_head_dim x "
                                               "linear_num_key_heads, linear_value_head_dim x linear_num_value_heads)")
