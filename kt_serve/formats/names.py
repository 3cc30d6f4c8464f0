"""Every file name, key pattern and adapter_config rule of the KT / PEFT adapter formats.

This is the one place that knows key names (see notes/kt-adapter-format.md sections 2-4 and 7). Other modules
build and parse keys only through the tables and functions here.
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple


class FormatError(ValueError):
    """A bad adapter file or directory. The message is one line naming the file and the problem."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class MissingFileError(FormatError, FileNotFoundError):
    """A required input file or directory does not exist."""


class OutputExistsError(FormatError, FileExistsError):
    """An output path is taken (not a directory, or not empty without overwrite)."""


ADAPTER_MODEL_FILE = "adapter_model.safetensors"
ADAPTER_MODEL_BIN_FILE = "adapter_model.bin"
ADAPTER_CONFIG_FILE = "adapter_config.json"
FUSED_EXPERT_LORA_FILE = "fused_expert_lora.safetensors"
KT_ADAPTER_MANIFEST_FILE = "kt_adapter_manifest.json"
KT_ADAPTER_MANIFEST_VERSION = 1

EXPERT_PROJS = ("gate", "up", "down")


class KTTensor(NamedTuple):
    """One of the six tensors of a KT fused expert layer and the per-expert PEFT weight it stacks."""

    name: str  # e.g. "gate_lora_a"
    proj: str  # "gate" | "up" | "down"
    side: str  # "A" | "B"
    dims: tuple[str, str, str]  # symbolic shape: E experts, r rank, H hidden, I moe intermediate


def _kt_tensors() -> dict[str, KTTensor]:
    # A is [r, in], B is [out, r] per expert; gate/up map H -> I and down maps I -> H.
    in_out = {"gate": ("H", "I"), "up": ("H", "I"), "down": ("I", "H")}
    table = {}
    for proj in EXPERT_PROJS:
        dim_in, dim_out = in_out[proj]
        table[f"{proj}_lora_a"] = KTTensor(f"{proj}_lora_a", proj, "A", ("E", "r", dim_in))
        table[f"{proj}_lora_b"] = KTTensor(f"{proj}_lora_b", proj, "B", ("E", dim_out, "r"))
    return table


KT_TENSORS: dict[str, KTTensor] = _kt_tensors()
KT_TENSOR_NAMES = tuple(KT_TENSORS)  # gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b
KT_TENSOR_BY_PEFT = {(t.proj, t.side): t for t in KT_TENSORS.values()}


def kt_shapes(E: int, H: int, I: int, r: int) -> dict[str, tuple[int, int, int]]:
    """The shape of each KT tensor of one layer (KT_TENSOR_NAMES order) for E experts, hidden H, intermediate I,
    rank r."""
    sizes = {"E": E, "H": H, "I": I, "r": r}
    return {name: tuple(sizes[d] for d in t.dims) for name, t in KT_TENSORS.items()}
DIM_NAMES = {"E": "expert count", "r": "LoRA rank", "H": "hidden size", "I": "intermediate size"}

# Fused KT file: no model prefix, L is the decoder-layer index.
KT_FUSED_KEY_RE = re.compile(r"^layers\.(\d+)\.experts\.([^.]+)$")

# Per-expert PEFT key, any model prefix (model., model.language_model., base_model.model.model., ...).
PER_EXPERT_KEY_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate|up|down)_proj\.lora_(?P<side>[AB])(?:\.default)?\.weight$"
)
# PEFT `target_parameters` on 3-D experts: one nested ParamWrapper per parameter, so the wrapper depth
# (number of `.base_layer`) tells the two apart; which one is gate_up and which down is decided by shape.
TARGET_PARAMETER_KEY_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<depth>(?:base_layer\.)*)"
    r"lora_(?P<side>[AB])(?:\.default)?\.weight$"
)
NONEXPERT_KEY_RE = re.compile(r"(\.lora_[AB]\.weight|\.lora_embedding_[AB])$")

# Leaf order of generated target_modules (reference converter); other names follow sorted.
TARGET_MODULE_ORDER = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "embed_tokens", "lm_head",
)
EXPERT_TARGET_MODULES = tuple(f"{proj}_proj" for proj in EXPERT_PROJS)


def fused_key(layer: int, kt_name: str) -> str:
    return f"layers.{layer}.experts.{kt_name}"


def per_expert_key(layer: int, expert: int, proj: str, side: str) -> str:
    """Reference naming of an expanded expert weight: always `model.layers.{L}`, no `base_model.model.`."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.lora_{side}.weight"


def clean_peft_key(key: str) -> str:
    """The reference converter's cleanup: delete every `base_model.model.` and `.orig_module`."""
    return key.replace("base_model.model.", "").replace(".orig_module", "")


def peft_saved_key(key: str) -> str:
    """Key as PEFT `save_pretrained` writes it (what a KT SFT run puts into adapter_model.safetensors)."""
    return key if key.startswith("base_model.model.") else f"base_model.model.{key}"


def is_lora_a(key: str) -> bool:
    return ".lora_A." in key or key.endswith(".lora_embedding_A")


def is_lora_b(key: str) -> bool:
    return ".lora_B." in key or key.endswith(".lora_embedding_B")


def lora_module(key: str) -> str:
    """Module path a LoRA weight belongs to, used to pair A with B."""
    for marker in (".lora_A.", ".lora_B."):
        if marker in key:
            return key.split(marker, 1)[0]
    return key.rsplit(".lora_embedding_", 1)[0]


def target_module_leaf(key: str) -> str | None:
    """Leaf module name of a LoRA key, as the reference infers target_modules."""
    if "lora_embedding_A" in key or "lora_embedding_B" in key:
        if "embed_tokens" in key:
            return "embed_tokens"
        if "lm_head" in key or "unembed_tokens" in key:
            return "lm_head"
    if ".lora_" not in key:
        return None
    return key.split(".lora_", 1)[0].rsplit(".", 1)[-1]


def ordered_target_modules(modules: Iterable[str]) -> list[str]:
    seen = set(modules)
    ordered = [name for name in TARGET_MODULE_ORDER if name in seen]
    return ordered + sorted(seen.difference(ordered))
