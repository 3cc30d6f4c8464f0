"""Adapter directories: open any supported layout, validate it, and write PEFT / KT SFT directories atomically."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from .config import resolve_alpha
from .experts import (
    ExpertSource, FusedExpertSource, PerExpertSource, TargetParameterSource, check_finite, split_expert_keys,
)
from .lora_experts import LoRAExperts, read_lora_experts, split_lora_expert_keys
from .manifest import build_manifest, read_manifest, verify_manifest
from .names import (
    ADAPTER_CONFIG_FILE, ADAPTER_MODEL_BIN_FILE, ADAPTER_MODEL_FILE, FUSED_EXPERT_LORA_FILE, KT_ADAPTER_MANIFEST_FILE,
    KT_TENSOR_NAMES, NONEXPERT_KEY_RE, FormatError, MissingFileError, clean_peft_key, fused_key, is_lora_a,
    is_lora_b, lora_module, peft_saved_key,
)
from .safetensors_io import TensorFile, read_json, save_tensors, staged_dirs, write_json

PEFT_METADATA = {"format": "pt"}


@dataclass
class AdapterSource:
    """An opened, validated adapter directory; expert tensors stay on disk until read layer by layer."""

    path: Path
    config: dict
    rank: int
    alpha: float
    nonexpert: dict[str, torch.Tensor]  # cleaned PEFT keys (no base_model.model., no .orig_module)
    experts: ExpertSource | None
    manifest: dict | None = None
    lora_experts: LoRAExperts | None = None  # KT-FT LoRA Experts (lora_experts.py), in memory

    @property
    def expert_format(self) -> str | None:
        return self.experts.format if self.experts is not None else None


@dataclass
class AdapterDir:
    """An adapter directory fully in memory: experts in KT layout per layer, non-expert PEFT tensors."""

    path: Path
    experts: dict[int, dict[str, torch.Tensor]]
    nonexpert: dict[str, torch.Tensor]
    config: dict
    rank: int
    alpha: float
    expert_format: str | None = None
    manifest: dict | None = field(default=None, repr=False)
    lora_experts: LoRAExperts | None = None


def _read_peft_file(directory: Path) -> TensorFile | None:
    path = directory / ADAPTER_MODEL_FILE
    if path.exists():
        return TensorFile(path)
    path = directory / ADAPTER_MODEL_BIN_FILE
    if path.exists():
        try:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise FormatError(path, f"not a readable torch state dict ({str(exc).splitlines()[0]})") from None
        if not isinstance(tensors, dict):
            raise FormatError(path, "expected a state dict")
        return TensorFile(path, tensors)
    return None


def _check_nonexpert(path: Path, tensors: Mapping[str, torch.Tensor]) -> set[int]:
    """Every LoRA module has a 2-D A [r,in] and B [out,r] with equal r, finite values. Returns the ranks."""
    modules: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        if tensor.dim() != 2:
            raise FormatError(path, f"{key} must be 2-D, got shape {list(tensor.shape)}")
        check_finite(path, key, tensor)
        side = "A" if is_lora_a(key) else "B" if is_lora_b(key) else None
        modules.setdefault(lora_module(key), {})[side] = (key, tensor)
    ranks: dict[int, str] = {}
    for module, sides in sorted(modules.items()):
        if set(sides) != {"A", "B"}:
            (present,) = sides
            raise FormatError(path, f"{module} has lora_{present} without lora_{'B' if present == 'A' else 'A'}")
        (a_key, a), (b_key, b) = sides["A"], sides["B"]
        if a.shape[0] != b.shape[1]:
            raise FormatError(path, f"A/B inner dimension mismatch: {b_key} has rank {b.shape[1]} "
                                    f"but {a_key} has rank {a.shape[0]}")
        ranks.setdefault(int(a.shape[0]), a_key)
        if len(ranks) > 1:
            (r1, k1), (r2, k2) = ranks.items()
            raise FormatError(path, f"inconsistent LoRA rank: {k1} has r={r1} but {k2} has r={r2}; "
                                    "one global rank is required")
    return set(ranks)


def open_adapter_dir(path, *, lora_alpha: float | None = None, verify: bool = True,
                     progress: bool = False) -> AdapterSource:
    """Open any supported adapter directory: KT SFT output (fused or per-expert experts), merged, expert-only,
    non-expert-only, or PEFT target_parameters. Names, shapes, ranks, non-expert values and the KT manifest
    (when `verify`) are checked here; expert values when their layer is read."""
    directory = Path(path)
    if not directory.is_dir():
        raise MissingFileError(directory, "adapter directory not found")
    config_path = directory / ADAPTER_CONFIG_FILE
    config = read_json(config_path) if config_path.exists() else {}
    if config.get("use_rslora"):
        raise FormatError(config_path, "use_rslora=true is not supported: KT experts and SGLang scale by alpha/r")
    manifest = read_manifest(directory)
    peft_file = _read_peft_file(directory)
    fused_path = directory / FUSED_EXPERT_LORA_FILE
    if peft_file is None and not fused_path.exists():
        raise MissingFileError(directory, f"holds neither {ADAPTER_MODEL_FILE} nor {FUSED_EXPERT_LORA_FILE}")

    experts: ExpertSource | None = None
    nonexpert: dict[str, torch.Tensor] = {}
    lora_experts: LoRAExperts | None = None
    if peft_file is not None:
        stored: dict[str, str] = {}
        for key in peft_file.keys():
            clean = clean_peft_key(key)
            if clean in stored:
                raise FormatError(peft_file.path, f"keys {stored[clean]} and {key} collide after cleaning")
            stored[clean] = key
        le_keys = split_lora_expert_keys(stored)
        per_expert, target_parameters, other = split_expert_keys({k: v for k, v in stored.items() if k not in le_keys})
        for key in other:
            if not NONEXPERT_KEY_RE.search(key):
                raise FormatError(peft_file.path, f"unexpected key {stored[key]} (not a LoRA A/B weight)")
        if per_expert and target_parameters:
            raise FormatError(peft_file.path, "holds both per-expert and target_parameters expert LoRA")
        if per_expert:
            experts = PerExpertSource(peft_file, {key: stored[key] for key in per_expert})
        elif target_parameters:
            experts = TargetParameterSource(peft_file, {key: stored[key] for key in target_parameters}, config.get("r"))
        with peft_file.reader() as get:
            nonexpert = {key: get(stored[key]) for key in other}
            if le_keys:
                lora_experts = read_lora_experts(peft_file.path, le_keys, get, config)
    if fused_path.exists():
        if experts is not None:
            raise FormatError(directory, f"expert LoRA is in both {FUSED_EXPERT_LORA_FILE} and {ADAPTER_MODEL_FILE}")
        experts = FusedExpertSource(TensorFile(fused_path))
    if experts is None and not nonexpert and lora_experts is None:
        raise FormatError(peft_file.path, "holds no LoRA tensors")

    ranks = _check_nonexpert(peft_file.path if peft_file else directory, nonexpert)
    rank = experts.geometry.rank if experts is not None else ranks.pop() if ranks else int(config.get("r") or 0)
    if ranks - {rank}:
        raise FormatError(peft_file.path, f"inconsistent LoRA rank: non-expert tensors have r={sorted(ranks)[0]} "
                                          f"but {experts.path.name} has r={rank}")
    if "r" in config and config["r"] != rank:
        raise FormatError(config_path, f"r={config['r']} but the LoRA tensors have rank {rank}")
    alpha = resolve_alpha(config, lora_alpha, manifest, directory)
    if manifest is not None and verify:
        fused_layout = experts.layout() if isinstance(experts, FusedExpertSource) else None
        verify_manifest(directory, manifest, rank=rank, alpha=config.get("lora_alpha", alpha),
                        fused_layout=fused_layout, progress=progress)
    return AdapterSource(directory, config, rank, alpha, nonexpert, experts, manifest, lora_experts)


def load_adapter_dir(path, *, lora_alpha: float | None = None, verify: bool = True) -> AdapterDir:
    """Any supported adapter directory, validated (FormatError otherwise), with all tensors in memory."""
    source = open_adapter_dir(path, lora_alpha=lora_alpha, verify=verify)
    experts = source.experts.read_all() if source.experts is not None else {}
    return AdapterDir(source.path, experts, source.nonexpert, source.config, source.rank, source.alpha,
                      source.expert_format, source.manifest, source.lora_experts)


def read_fused_expert_lora(path) -> dict[int, dict[str, torch.Tensor]]:
    """KT fused expert LoRA (a file, or a directory holding fused_expert_lora.safetensors), validated."""
    path = Path(path)
    if path.is_dir():
        path = path / FUSED_EXPERT_LORA_FILE
    if not path.is_file():
        raise MissingFileError(path, "file not found")
    return FusedExpertSource(TensorFile(path)).read_all()


def write_peft_adapter(out_dir, tensors: Mapping[str, torch.Tensor], config: Mapping, *,
                       overwrite: bool = False) -> Path:
    """adapter_model.safetensors (metadata format=pt) + adapter_config.json, appearing atomically."""
    out_dir = Path(out_dir)
    with staged_dirs([out_dir], overwrite=overwrite) as (stage,):
        save_tensors(stage / ADAPTER_MODEL_FILE, tensors, PEFT_METADATA)
        write_json(stage / ADAPTER_CONFIG_FILE, config)
    return out_dir


def write_kt_sft_output(out_dir, *, nonexpert: Mapping[str, torch.Tensor],
                        experts: Mapping[int, Mapping[str, torch.Tensor]], adapter_config: Mapping,
                        base_model_name_or_path: str, overwrite: bool = False,
                        expert_dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Exactly what a KT SFT run writes: adapter_model.safetensors (PEFT keys with `base_model.model.`),
    fused_expert_lora.safetensors (BF16, no metadata), adapter_config.json and kt_adapter_manifest.json.
    The directory is validated like any input (open_adapter_dir) before it appears."""
    out_dir = Path(out_dir)
    config = dict(adapter_config, base_model_name_or_path=base_model_name_or_path)
    if "lora_alpha" not in config:
        raise FormatError(ADAPTER_CONFIG_FILE, "adapter_config needs lora_alpha")
    fused = {fused_key(layer, name): tensors[name].detach().cpu().to(expert_dtype or tensors[name].dtype).contiguous()
             for layer, tensors in sorted(experts.items()) for name in KT_TENSOR_NAMES if name in tensors}
    with staged_dirs([out_dir], overwrite=overwrite) as (stage,):
        save_tensors(stage / ADAPTER_MODEL_FILE,
                     {peft_saved_key(key): value.detach().cpu().contiguous() for key, value in nonexpert.items()},
                     PEFT_METADATA)
        write_json(stage / ADAPTER_CONFIG_FILE, config)
        files = [ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE]
        if fused:
            save_tensors(stage / FUSED_EXPERT_LORA_FILE, fused)
            source = open_adapter_dir(stage)
            manifest = build_manifest(stage, files + [FUSED_EXPERT_LORA_FILE],
                                      base_model_name_or_path=base_model_name_or_path, rank=source.rank,
                                      alpha=source.alpha, fused_layout=source.experts.layout())
            write_json(stage / KT_ADAPTER_MANIFEST_FILE, manifest)
        source = open_adapter_dir(stage)
        if source.experts is not None:
            source.experts.read_all()  # values (finite) too
    return out_dir
