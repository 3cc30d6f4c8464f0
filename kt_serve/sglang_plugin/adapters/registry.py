"""The one owner of every per-adapter state of a scheduler process: expert slots, gate LoRA, the current batch.

- :class:`ExpertSlots`: the MoE layers of this process (layer id -> kernel experts) and the adapter held in each
  kernel slot: the global ``--kt-expert-lora-path`` adapter and the expert halves of composite adapters, keyed by
  SGLang's ``lora_id``.
- :class:`AdapterRegistry`: those slots, the gate LoRA (gate_lora.py) and the batch of the forward in flight
  (batch.py), with loads that are all-or-nothing over both: every layer is validated before any slot is written,
  and a failure undoes what was set.

SGLang's LoRA manager, the routed-experts method, the MoE-block and decode-stack hooks and the fused CPU gate ops
all reach adapters through :func:`get_registry`; the batch is handed to it once per forward (prepare_batch), as
SGLang hands its LoRA backend the batch info.
"""

from __future__ import annotations

import threading

from kt_serve.formats.names import KT_TENSOR_NAMES, kt_shapes

from ..config import get_config
from .batch import AdapterBatch, slots_for
from .gate_lora import GateLoRA
from .split import AdapterError, SplitAdapter

GLOBAL = "__kt_serve_global_expert_adapter__"  # slot key of the --kt-expert-lora-path adapter


class ExpertSlots:
    """MoE layers of this process (layer id -> kernel experts) and the adapter held in each slot."""

    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.layers: dict[int, object] = {}           # layer id -> kt_serve.kernel.experts.MoEExperts
        self.slots: dict[str, int] = {}               # adapter key -> slot
        self.global_adapter = None                    # AdapterSource of --kt-expert-lora-path until all layers pack

    # -- layers --------------------------------------------------------------------------------------------
    def add_layer(self, layer_id: int, experts) -> None:
        """A MoE layer finished packing; give it the global adapter right away (refusing a mismatched one)."""
        self.layers[layer_id] = experts
        adapter = self.global_adapter
        if adapter is not None:
            if layer_id not in adapter.experts.layers:
                raise AdapterError(f"--kt-expert-lora-path {adapter.path}: no expert LoRA for MoE layer {layer_id}")
            self._check(adapter, [layer_id], require_all=False)
            experts.set_adapter(self.slots[GLOBAL], self._read(adapter, layer_id))

    def load_global(self, path: str) -> None:
        from kt_serve.formats import open_adapter_dir

        adapter = open_adapter_dir(path)
        if adapter.experts is None:
            raise AdapterError(f"--kt-expert-lora-path {path}: the adapter has no routed-expert LoRA tensors")
        self.global_adapter = adapter
        self.slots[GLOBAL] = self._free_slot(GLOBAL)

    def check_global_complete(self, moe_layer_ids) -> None:
        """After loading: the global adapter must not name layers the model does not have as MoE layers."""
        if self.global_adapter is None:
            return
        extra = sorted(set(self.global_adapter.experts.layers) - set(moe_layer_ids))
        if extra:
            raise AdapterError(f"--kt-expert-lora-path {self.global_adapter.path}: expert LoRA for layer(s) "
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
        """Put the expert half of ``adapter`` (an opened AdapterSource) into a free slot of every MoE layer, or
        nothing. Names and shapes are checked for every layer first; then the file is read one layer at a time, so
        the load holds the kernel's copy plus one layer (a value error found on the way undoes what was set)."""
        if key in self.slots:
            raise AdapterError(f"expert adapter {key} is already loaded")
        self._check(adapter, sorted(self.layers), require_all=True)
        slot = self._free_slot(key)
        done = []
        try:
            for layer_id in sorted(self.layers):
                self.layers[layer_id].set_adapter(slot, self._read(adapter, layer_id))
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
        raise AdapterError(f"cannot load expert adapter {key}: all {self.max_slots} expert slots are in use "
                           f"(raise --kt-max-expert-loras or unload an adapter)")

    def _check(self, adapter, layer_ids, *, require_all: bool) -> None:
        """The adapter's expert layers and tensor shapes against these MoE layers, from the file's header (nothing
        read yet); raises naming the file, layer, tensor and both shapes."""
        source = adapter.experts
        extra = sorted(set(source.layers) - set(self.layers)) if require_all else []
        if extra:
            raise AdapterError(f"{adapter.path}: expert LoRA for layer(s) {extra}, which are not MoE layers "
                               f"of this model (MoE layers: {sorted(self.layers)})")
        for layer_id in layer_ids:
            if layer_id not in source.layers:
                if require_all:
                    raise AdapterError(f"{adapter.path}: no expert LoRA for MoE layer {layer_id}")
                continue
            experts = self.layers[layer_id]
            E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
            want = kt_shapes(E, H, I, adapter.rank)
            for name in KT_TENSOR_NAMES:
                got = source.kt_shape(name)
                if got != want[name]:
                    raise AdapterError(
                        f"{adapter.path}: layer {layer_id} {name} has shape {list(got)}, the model expects "
                        f"{list(want[name])} (E={E}, H={H}, I={I}, r={adapter.rank})")

    @staticmethod
    def _read(adapter, layer_id: int):
        from kt_serve.kernel.experts import ExpertLoRA

        return ExpertLoRA.from_kt(adapter.experts.read_one(layer_id), float(adapter.alpha))


class AdapterRegistry:
    """Every adapter of this process, by SGLang's lora_id: its expert slot, its gate LoRA; and the current batch.

    ``holds_experts``: whether this rank holds routed experts (TP rank 0; the others return zeros that the
    all-reduce adds), so whether expert halves are loaded here. Every rank holds its gates.
    """

    def __init__(self, max_slots: int, holds_experts: bool = True):
        self.holds_experts = holds_experts
        self.experts = ExpertSlots(max_slots)
        self.gates = GateLoRA(lambda: self.batch)
        self.batch: AdapterBatch | None = None  # the forward in flight; None: no LoRA batch (warm-up, no --enable-lora)

    def load(self, lora_id, path: str, split: SplitAdapter) -> bool:
        """Load the plugin's halves of a split composite adapter (gate LoRA; the expert half where this rank holds
        experts), all or nothing. Returns whether an expert half was loaded here."""
        experts = split.experts if split.experts is not None and self.holds_experts else None
        try:
            self.gates.load(lora_id, path, split.gates, split.scaling)
            if experts is not None:
                self.experts.load(lora_id, experts)
        except BaseException:
            self.gates.unload(lora_id)
            raise
        return experts is not None

    def unload(self, lora_id) -> None:
        self.gates.unload(lora_id)
        self.experts.unload(lora_id)

    def prepare_batch(self, lora_ids, seq_lens, layer_lora: bool, expert_slots: bool = True) -> None:
        """The adapters of the forward about to run (``expert_slots`` False: no expert is on the kernel)."""
        slot_of = self.experts.slot_of if expert_slots else (lambda uid: -1)
        self.batch = AdapterBatch.build(lora_ids, seq_lens, slot_of, layer_lora)

    def slots_for(self, num_tokens: int):
        """The kernel ``slots`` argument of an experts call over this forward's ``num_tokens`` tokens."""
        return slots_for(self.batch, num_tokens, self.experts.default_slot)

    def router_lora_loaded(self, gate_keys) -> bool:
        """Whether a loaded adapter has LoRA on one of these routers (then SGLang's router path must run)."""
        return any(key in weights for weights in self.gates.adapters.values() for key in gate_keys)


_registry: AdapterRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> AdapterRegistry:
    """This process's AdapterRegistry (created on first use, with the global expert adapter where this rank holds
    experts)."""
    global _registry
    if _registry is not None:  # read per MoE layer and step: no lock once it exists
        return _registry
    with _registry_lock:
        if _registry is None:
            config = get_config()
            registry = AdapterRegistry(config.max_expert_loras, holds_experts=_tp_rank_zero())
            if config.expert_lora_path and registry.holds_experts:
                registry.experts.load_global(config.expert_lora_path)
            _registry = registry
        return _registry


def _tp_rank_zero() -> bool:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_rank == 0
