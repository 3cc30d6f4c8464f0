"""The expert halves of adapters: registered by name, resident in kernel slots up to a budget, evicted by policy.

An adapter's expert half is big (6·E·r·(H+I) bytes a MoE layer: 792 MiB for Qwen3-30B-A3B at rank 8), so the pool
keeps what SGLang's LoRA manager keeps for the non-expert half: **registered** adapters (header-checked, values read
once, the file held open) and **resident** ones, packed in a kernel slot of every MoE layer, at most
``--kt-max-expert-loras`` of them (a count, or bytes). Before each forward the batch's adapters are made resident,
least-recently-used ones (SGLang's ``--lora-eviction-policy``) evicted when there is no room; the batch's own,
pinned ones and the global ``--kt-expert-lora-path`` adapter never are. A registration is refused when the budget
cannot hold a full batch (``--max-loras-per-batch`` adapters) beside the pinned ones, so a batch always fits.

The kernel's calls are synchronous in the forward (the CPU experts of batch N finish before batch N+1 is
prepared), so only the batch being prepared is protected.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from kt_serve.formats.names import KT_TENSOR_NAMES, kt_shapes

from ..config import ExpertBudget, size_text
from .split import AdapterError

logger = logging.getLogger(__name__)

GLOBAL = "__kt_serve_global_expert_adapter__"  # key of the --kt-expert-lora-path adapter
class _Entry:
    """A registered expert half: its opened adapter (file held open), kernel bytes, and slot when resident."""

    def __init__(self, key, name: str, adapter, nbytes: int, pinned: bool):
        self.key, self.name, self.adapter, self.nbytes, self.pinned = key, name, adapter, nbytes, pinned
        self.slot: int | None = None


class ExpertPool:
    """MoE layers of this process (layer id -> kernel experts) and the expert halves registered and resident."""

    def __init__(self, budget: ExpertBudget, eviction_policy: str = "lru", shard: tuple[int, int] = (0, 1)):
        from sglang.srt.lora.eviction_policy import get_eviction_policy

        self.budget = budget
        self.shard = shard                     # (TP rank, ranks): the slice of each expert's intermediate dim here
        self.layers: dict[int, object] = {}    # layer id -> kt_serve.kernel.experts.MoEExperts
        self.entries: dict[object, _Entry] = {}
        self.policy = get_eviction_policy(eviction_policy)
        self.max_per_batch: int | None = None  # SGLang's --max-loras-per-batch (base requests count as one)
        self.batch_keys: frozenset = frozenset()  # the batch being prepared: never evicted
        self.loads = 0
        self.evictions = 0
        self._global_pending = None           # the --kt-expert-lora-path adapter until every layer holds it

    # -- the global adapter, loaded as MoE layers pack ---------------------------------------------------------
    def add_layer(self, layer_id: int, experts) -> None:
        """A MoE layer finished packing; give it the global adapter right away (refusing a mismatched one)."""
        self.layers[layer_id] = experts
        adapter = self._global_pending
        if adapter is not None:
            if layer_id not in adapter.experts.layers:
                raise AdapterError(f"--kt-expert-lora-path {adapter.path}: no expert LoRA for MoE layer {layer_id}")
            self._check(adapter, [layer_id], require_all=False)
            experts.set_adapter(self.entries[GLOBAL].slot, self._read(adapter, layer_id))

    def load_global(self, path: str) -> None:
        from kt_serve.formats import open_adapter_dir

        adapter = open_adapter_dir(path)
        if adapter.experts is None:
            raise AdapterError(f"--kt-expert-lora-path {path}: the adapter has no routed-expert LoRA tensors")
        if adapter.lora_experts is not None:  # they are not expert LoRA: served only with the rest of the adapter
            raise AdapterError(f"--kt-expert-lora-path {path}: the adapter holds KT-FT LoRA Experts, which this flag "
                               f"would leave out; serve it per request (--lora-paths NAME={path})")
        entry = _Entry(GLOBAL, "--kt-expert-lora-path", adapter, 0, pinned=True)
        entry.slot = 0
        self.entries[GLOBAL] = entry
        self._global_pending = adapter

    def finish_load(self, available_bytes: int) -> None:
        """After the model loaded: the global adapter must not name layers that are not MoE layers, must fit the
        budget (an auto budget is sized now); the capacity goes to the log."""
        self.budget = self.budget.resolved(available_bytes)
        entry = self.entries.get(GLOBAL)
        if entry is not None:
            extra = sorted(set(entry.adapter.experts.layers) - set(self.layers))
            if extra:
                raise AdapterError(f"--kt-expert-lora-path {entry.adapter.path}: expert LoRA for layer(s) {extra}, "
                                   f"which are not MoE layers of this model")
            self._global_pending = None
            entry.nbytes = self.adapter_bytes(entry.adapter.rank)
            if self.budget.nbytes is not None and entry.nbytes > self.budget.nbytes:
                raise AdapterError(f"--kt-expert-lora-path {entry.adapter.path}: its {size_text(entry.nbytes)} in the "
                                   f"kernel exceed --kt-max-expert-loras {self.budget.describe()}")
        if self.layers:
            logger.info("kt_serve: expert adapters: budget %s over %d kernel slots a layer; a rank-8 adapter takes "
                        "%s, so %s fit%s", self.budget.describe(), self.budget.kernel_slots,
                        size_text(self.adapter_bytes(8)), self._capacity(self.adapter_bytes(8)),
                        f" (the global adapter: {size_text(entry.nbytes)}, {self._capacity(entry.nbytes)})"
                        if entry is not None else "")

    def _capacity(self, nbytes: int) -> int:
        fit = self.budget.slots if self.budget.slots is not None else self.budget.nbytes // max(nbytes, 1)
        return min(fit, self.budget.kernel_slots)

    def adapter_bytes(self, rank: int) -> int:
        """Kernel bytes of a rank-``rank`` expert half over these layers: bf16 A and Bᵀ of gate, up and down."""
        return sum(6 * m.num_experts * rank * (m.hidden_size + m.intermediate_size) for m in self.layers.values())

    # -- lookups -----------------------------------------------------------------------------------------------
    @property
    def default_slot(self) -> int:
        entry = self.entries.get(GLOBAL)
        return -1 if entry is None else entry.slot

    def slot_of(self, key) -> int:
        """The kernel slot of adapter ``key``'s expert half; the default slot for a request without an adapter or
        with one that has no expert half."""
        entry = self.entries.get(key) if key is not None else None
        if entry is None:
            return self.default_slot
        if entry.slot is None:
            raise RuntimeError(f"kt_serve: expert adapter {entry.name} is registered but not resident in this batch")
        return entry.slot

    def resident(self) -> list[_Entry]:
        return [e for e in self.entries.values() if e.slot is not None]

    # -- registration ------------------------------------------------------------------------------------------
    def register(self, key, adapter, *, name: str | None = None, pinned: bool = False) -> None:
        """Register the expert half of ``adapter`` (an opened AdapterSource) under ``key``: checked against every
        MoE layer from the header, then read once (values checked) into a slot when there is room, evicting
        unused adapters, or read and dropped when the running batch holds every slot. Nothing stays behind on
        failure. The file is kept open, so a later load reads these same bytes."""
        name = name or str(key)
        if key in self.entries:
            raise AdapterError(f"expert adapter {name} is already loaded")
        self._check(adapter, sorted(self.layers), require_all=True)
        # kept for reloads: the expert file and its rank and alpha, not the halves others hold (non-expert tensors
        # went to SGLang, LoRA Experts to lora_experts.py)
        adapter = dataclasses.replace(adapter, nonexpert={}, lora_experts=None)
        entry = _Entry(key, name, adapter, self.adapter_bytes(adapter.rank), pinned)
        self._check_capacity(entry)
        adapter.experts.file.hold_open()
        try:
            if not self._make_resident(entry, protect=self.batch_keys, required=pinned):
                for layer_id in sorted(self.layers):  # no room now: check the values; loaded on first use
                    self._read(adapter, layer_id)
        except BaseException:
            adapter.experts.file.close()
            raise
        self.entries[key] = entry

    def unregister(self, key) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        if entry.slot is not None:
            for experts in self.layers.values():
                experts.remove_adapter(entry.slot)
        self.policy.remove(key)
        entry.adapter.experts.file.close()

    def _check_capacity(self, new: _Entry) -> None:
        """Refuse ``new`` when the budget could not hold the pinned adapters plus a full batch of the largest
        unpinned ones."""
        entries = [*self.entries.values(), new]
        pinned = [e for e in entries if e.pinned]
        unpinned = sorted((e.nbytes for e in entries if not e.pinned), reverse=True)
        per_batch = len(unpinned) if self.max_per_batch is None else min(self.max_per_batch, len(unpinned))
        count = len(pinned) + per_batch
        nbytes = sum(e.nbytes for e in pinned) + sum(unpinned[:per_batch])
        limit = self.budget.kernel_slots
        if count > limit or (self.budget.nbytes is not None and nbytes > self.budget.nbytes):
            raise AdapterError(
                f"cannot register expert adapter {new.name} ({size_text(new.nbytes)}): a batch of {per_batch} adapters "
                f"beside {len(pinned)} pinned needs {count} resident ({size_text(nbytes)}), over --kt-max-expert-loras "
                f"{self.budget.describe()} ({limit} kernel slots); raise it, lower --max-loras-per-batch or unpin")

    # -- per batch -------------------------------------------------------------------------------------------
    def prepare(self, keys) -> None:
        """Make the expert halves of this batch's adapters resident (keys without one are skipped)."""
        batch = frozenset(k for k in keys if k in self.entries)
        self.batch_keys = batch
        for key in sorted(batch, key=str):  # the same order on every call: loads and evictions repeat exactly
            self.policy.mark_used(key)
        for key in sorted(batch, key=str):
            self._make_resident(self.entries[key], protect=batch, required=True)

    def _make_resident(self, entry: _Entry, *, protect, required: bool) -> bool:
        """Load ``entry`` into a slot, evicting by policy (never ``protect``, pinned or global adapters). Returns
        False when there is no room and not ``required``."""
        if entry.slot is not None:
            return True
        victims = self._victims(entry, protect)
        if victims is None:
            if required:
                raise AdapterError(f"no room for expert adapter {entry.name} beside the running batch "
                                   f"(--kt-max-expert-loras {self.budget.describe()})")
            return False
        slot = victims[0].slot if victims else self._free_slot()
        for victim in victims:  # the first victim's slot is rewritten in place; the others are freed
            if victim.slot != slot:
                for experts in self.layers.values():
                    experts.remove_adapter(victim.slot)
            victim.slot = None
            self.policy.remove(victim.key)
            self.evictions += 1
        start = time.perf_counter()
        try:
            for layer_id in sorted(self.layers):
                self.layers[layer_id].set_adapter(slot, self._read(entry.adapter, layer_id))
        except BaseException:
            for experts in self.layers.values():
                experts.remove_adapter(slot)
            raise
        entry.slot = slot
        self.policy.mark_used(entry.key)
        self.loads += 1
        logger.info("kt_serve: expert adapter %s loaded into kernel slot %d (%s in %.3f s)%s; %d loads, %d "
                    "evictions so far", entry.name, slot, size_text(entry.nbytes), time.perf_counter() - start,
                    f", evicting {', '.join(v.name for v in victims)}" if victims else "", self.loads,
                    self.evictions)
        return True

    def _victims(self, entry: _Entry, protect) -> list[_Entry] | None:
        """The adapters to evict so ``entry`` fits (chosen by the eviction policy), or None when it cannot."""
        resident = self.resident()
        count, nbytes = len(resident), sum(e.nbytes for e in resident)
        candidates = {e.key for e in resident if not e.pinned and e.key not in protect}
        victims = []

        def fits():
            return count < self.budget.kernel_slots and (self.budget.nbytes is None
                                                         or nbytes + entry.nbytes <= self.budget.nbytes)

        while not fits():
            if not candidates:
                return None
            key = self.policy.select_victim(candidates)
            candidates.discard(key)
            victim = self.entries[key]
            victims.append(victim)
            count, nbytes = count - 1, nbytes - victim.nbytes
        return victims

    def _free_slot(self) -> int:
        used = {e.slot for e in self.resident()}
        return next(slot for slot in range(self.budget.kernel_slots) if slot not in used)

    # -- report ----------------------------------------------------------------------------------------------
    def info(self) -> dict:
        """Registered / resident / pinned expert adapters with their kernel bytes, the budget and the counters."""
        resident = self.resident()
        return {
            "budget": self.budget.describe(),
            "budget_bytes": self.budget.nbytes,
            "budget_adapters": self.budget.slots,
            "resident_bytes": sum(e.nbytes for e in resident),
            "loads": self.loads,
            "evictions": self.evictions,
            "adapters": [{"name": e.name, "bytes": e.nbytes, "rank": e.adapter.rank, "pinned": e.pinned,
                          "resident": e.slot is not None, "slot": e.slot} for e in self.entries.values()],
        }

    # -- helpers -----------------------------------------------------------------------------------------------
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
            E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size * self.shard[1]
            want = kt_shapes(E, H, I, adapter.rank)
            for name in KT_TENSOR_NAMES:
                got = source.kt_shape(name)
                if got != want[name]:
                    raise AdapterError(
                        f"{adapter.path}: layer {layer_id} {name} has shape {list(got)}, the model expects "
                        f"{list(want[name])} (E={E}, H={H}, I={I}, r={adapter.rank})")

    def _read(self, adapter, layer_id: int):
        """One layer of the adapter's expert LoRA, this rank's slice of it."""
        from kt_serve.kernel.experts import ExpertLoRA

        return ExpertLoRA.from_kt(adapter.experts.read_one(layer_id), float(adapter.alpha)).shard(*self.shard)
