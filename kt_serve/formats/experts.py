"""Routed-expert LoRA in its three on-disk layouts, all read into KT's fused per-layer layout.

- `kt_fused`: KT's fused_expert_lora.safetensors, `layers.{L}.experts.{gate,up,down}_lora_{a,b}` [E, ...].
- `peft_per_expert`: `...layers.{L}.mlp.experts.{e}.{proj}_proj.lora_{A,B}.weight` (A [r,in], B [out,r]).
- `peft_target_parameters`: PEFT ParamWrapper on 3-D `gate_up_proj` [E,2I,H] / `down_proj` [E,H,I]; A is
  [r*E, in] expert-major, B is [out, r*E] expert-minor (notes section 7), gate/up share one A.

A source validates names and shapes from the header when built and values (finite) when a layer is read, so
a converter streams one layer at a time.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Mapping, NamedTuple

import torch

from .names import (
    DIM_NAMES, EXPERT_PROJS, KT_FUSED_KEY_RE, KT_TENSOR_BY_PEFT, KT_TENSOR_NAMES, KT_TENSORS,
    PER_EXPERT_KEY_RE, TARGET_PARAMETER_KEY_RE, FormatError, fused_key, per_expert_key,
)
from .safetensors_io import TensorFile


class ExpertGeometry(NamedTuple):
    num_experts: int
    rank: int
    hidden: int
    intermediate: int


class _DimBinder:
    """Binds E, r, H, I to sizes across all layers, remembering which tensor fixed each, for error messages."""

    def __init__(self, path: Path):
        self.path = path
        self.values: dict[str, int] = {}
        self.sources: dict[str, str] = {}

    def check_layer(self, layer: int, shapes: Mapping[str, tuple[int, ...]], display: Mapping[str, str]) -> None:
        missing = [name for name in KT_TENSOR_NAMES if name not in shapes]
        if missing:
            raise FormatError(self.path, f"layer {layer} lacks expert tensor(s) {', '.join(missing)}; "
                                         "every layer needs all six (gate/up/down x lora_a/lora_b)")
        for name in KT_TENSOR_NAMES:
            if len(shapes[name]) != 3:
                raise FormatError(self.path, f"{display[name]} must be 3-D [E, ...], got shape {list(shapes[name])}")
        for proj in EXPERT_PROJS:  # the rank a B consumes must be the rank its A produces
            a_rank, b_rank = shapes[f"{proj}_lora_a"][1], shapes[f"{proj}_lora_b"][2]
            if a_rank != b_rank:
                raise FormatError(self.path, f"A/B inner dimension mismatch: {display[proj + '_lora_b']} has rank "
                                             f"{b_rank} but {display[proj + '_lora_a']} has rank {a_rank}")
        for name in KT_TENSOR_NAMES:
            for dim, size in zip(KT_TENSORS[name].dims, shapes[name]):
                bound = self.values.setdefault(dim, size)
                self.sources.setdefault(dim, display[name])
                if size != bound:
                    raise FormatError(self.path, f"inconsistent {DIM_NAMES[dim]}: {display[name]} has {dim}={size} "
                                                 f"but {self.sources[dim]} has {dim}={bound}")

    def geometry(self) -> ExpertGeometry:
        return ExpertGeometry(self.values["E"], self.values["r"], self.values["H"], self.values["I"])


def check_finite(path: Path, key: str, tensor: torch.Tensor) -> None:
    # min/max propagate NaN and keep +-Inf: one pass, no copy, several times faster than isfinite(...).all() on
    # CPU BF16, which is not vectorised.
    if tensor.is_floating_point() and tensor.numel():
        low, high = torch.aminmax(tensor)
        if not (torch.isfinite(low) and torch.isfinite(high)):
            raise FormatError(path, f"{key} holds NaN or Inf values")


class ExpertSource:
    """Expert LoRA of one file, per layer in KT layout. Subclasses map their keys; shapes checked on build."""

    format: str

    def __init__(self, file: TensorFile):
        self.file = file
        self.path = file.path
        self.layers: list[int] = []
        self.geometry: ExpertGeometry | None = None
        self.dtypes: dict[tuple[int, str], torch.dtype] = {}

    def _finish(self, shapes: dict[int, dict[str, tuple[int, ...]]], display) -> None:
        if not shapes:
            raise FormatError(self.path, "holds no expert LoRA tensors")
        binder = _DimBinder(self.path)
        for layer in sorted(shapes):
            binder.check_layer(layer, shapes[layer], display(layer))
        self.layers = sorted(shapes)
        self.geometry = binder.geometry()

    def kt_shape(self, name: str) -> tuple[int, int, int]:
        sizes = self.geometry._asdict()
        by_dim = {"E": sizes["num_experts"], "r": sizes["rank"], "H": sizes["hidden"], "I": sizes["intermediate"]}
        return tuple(by_dim[dim] for dim in KT_TENSORS[name].dims)

    def layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The KT fused file these tensors make: key -> (dtype, shape)."""
        return {fused_key(layer, name): (self.dtypes[layer, name], self.kt_shape(name))
                for layer in self.layers for name in KT_TENSOR_NAMES}

    def nbytes(self) -> int:
        return self.file.nbytes()

    def read_layer(self, layer: int, get) -> dict[str, torch.Tensor]:
        """The six KT tensors of `layer`, read with `get` from `self.file.reader()`; NaN/Inf is an error."""
        tensors = self._read_layer(layer, get)
        for name, tensor in tensors.items():
            check_finite(self.path, f"layer {layer} {name}", tensor)
        return tensors

    def read_one(self, layer: int) -> dict[str, torch.Tensor]:
        """The six KT tensors of `layer`, from a fresh mapping of the file: touched pages of a long-open mapping stay
        in RSS (the whole file, at the end)."""
        with self.file.reader() as get:
            return self.read_layer(layer, get)

    def iter_layers(self):
        """(layer, six KT tensors), one layer in memory at a time."""
        for layer in self.layers:
            yield layer, self.read_one(layer)

    def read_all(self) -> dict[int, dict[str, torch.Tensor]]:
        return dict(self.iter_layers())


class FusedExpertSource(ExpertSource):
    format = "kt_fused"

    def __init__(self, file: TensorFile):
        super().__init__(file)
        shapes: dict[int, dict[str, tuple[int, ...]]] = defaultdict(dict)
        for key in sorted(file.keys()):
            match = KT_FUSED_KEY_RE.match(key)
            if match is None:
                raise FormatError(self.path, f"unexpected key {key} (expected layers.<L>.experts.<kt_name>)")
            layer, name = int(match.group(1)), match.group(2)
            if name not in KT_TENSORS:
                raise FormatError(self.path, f"unsupported KT fused expert LoRA tensor {key} "
                                             f"(expected one of {', '.join(KT_TENSOR_NAMES)})")
            shapes[layer][name] = file.shapes[key]
            self.dtypes[layer, name] = file.dtypes[key]
        self._finish(shapes, lambda layer: {name: fused_key(layer, name) for name in KT_TENSOR_NAMES})

    def _read_layer(self, layer, get):
        return {name: get(fused_key(layer, name)) for name in KT_TENSOR_NAMES}


class PerExpertSource(ExpertSource):
    format = "peft_per_expert"

    def __init__(self, file: TensorFile, keys: Mapping[str, str]):
        """`keys`: cleaned key (parsed) -> key as stored in the file (read)."""
        super().__init__(file)
        # (layer, kt_name) -> expert -> key
        self._keys: dict[tuple[int, str], dict[int, str]] = defaultdict(dict)
        prefixes: dict[int, str] = {}
        for clean, key in keys.items():
            match = PER_EXPERT_KEY_RE.match(clean)
            layer, expert = int(match["layer"]), int(match["expert"])
            name = KT_TENSOR_BY_PEFT[match["proj"], match["side"]].name
            if expert in self._keys[layer, name]:
                raise FormatError(self.path, f"duplicate expert tensor {key} and {self._keys[layer, name][expert]}")
            self._keys[layer, name][expert] = key
            prefixes[layer] = match["prefix"]
        shapes: dict[int, dict[str, tuple[int, ...]]] = defaultdict(dict)
        for (layer, name), experts in sorted(self._keys.items()):
            tensor = KT_TENSORS[name]
            count = max(experts) + 1
            absent = sorted(set(range(count)) - set(experts))
            if absent:
                raise FormatError(self.path, f"layer {layer} lacks {tensor.proj}_proj.lora_{tensor.side} "
                                             f"for expert(s) {absent}")
            per_expert = {file.shapes[key] for key in experts.values()}
            dtypes = {file.dtypes[key] for key in experts.values()}
            if len(per_expert) != 1 or len(dtypes) != 1:
                raise FormatError(self.path, f"layer {layer} {tensor.proj}_proj.lora_{tensor.side} differs in "
                                             f"shape or dtype between experts: {sorted(per_expert)}")
            shapes[layer][name] = (count, *per_expert.pop())
            self.dtypes[layer, name] = dtypes.pop()

        def display(layer):
            return {name: f"{prefixes.get(layer, '')}layers.{layer}.mlp.experts.*.{KT_TENSORS[name].proj}_proj."
                          f"lora_{KT_TENSORS[name].side}.weight" for name in KT_TENSOR_NAMES}

        self._finish(shapes, display)

    def _read_layer(self, layer, get):
        return {name: torch.stack([get(self._keys[layer, name][e]) for e in range(len(self._keys[layer, name]))])
                for name in KT_TENSOR_NAMES}


class TargetParameterSource(ExpertSource):
    format = "peft_target_parameters"

    def __init__(self, file: TensorFile, keys: Mapping[str, str], rank: int | None):
        super().__init__(file)
        if not rank:
            raise FormatError(self.path, "PEFT target_parameters expert LoRA needs `r` in adapter_config.json")
        by_depth: dict[int, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
        for clean, key in keys.items():
            match = TARGET_PARAMETER_KEY_RE.match(clean)
            by_depth[int(match["layer"])][match["depth"].count("base_layer")][match["side"]] = key
        self._pairs: dict[int, dict[str, tuple[str, str]]] = {}
        shapes: dict[int, dict[str, tuple[int, ...]]] = {}
        for layer, depths in sorted(by_depth.items()):
            pairs = [(sides.get("A"), sides.get("B")) for _, sides in sorted(depths.items())]
            if len(pairs) != 2 or not all(a and b for a, b in pairs):
                found = sorted(key for sides in depths.values() for key in sides.values())
                raise FormatError(self.path, f"layer {layer}: expected lora_A/lora_B for both gate_up_proj and "
                                             f"down_proj (target_parameters), got {found}")
            (a0, b0), (a1, b1) = pairs
            in0, out0, in1, out1 = file.shapes[a0][1], file.shapes[b0][0], file.shapes[a1][1], file.shapes[b1][0]
            # gate_up maps H -> 2I and down maps I -> H; only one assignment fits.
            if out0 == 2 * in1 and in0 == out1:
                gate_up, down = pairs
            elif out1 == 2 * in0 and in1 == out0:
                down, gate_up = pairs
            else:
                raise FormatError(self.path, f"layer {layer}: target_parameters LoRA shapes do not form "
                                             f"gate_up_proj [2I,H] and down_proj [H,I]")
            self._pairs[layer] = {"gate_up": gate_up, "down": down}
            layer_shapes = {}
            for proj_pair, (a_key, b_key) in self._pairs[layer].items():
                rows, fan_in = file.shapes[a_key]
                fan_out, cols = file.shapes[b_key]
                if rows % rank or cols % rank:
                    raise FormatError(self.path, f"{a_key} has {rows} rows, not a multiple of r={rank}")
                if rows != cols:
                    raise FormatError(self.path, f"A/B inner dimension mismatch: {b_key} has {cols} columns but "
                                                 f"{a_key} has {rows} rows")
                experts = rows // rank
                projs = ("gate", "up") if proj_pair == "gate_up" else ("down",)
                for proj in projs:
                    layer_shapes[f"{proj}_lora_a"] = (experts, rank, fan_in)
                    layer_shapes[f"{proj}_lora_b"] = (experts, fan_out // len(projs), rank)
                    self.dtypes[layer, f"{proj}_lora_a"] = file.dtypes[a_key]
                    self.dtypes[layer, f"{proj}_lora_b"] = file.dtypes[b_key]
            shapes[layer] = layer_shapes
        self._rank = rank

        def display(layer):
            pair = {name: "down" if name.startswith("down") else "gate_up" for name in KT_TENSOR_NAMES}
            return {name: self._pairs[layer][pair[name]][KT_TENSORS[name].side == "B"] for name in KT_TENSOR_NAMES}

        self._finish(shapes, display)

    def _read_layer(self, layer, get):
        out = {}
        for proj_pair, (a_key, b_key) in self._pairs[layer].items():
            a, b = get(a_key), get(b_key)
            experts = a.shape[0] // self._rank
            stacked_a = a.reshape(experts, self._rank, a.shape[1])  # rows are expert-major
            stacked_b = b.reshape(b.shape[0], self._rank, experts).permute(2, 0, 1)  # columns are expert-minor
            if proj_pair == "down":
                out["down_lora_a"], out["down_lora_b"] = stacked_a.contiguous(), stacked_b.contiguous()
            else:  # gate is the first half of gate_up's output rows, up the second; both share A
                gate_b, up_b = stacked_b.chunk(2, dim=1)
                out["gate_lora_a"], out["up_lora_a"] = stacked_a.contiguous(), stacked_a.clone()
                out["gate_lora_b"], out["up_lora_b"] = gate_b.contiguous(), up_b.contiguous()
        return out


def split_expert_keys(keys) -> tuple[list[str], list[str], list[str]]:
    """(per-expert keys, target_parameters keys, other keys) of a cleaned PEFT key list."""
    per_expert, target_parameters, other = [], [], []
    for key in keys:
        if PER_EXPERT_KEY_RE.match(key):
            per_expert.append(key)
        elif TARGET_PARAMETER_KEY_RE.match(key):
            target_parameters.append(key)
        else:
            other.append(key)
    return per_expert, target_parameters, other


def expert_peft_tensors(experts: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """KT fused layers -> per-expert PEFT keys (reference naming), `tensor[e].contiguous()`, dtype kept."""
    out: dict[str, torch.Tensor] = {}
    for layer in sorted(experts):
        for name in KT_TENSOR_NAMES:
            tensor, spec = experts[layer][name], KT_TENSORS[name]
            for expert in range(tensor.shape[0]):
                out[per_expert_key(layer, expert, spec.proj, spec.side)] = tensor[expert].contiguous()
    return out


def fuse_expert_peft_tensors(tensors: Mapping[str, torch.Tensor],
                             path="<tensors>") -> dict[int, dict[str, torch.Tensor]]:
    """Per-expert PEFT keys (any prefix) -> KT fused layers. Non-expert keys are an error here."""
    per_expert, target_parameters, other = split_expert_keys(tensors)
    if other or target_parameters:
        raise FormatError(path, f"not a per-expert LoRA key: {(other + target_parameters)[0]}")
    file = TensorFile(Path(str(path)), dict(tensors))
    return PerExpertSource(file, {key: key for key in per_expert}).read_all()


class PeftSlot(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    layer: int
    kt_name: str
    expert: int


def peft_expert_layout(source: ExpertSource) -> dict[str, PeftSlot]:
    """Per-expert PEFT keys a source expands to, and where each comes from."""
    layout = {}
    for layer in source.layers:
        for name in KT_TENSOR_NAMES:
            spec, shape = KT_TENSORS[name], source.kt_shape(name)
            for expert in range(shape[0]):
                layout[per_expert_key(layer, expert, spec.proj, spec.side)] = PeftSlot(
                    source.dtypes[layer, name], shape[1:], layer, name, expert)
    return layout


__all__ = [
    "ExpertGeometry", "ExpertSource", "FusedExpertSource", "PerExpertSource", "TargetParameterSource",
    "split_expert_keys", "expert_peft_tensors", "fuse_expert_peft_tensors", "peft_expert_layout", "PeftSlot",
]
