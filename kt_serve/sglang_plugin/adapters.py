"""Expert adapters in kernel slots: the global ``--kt-expert-lora-path`` adapter and the expert halves of
composite adapters loaded through SGLang's LoRA manager, keyed by SGLang's ``lora_id``.

A composite adapter (merged PEFT dir or KT SFT output dir) is split at load: its non-expert half is written as a
plain PEFT adapter to a cache dir and handed to SGLang; its expert half goes into one slot of every MoE layer; LoRA
on the router and gates SGLang has no layer for goes to gate_lora.
Loads are all-or-nothing: every layer is validated before any slot is written, and a failure undoes what was set.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .config import get_config

logger = logging.getLogger(__name__)

GLOBAL = "__kt_serve_global_expert_adapter__"  # registry key of the --kt-expert-lora-path adapter
_KT_NAMES = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")


def expected_shapes(E: int, H: int, I: int, r: int) -> dict[str, tuple[int, ...]]:
    return {"gate_lora_a": (E, r, H), "gate_lora_b": (E, I, r), "up_lora_a": (E, r, H), "up_lora_b": (E, I, r),
            "down_lora_a": (E, r, I), "down_lora_b": (E, H, r)}


class ExpertAdapterError(ValueError):
    pass


class ExpertAdapterRegistry:
    """MoE layers of this process (layer id -> kernel experts) and the adapter held in each slot."""

    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.layers: dict[int, object] = {}           # layer id -> kt_serve.kernel.MoEExperts
        self.slots: dict[str, int] = {}               # adapter key -> slot
        self.global_adapter = None                    # AdapterDir of --kt-expert-lora-path, kept until all layers pack

    # -- layers --------------------------------------------------------------------------------------------
    def add_layer(self, layer_id: int, experts) -> None:
        """A MoE layer finished packing; give it the global adapter right away (refusing a mismatched one)."""
        self.layers[layer_id] = experts
        if self.global_adapter is not None:
            loras = self._layer_loras(self.global_adapter, [layer_id], require_all=False)
            if layer_id not in loras:
                raise ExpertAdapterError(f"--kt-expert-lora-path {self.global_adapter.path}: no expert LoRA for "
                                         f"MoE layer {layer_id}")
            experts.set_adapter(self.slots[GLOBAL], loras[layer_id])

    def load_global(self, path: str) -> None:
        from kt_serve.formats import load_adapter_dir

        adapter = load_adapter_dir(path)
        if not adapter.experts:
            raise ExpertAdapterError(f"--kt-expert-lora-path {path}: the adapter has no routed-expert LoRA tensors")
        self.global_adapter = adapter
        self.slots[GLOBAL] = self._free_slot(GLOBAL)

    def check_global_complete(self, moe_layer_ids) -> None:
        """After loading: the global adapter must not name layers the model does not have as MoE layers."""
        if self.global_adapter is None:
            return
        extra = sorted(set(self.global_adapter.experts) - set(moe_layer_ids))
        if extra:
            raise ExpertAdapterError(f"--kt-expert-lora-path {self.global_adapter.path}: expert LoRA for layer(s) "
                                     f"{extra}, which are not MoE layers of this model")
        self.global_adapter = None  # every layer holds its copy now

    @property
    def default_slot(self) -> int:
        return self.slots.get(GLOBAL, -1)

    # -- per-request adapters ------------------------------------------------------------------------------
    def slot_of(self, lora_id) -> int:
        if lora_id is None:
            return self.default_slot
        return self.slots.get(lora_id, self.default_slot)

    def load(self, key: str, adapter) -> None:
        """Put the expert half of ``adapter`` (an AdapterDir) into a free slot of every MoE layer, or nothing."""
        if key in self.slots:
            raise ExpertAdapterError(f"expert adapter {key} is already loaded")
        loras = self._layer_loras(adapter, sorted(self.layers), require_all=True)
        slot = self._free_slot(key)
        done = []
        try:
            for layer_id, lora in loras.items():
                self.layers[layer_id].set_adapter(slot, lora)
                done.append(layer_id)
        except BaseException:
            for layer_id in done:
                self.layers[layer_id].remove_adapter(slot)
            raise
        self.slots[key] = slot

    def unload(self, key: str) -> None:
        slot = self.slots.pop(key, None)
        if slot is None:
            return
        for experts in self.layers.values():
            experts.remove_adapter(slot)

    # -- helpers -------------------------------------------------------------------------------------------
    def _free_slot(self, key: str) -> int:
        used = set(self.slots.values())
        for slot in range(self.max_slots):
            if slot not in used:
                return slot
        raise ExpertAdapterError(f"cannot load expert adapter {key}: all {self.max_slots} expert slots are in use "
                                 f"(raise --kt-max-expert-loras or unload an adapter)")

    def _layer_loras(self, adapter, layer_ids, *, require_all: bool) -> dict:
        """Validated ``ExpertLoRA`` per layer; raises naming the file, layer, tensor and both shapes."""
        from kt_serve.kernel import ExpertLoRA

        extra = sorted(set(adapter.experts) - set(self.layers)) if require_all else []
        if extra:
            raise ExpertAdapterError(f"{adapter.path}: expert LoRA for layer(s) {extra}, which are not MoE layers "
                                     f"of this model (MoE layers: {sorted(self.layers)})")
        out = {}
        for layer_id in layer_ids:
            tensors = adapter.experts.get(layer_id)
            if tensors is None:
                if require_all:
                    raise ExpertAdapterError(f"{adapter.path}: no expert LoRA for MoE layer {layer_id}")
                continue
            experts = self.layers[layer_id]
            E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
            want = expected_shapes(E, H, I, adapter.rank)
            for name in _KT_NAMES:
                if name not in tensors:
                    raise ExpertAdapterError(f"{adapter.path}: layer {layer_id} lacks expert tensor {name}")
                got = tuple(tensors[name].shape)
                if got != want[name]:
                    raise ExpertAdapterError(
                        f"{adapter.path}: layer {layer_id} {name} has shape {list(got)}, the model expects "
                        f"{list(want[name])} (E={E}, H={H}, I={I}, r={adapter.rank})")
            out[layer_id] = ExpertLoRA.from_kt(tensors, float(adapter.alpha))
        return out


# -- composite adapters -----------------------------------------------------------------------------------------
def _cache_root() -> Path:
    configured = get_config().lora_cache_dir
    if configured:
        return Path(configured)
    user = os.environ.get("USER") or str(os.getuid())
    return Path(tempfile.gettempdir()) / f"kt_serve_lora_cache_{user}"


def _fingerprint(path: Path) -> str:
    """Stable name of a split: the dir and the size/mtime of its files (a changed adapter gets a new split)."""
    h = hashlib.sha256(b"kt_serve split v3\0" + str(path.resolve()).encode())
    for f in sorted(path.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


@dataclass
class SplitAdapter:
    sglang_path: str          # what SGLang's LoRA manager loads
    experts: object | None    # AdapterDir with the routed-expert half, or None
    gates: dict               # gate LoRA (formats.sglang_modules.split_gate_modules), for gate_lora
    scaling: float            # lora_alpha / r of the adapter


def split_composite(path: str, gdn_dims=None) -> SplitAdapter:
    """Read an adapter dir and split it into what SGLang applies, the routed-expert half and the gate LoRA.

    A dir with expert tensors, gate LoRA, or non-expert modules SGLang names otherwise (formats.sglang_modules:
    Qwen3.5's in_proj_qkv, with the model's ``gdn_dims``) gets the half SGLang applies written (once) to
    ``<cache>/<fingerprint>/nonexpert`` in SGLang's names; a module nothing can apply is refused here.
    """
    from kt_serve.formats import load_adapter_dir, nonexpert_config, write_peft_adapter
    from kt_serve.formats.sglang_modules import needs_sglang_names, split_gate_modules, to_sglang_modules

    adapter = load_adapter_dir(path)
    scaling = float(adapter.alpha) / adapter.rank if adapter.rank else 1.0
    rename = needs_sglang_names(adapter.nonexpert)
    experts = adapter if adapter.experts else None
    if not adapter.experts and not rename:
        return SplitAdapter(path, None, {}, scaling)
    nonexpert, gates = split_gate_modules(path, adapter.nonexpert)
    if not nonexpert and not gates:
        raise ExpertAdapterError(f"{path}: expert-only adapter; serve it with --kt-expert-lora-path, or add "
                                 f"non-expert LoRA tensors to use it per request")
    if not nonexpert:
        raise ExpertAdapterError(f"{path}: only router / gate LoRA and no module SGLang applies; per request an "
                                 f"adapter also needs LoRA on attention or MLP projections")
    targets = None
    if rename:
        nonexpert, targets = to_sglang_modules(path, nonexpert, gdn_dims or {})
    target = _cache_root() / _fingerprint(Path(path)) / "nonexpert"
    if not (target / "adapter_config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            config = nonexpert_config(adapter.config, rank=adapter.rank, alpha=adapter.alpha,
                                      base_model_name_or_path=adapter.config.get("base_model_name_or_path") or "",
                                      nonexpert_keys=nonexpert)
            if targets is not None:
                config["target_modules"] = targets
            write_peft_adapter(target, nonexpert, config, overwrite=False)
        except FileExistsError:
            pass  # another scheduler (TP rank) wrote the same split first
        logger.info("kt_serve: split adapter %s; the half SGLang applies, in its module names -> %s", path, target)
    return SplitAdapter(str(target), experts, gates, scaling)
