"""Adapter formats: the one place that knows KT fused expert LoRA, per-expert / target_parameters PEFT keys,
non-expert PEFT keys, adapter_config.json rules and kt_adapter_manifest.json (notes/kt-adapter-format.md).

- names.py: file names, key patterns, KT tensor table, target_modules order
- safetensors_io.py: lazy validated reading, streamed byte-identical writing, atomic output directories
- experts.py: the three expert layouts, read into KT's fused per-layer layout
- config.py: generated adapter_config.json, alpha precedence, base-model config check
- manifest.py: kt_adapter_manifest.json
- lora_experts.py: KT-FT LoRA Experts (dense SwiGLU MLPs beside the shared expert) in adapter_model.safetensors
- adapter_dir.py: open/load any adapter directory, write PEFT and KT SFT directories
- export.py: streamed merged / expert / non-expert conversion
"""

from .adapter_dir import (
    AdapterDir, AdapterSource, load_adapter_dir, open_adapter_dir, read_fused_expert_lora, write_kt_sft_output,
    write_peft_adapter,
)
from .config import (
    check_base_model, expert_config, merged_config, nonexpert_config, resolve_alpha, resolve_base_model_config,
)
from .experts import ExpertGeometry, expert_peft_tensors, fuse_expert_peft_tensors
from .export import check_output_paths, convert_adapter
from .manifest import build_manifest, read_manifest, verify_manifest
from .names import (
    ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE, EXPERT_PROJS, EXPERT_TARGET_MODULES, FUSED_EXPERT_LORA_FILE,
    KT_ADAPTER_MANIFEST_FILE, KT_TENSOR_NAMES, TARGET_MODULE_ORDER, FormatError, MissingFileError,
    OutputExistsError, clean_peft_key, fused_key, ordered_target_modules, per_expert_key,
)
from .safetensors_io import SafetensorsWriter, save_tensors

gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b = KT_TENSOR_NAMES

__all__ = [
    "AdapterDir", "AdapterSource", "load_adapter_dir", "open_adapter_dir", "read_fused_expert_lora",
    "write_kt_sft_output", "write_peft_adapter", "check_base_model", "expert_config", "merged_config",
    "nonexpert_config", "resolve_alpha", "resolve_base_model_config", "ExpertGeometry", "expert_peft_tensors",
    "fuse_expert_peft_tensors", "check_output_paths", "convert_adapter", "build_manifest", "read_manifest",
    "verify_manifest", "ADAPTER_CONFIG_FILE", "ADAPTER_MODEL_FILE", "EXPERT_PROJS", "EXPERT_TARGET_MODULES",
    "FUSED_EXPERT_LORA_FILE", "KT_ADAPTER_MANIFEST_FILE", "KT_TENSOR_NAMES", "TARGET_MODULE_ORDER", "FormatError",
    "MissingFileError", "OutputExistsError", "clean_peft_key", "fused_key", "ordered_target_modules",
    "per_expert_key", "SafetensorsWriter", "save_tensors", "gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b",
    "down_lora_a", "down_lora_b",
]
