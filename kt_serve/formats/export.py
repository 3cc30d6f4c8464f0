"""Convert an adapter directory into merged / expert-only / non-expert-only PEFT adapters in one streamed pass.

Expert tensors are read one layer at a time and written straight into every output file at their final
offsets, so memory stays near one layer's tensors whatever the adapter size. All outputs are built under
temporary names and appear together only once complete.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

from .adapter_dir import PEFT_METADATA, AdapterSource, open_adapter_dir
from .config import check_base_model, expert_config, merged_config, nonexpert_config, resolve_base_model_config
from .experts import peft_expert_layout
from .lora_experts import CONFIG_FIELD as LORA_EXPERTS_CONFIG
from .names import (
    ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE, FUSED_EXPERT_LORA_FILE, FormatError, MissingFileError,
)
from .safetensors_io import SafetensorsWriter, check_output_dir, progress_bar, staged_dirs, write_json

OUTPUT_ROLES = ("merged", "expert", "nonexpert")
PROGRESS_MIN_BYTES = 64 << 20


def check_output_paths(input_dir: Path, outputs: dict[str, Path]) -> None:
    """Outputs must differ from, and not nest with, the input or each other."""
    source = input_dir.resolve()
    resolved = {role: path.resolve() for role, path in outputs.items()}
    for role, path in resolved.items():
        if path == source or source in path.parents or path in source.parents:
            raise FormatError(outputs[role], f"{role} output directory must not be, contain or lie inside the "
                                             f"input directory {input_dir}")
    for (role_a, path_a), (role_b, path_b) in itertools.combinations(resolved.items(), 2):
        if path_a == path_b or path_a in path_b.parents or path_b in path_a.parents:
            raise FormatError(outputs[role_b], f"{role_b} output directory must be distinct from and not nested "
                                               f"with the {role_a} output directory {outputs[role_a]}")


def convert_adapter(input_dir, *, merged_dir=None, expert_dir=None, nonexpert_dir=None,
                    base_model_name_or_path: str | None = None, lora_alpha: float | None = None,
                    overwrite: bool = False, progress: bool = False, nonexpert_optional: bool = False) -> dict:
    """Split (and/or merge) an adapter directory. Returns the reference converter's summary dict plus
    `expert_format` and `notes` (lines for the user). With `nonexpert_optional`, an input without non-expert
    LoRA skips the non-expert output (with a note) instead of failing."""
    input_dir = Path(input_dir).expanduser().absolute()
    if not input_dir.is_dir():
        raise MissingFileError(input_dir, "input directory not found")
    outputs = {role: Path(path).expanduser().absolute()
               for role, path in zip(OUTPUT_ROLES, (merged_dir, expert_dir, nonexpert_dir)) if path is not None}
    if not outputs:
        raise FormatError(input_dir, "no output directory given")
    check_output_paths(input_dir, outputs)
    for path in outputs.values():
        check_output_dir(path, overwrite=overwrite)

    source = open_adapter_dir(input_dir, lora_alpha=lora_alpha, progress=progress)
    if source.experts is None:
        raise MissingFileError(input_dir / FUSED_EXPERT_LORA_FILE,
                               f"not found, and {ADAPTER_MODEL_FILE} holds no per-expert LoRA")
    notes = []
    has_nonexpert = bool(source.nonexpert) or source.lora_experts is not None
    if "nonexpert" in outputs and not has_nonexpert and nonexpert_optional:
        notes.append(f"Note: {input_dir} has no non-expert LoRA; no non-expert adapter written")
        del outputs["nonexpert"]
    if "nonexpert" in outputs and not has_nonexpert:
        raise FormatError(input_dir / ADAPTER_MODEL_FILE, "holds no non-expert LoRA to write a non-expert adapter")
    base = base_model_name_or_path or source.config.get("base_model_name_or_path")
    if not base:
        raise FormatError(input_dir / ADAPTER_CONFIG_FILE,
                          "has no base_model_name_or_path; pass --base-model-name-or-path")
    model_config, note = resolve_base_model_config(base)
    if model_config is not None:
        check_base_model(model_config, source.experts.layers, source.experts.geometry, source.nonexpert)
        notes.append(f"Checked shapes against {model_config}")
    else:
        notes.append(f"Note: {note}")

    expert_layout = peft_expert_layout(source.experts)
    duplicate = sorted(set(expert_layout) & set(source.nonexpert))
    if duplicate:
        raise FormatError(input_dir / ADAPTER_MODEL_FILE, f"duplicate output tensor key {duplicate[0]}")
    common = dict(rank=source.rank, alpha=source.alpha, base_model_name_or_path=base)
    configs = {
        "merged": merged_config(source.config, nonexpert_keys=source.nonexpert, **common),
        "expert": expert_config(source.config, **common),
        "nonexpert": nonexpert_config(source.config, nonexpert_keys=source.nonexpert, **common),
    }
    if source.lora_experts is not None:  # kept beside the non-expert LoRA, with what a server needs to know
        for role in ("merged", "nonexpert"):
            configs[role][LORA_EXPERTS_CONFIG] = source.lora_experts.config()
    _write_outputs(source, outputs, configs, expert_layout, overwrite=overwrite, progress=progress)

    summary = {
        "input_dir": str(input_dir),
        "output_dir": str(outputs["merged"]) if "merged" in outputs else None,
        "tensor_count": len(expert_layout) + len(nonexpert_tensors(source)),
        "rank": source.rank,
        "target_modules": configs["merged"]["target_modules"],
        "lora_alpha": configs["merged"]["lora_alpha"],
        "split_outputs": {},
        "expert_format": source.expert_format,
        "notes": notes,
    }
    counts = {"expert": len(expert_layout), "nonexpert": len(nonexpert_tensors(source))}
    for role in ("expert", "nonexpert"):
        if role in outputs:
            summary["split_outputs"][role] = {"output_dir": str(outputs[role]), "tensor_count": counts[role],
                                              "target_modules": configs[role]["target_modules"]}
    return summary


def nonexpert_tensors(source: AdapterSource) -> dict:
    """What the non-expert half writes: the non-expert LoRA and the LoRA Experts (KT's layout, cleaned keys)."""
    if source.lora_experts is None:
        return source.nonexpert
    return {**source.nonexpert, **source.lora_experts.peft_tensors()}


def _write_outputs(source: AdapterSource, outputs: dict[str, Path], configs: dict[str, dict], expert_layout, *,
                   overwrite: bool, progress: bool) -> None:
    writers: dict[str, SafetensorsWriter] = {}
    with staged_dirs(list(outputs.values()), overwrite=overwrite) as stages:
        try:
            for role, stage in zip(outputs, stages):
                nonexpert = {} if role == "expert" else nonexpert_tensors(source)
                layout = {key: (value.dtype, tuple(value.shape)) for key, value in nonexpert.items()}
                if role != "nonexpert":
                    layout.update({key: (slot.dtype, slot.shape) for key, slot in expert_layout.items()})
                writers[role] = SafetensorsWriter(stage / ADAPTER_MODEL_FILE, layout, PEFT_METADATA)
                for key, value in nonexpert.items():
                    writers[role].write(key, value)
                write_json(stage / ADAPTER_CONFIG_FILE, configs[role])
            expert_writers = [writer for role, writer in writers.items() if role != "nonexpert"]
            if expert_writers:
                _stream_experts(source, expert_layout, expert_writers, progress)
            for writer in writers.values():
                writer.close()
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise


def _stream_experts(source: AdapterSource, expert_layout, writers: list[SafetensorsWriter], progress: bool) -> None:
    by_layer = defaultdict(list)
    for key, slot in expert_layout.items():
        by_layer[slot.layer].append((key, slot))
    total = sum(slot.dtype.itemsize * slot.shape[0] * slot.shape[1] for slot in expert_layout.values())
    experts = source.experts
    with progress_bar(total, "experts", progress and total > PROGRESS_MIN_BYTES) as bar:
        for layer, tensors in experts.iter_layers():
            for key, slot in by_layer[layer]:
                for writer in writers:
                    writer.write(key, tensors[slot.kt_name][slot.expert])
            if bar is not None:
                bar.update(sum(tensor.nbytes for tensor in tensors.values()))
