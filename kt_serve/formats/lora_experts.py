"""KT-FT LoRA Experts: N small dense SwiGLU MLPs per MoE layer, averaged and added to the MoE block output.

KT writes them into the run's ``adapter_model.safetensors`` (notes/kt-lora-experts.md)::

    base_model.model.model.layers.{L}.mlp.lora_experts.{j}.le_gate.weight  [I, H]
    ...le_up.weight [I, H], ...le_down.weight [H, I]                        j = 0 .. N-1, bf16 or fp32

    L(x) = (1/N) · Σ_j le_down_j · (SiLU(le_gate_j · x) ⊙ (le_up_j · x))     added beside the shared expert, not
                                                                            scaled by routed_scaling_factor nor
                                                                            by the shared-expert gate

``adapter_config.json`` from KT records nothing about them, so N comes from the key indices (a gap is refused:
it would change the 1/N) and I, H from the shapes. Our converter and trainer record ``kt_lora_experts`` there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .names import FormatError

LORA_EXPERT_KEY_RE = re.compile(r"^(?:.*\.)?layers\.(\d+)\.mlp\.lora_experts\.(\d+)\.le_(gate|up|down)\.weight$")
LORA_EXPERT_PROJS = ("gate", "up", "down")
CONFIG_FIELD = "kt_lora_experts"  # adapter_config.json: {"num": N, "intermediate_size": I}


def lora_expert_key(layer: int, j: int, proj: str) -> str:
    """The cleaned key (the decoder layer's absolute index); KT writes it with PEFT's ``base_model.model.``."""
    return f"model.layers.{layer}.mlp.lora_experts.{j}.le_{proj}.weight"


@dataclass
class LoRAExperts:
    """Every MoE layer's LoRA Experts, stacked: gate, up [N, I, H] and down [N, H, I] per layer, as stored."""

    layers: dict[int, dict[str, torch.Tensor]]
    num: int
    hidden_size: int
    intermediate_size: int

    def config(self) -> dict:
        return {"num": self.num, "intermediate_size": self.intermediate_size}

    def describe(self) -> str:
        layers = sorted(self.layers)
        return (f"N={self.num} SwiGLU MLPs of I={self.intermediate_size} on H={self.hidden_size}, {len(layers)} "
                f"layers [{layers[0]}..{layers[-1]}], {next(iter(self.layers.values()))['gate'].dtype}")

    def peft_tensors(self) -> dict[str, torch.Tensor]:
        """Per-expert tensors under their cleaned keys (``names.peft_saved_key`` gives KT's saved ones)."""
        return {lora_expert_key(layer, j, proj): tensors[proj][j]
                for layer, tensors in sorted(self.layers.items()) for j in range(self.num)
                for proj in LORA_EXPERT_PROJS}


def split_lora_expert_keys(stored: dict[str, str]) -> dict[str, str]:
    """The cleaned keys (-> stored key) that are LoRA Experts."""
    return {clean: key for clean, key in stored.items() if LORA_EXPERT_KEY_RE.match(clean)}


def read_lora_experts(path: Path, keys: dict[str, str], get, config: dict | None = None) -> LoRAExperts:
    """Validate and stack the LoRA Experts among ``keys`` (cleaned -> stored), read with ``get(stored key)``.
    Refused, naming the tensor: a missing projection, a gap in j, a shape that disagrees, NaN/Inf, a dtype other
    than bf16/fp32, or an ``adapter_config.json`` ``kt_lora_experts`` that the tensors contradict."""
    from .experts import check_finite

    found: dict[int, dict[int, dict[str, str]]] = {}
    for clean, key in keys.items():
        layer, j, proj = LORA_EXPERT_KEY_RE.match(clean).groups()
        found.setdefault(int(layer), {}).setdefault(int(j), {})[proj] = key
    shapes = None
    num = None
    layers = {}
    for layer in sorted(found):
        experts = found[layer]
        if sorted(experts) != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise FormatError(path, f"layer {layer}: lora_experts {missing} missing (indices {sorted(experts)}; "
                                    f"they must run 0..N-1, N sets the 1/N average)")
        if num is None:
            num = len(experts)
        elif len(experts) != num:
            raise FormatError(path, f"layer {layer} has {len(experts)} lora_experts, earlier layers {num}")
        stacked = {proj: [] for proj in LORA_EXPERT_PROJS}
        for j in range(num):
            for proj in LORA_EXPERT_PROJS:
                key = experts[j].get(proj)
                if key is None:
                    raise FormatError(path, f"layer {layer} lora_experts.{j} has no le_{proj}.weight")
                tensor = get(key)
                if tensor.dtype not in (torch.bfloat16, torch.float32):
                    raise FormatError(path, f"{key} is {tensor.dtype}; LoRA Experts are bf16 or fp32")
                if tensor.dim() != 2:
                    raise FormatError(path, f"{key} must be 2-D, got shape {list(tensor.shape)}")
                if shapes is None:
                    I, H = tensor.shape if proj != "down" else tensor.shape[::-1]
                    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
                if tuple(tensor.shape) != shapes[proj]:
                    raise FormatError(path, f"{key} has shape {list(tensor.shape)}, expected {list(shapes[proj])} "
                                            f"(I={shapes['gate'][0]}, H={shapes['gate'][1]} from the first one)")
                check_finite(path, key, tensor)
                stacked[proj].append(tensor)
        layers[layer] = {proj: torch.stack(ts) for proj, ts in stacked.items()}
    I, H = shapes["gate"]
    recorded = (config or {}).get(CONFIG_FIELD)
    if recorded is not None and recorded != {"num": num, "intermediate_size": I}:
        raise FormatError(path, f"adapter_config.json {CONFIG_FIELD}={recorded}, but the tensors hold num={num}, "
                                f"intermediate_size={I}")
    return LoRAExperts(layers, num, H, I)

