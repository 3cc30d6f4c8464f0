"""PEFT module names that SGLang 0.5.23's LoRA manager does not take as they are: what they become, which the
plugin applies itself, and which cannot be applied at all.

transformers' Qwen3.5 Gated DeltaNet layers have ``in_proj_qkv`` and ``in_proj_z`` where SGLang has one fused
``in_proj_qkvz``; SGLang builds its LoRA from four split modules ``in_proj_q`` / ``in_proj_k`` / ``in_proj_v`` /
``in_proj_z`` (sglang/srt/lora/lora.py ``_normalize_in_proj_qkvz``, which skips a layer lacking any of the four).
A LoRA on ``in_proj_qkv`` is exactly three LoRAs that share its A and take the row blocks of its B, so the split is
lossless; a part the adapter does not train is written as a zero LoRA (B = 0), which changes nothing.

SGLang has no LoRA layer at all for the small gating projections ``lora_target: all`` also trains: the MoE router
(``mlp.gate``), the shared-expert gate and Qwen3.5's beta / decay gates (``in_proj_b`` / ``in_proj_a``, one fused
``in_proj_ba`` in SGLang). Those go to the plugin's own gate LoRA (``sglang_plugin/adapters/gate_lora.py``), per
request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch

from .names import FormatError


@dataclass(frozen=True)
class SplitModule:
    """A PEFT module whose output rows SGLang holds as several modules, in output order."""

    source: str                  # leaf name in the PEFT adapter
    parts: tuple[str, ...]       # leaf names SGLang reads
    rows: tuple[str, ...]        # model dimension (a key of ``gdn_dims``) of each part's rows


@dataclass(frozen=True)
class StackedModule:
    """SGLang's fused module, and the leaf names it needs together in one layer."""

    target: str                  # SGLang's module (what target_modules must name)
    members: tuple[str, ...]     # leaves, in SGLang's stacking order
    rows: tuple[str, ...]        # model dimension of each member's rows


SPLITS = (SplitModule("in_proj_qkv", ("in_proj_q", "in_proj_k", "in_proj_v"), ("key_dim", "key_dim", "value_dim")),)
STACKS = (StackedModule("in_proj_qkvz", ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z"),
                        ("key_dim", "key_dim", "value_dim", "value_dim")),)


@dataclass(frozen=True)
class GateModule:
    """A PEFT module the plugin's gate LoRA applies: the SGLang module (its path inside a decoder layer) whose
    output gets the LoRA delta, and which of that module's stacked outputs the PEFT module is."""

    source: str                  # leaf name in the PEFT adapter
    module: str                  # e.g. "linear_attn.in_proj_ba"
    part: int                    # output block of ``module`` (in_proj_ba = b | a)


GATE_MODULES = {m.source: m for m in (
    GateModule("gate", "mlp.gate", 0),                            # MoE router (Qwen, DeepSeek)
    GateModule("shared_expert_gate", "mlp.shared_expert_gate", 0),
    GateModule("in_proj_b", "linear_attn.in_proj_ba", 0),
    GateModule("in_proj_a", "linear_attn.in_proj_ba", 1),
)}
_GATE_KEY_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
# Leaves no LoRA layer applies (neither SGLang 0.5.23's nor the plugin's), so an adapter holding them is refused.
UNSUPPORTED = {
    "conv1d": "SGLang has no LoRA layer for Qwen3.5's short convolution",
}


def gdn_dims(text_config) -> dict[str, int]:
    """Row counts of the GDN projections, from a Qwen3.5 text config (an object or a dict)."""
    get = text_config.get if isinstance(text_config, Mapping) else lambda k, d=None: getattr(text_config, k, d)
    if get("linear_num_key_heads") is None:
        return {}
    return {"key_dim": get("linear_key_head_dim") * get("linear_num_key_heads"),
            "value_dim": get("linear_value_head_dim") * get("linear_num_value_heads")}


def _leaf_split(key: str) -> tuple[str, str, str] | None:
    """(module prefix, leaf, '.lora_X.weight' tail) of a LoRA key, or None for other keys."""
    for side in (".lora_A.", ".lora_B."):
        if side in key:
            module, tail = key.split(side, 1)
            prefix, _, leaf = module.rpartition(".")
            return prefix, leaf, side + tail
    return None


def needs_sglang_names(keys) -> bool:
    """Whether any key names a module this table rewrites or refuses."""
    leaves = {s.source for s in SPLITS} | {m for s in STACKS for m in s.members} | set(UNSUPPORTED) | set(GATE_MODULES)
    return any((p := _leaf_split(k)) is not None and p[1] in leaves for k in keys)


def split_gate_modules(path, tensors: Mapping[str, torch.Tensor]
                       ) -> tuple[dict[str, torch.Tensor], dict[tuple[int, str], dict[str, torch.Tensor]]]:
    """(the tensors SGLang's LoRA manager takes, the gate LoRA): the latter keyed by (decoder layer, PEFT leaf),
    each {"A": [r, in], "B": [out, r]}."""
    rest: dict[str, torch.Tensor] = {}
    gates: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        parts = _leaf_split(key)
        if parts is None or parts[1] not in GATE_MODULES:
            rest[key] = value
            continue
        prefix, leaf, tail = parts
        gate = GATE_MODULES[leaf]
        match = _GATE_KEY_RE.search(f"{prefix}.{leaf}")
        if match is None or match.group(2) != gate.module.rsplit(".", 1)[0] + f".{leaf}":
            raise FormatError(path, f"{key}: LoRA on {leaf} is applied as {gate.module} of a decoder layer "
                                    f"(layers.N.{gate.module.rsplit('.', 1)[0]}.{leaf}); this key is not one")
        if tail not in (".lora_A.weight", ".lora_B.weight"):
            raise FormatError(path, f"{key}: expected {leaf}.lora_A.weight / lora_B.weight")
        gates.setdefault((int(match.group(1)), leaf), {})[tail[6]] = value
    for (layer, leaf), pair in gates.items():
        if set(pair) != {"A", "B"}:
            raise FormatError(path, f"layer {layer} {leaf}: LoRA lacks its lora_{'B' if 'A' in pair else 'A'}")
    return rest, gates


def to_sglang_modules(path, tensors: Mapping[str, torch.Tensor], dims: Mapping[str, int]
                      ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(tensors with SGLang's leaf names, the target_modules SGLang must wrap) for a non-expert PEFT state dict
    without gate LoRA (``split_gate_modules`` takes that out first).

    Raises FormatError naming the first module nothing can apply, or a split whose rows do not fit the model.
    """
    out: dict[str, torch.Tensor] = {}
    splits = {s.source: s for s in SPLITS}
    stacked_layers: dict[tuple[str, StackedModule], set[str]] = {}
    member_of = {m: s for s in STACKS for m in s.members}
    for key, value in tensors.items():
        parts = _leaf_split(key)
        if parts is None:
            out[key] = value
            continue
        prefix, leaf, tail = parts
        if leaf in UNSUPPORTED:
            raise FormatError(path, f"LoRA on {prefix}.{leaf}: {UNSUPPORTED[leaf]}; train the adapter without "
                                    f"{leaf} (lora_target) to serve it")
        split = splits.get(leaf)
        if split is None:
            out[key] = value
            if leaf in member_of:
                stacked_layers.setdefault((prefix, member_of[leaf]), set()).add(leaf)
            continue
        missing = [d for d in split.rows if d not in dims]
        if missing:
            raise FormatError(path, f"LoRA on {prefix}.{leaf}: the model config lacks {', '.join(missing)}")
        rows = [dims[d] for d in split.rows]
        if tail.startswith(".lora_B.") and value.shape[0] != sum(rows):
            raise FormatError(path, f"{key}: {value.shape[0]} rows, the model's {leaf} has {sum(rows)} "
                                    f"({' + '.join(map(str, rows))})")
        blocks = value.split(rows, dim=0) if tail.startswith(".lora_B.") else [value] * len(rows)
        for part, block in zip(split.parts, blocks):
            out[f"{prefix}.{part}{tail}"] = block.contiguous()
            stacked_layers.setdefault((prefix, member_of[part]), set()).add(part)
    # Fill the stack members an adapter leaves out with zero LoRA, so that SGLang stacks the layer.
    for (prefix, stack), present in stacked_layers.items():
        trained = sorted(present)[0]
        a = next(v for k, v in out.items() if k.startswith(f"{prefix}.{trained}.lora_A."))
        for member, rows in zip(stack.members, stack.rows):
            if member in present:
                continue
            if rows not in dims:
                raise FormatError(path, f"LoRA on {prefix}.{trained}: the model config lacks {rows}")
            out[f"{prefix}.{member}.lora_A.weight"] = torch.zeros_like(a)
            out[f"{prefix}.{member}.lora_B.weight"] = a.new_zeros(dims[rows], a.shape[0])
    target_of = {m: s.target for s in STACKS for m in s.members}
    leaves = {p[1] for k in out if (p := _leaf_split(k)) is not None}
    return out, sorted({target_of.get(leaf, leaf) for leaf in leaves})
