"""The one owner of every per-adapter state of a scheduler process: the expert pool, gate LoRA, the current batch.

:class:`AdapterRegistry` holds the expert pool (expert_pool.py: the MoE layers, the expert halves registered by
SGLang's ``lora_id`` and those resident in kernel slots), the gate LoRA (gate_lora.py), KT-FT's LoRA Experts
(lora_experts.py) and the batch of the forward in flight (batch.py), with registrations that are all-or-nothing.

SGLang's LoRA manager, the routed-experts method, the MoE-block and decode-stack hooks and the fused CPU gate ops
all reach adapters through :func:`get_registry`; the batch is handed to it once per forward (prepare_batch), as
SGLang hands its LoRA backend the batch info.
"""

from __future__ import annotations

import threading

from ..config import get_config
from .batch import AdapterBatch, slots_for
from .expert_pool import ExpertBudget, ExpertPool
from .gate_lora import GateLoRA
from .lora_experts import LoRAExpertsBank
from .split import SplitAdapter

class AdapterRegistry:
    """Every adapter of this process, by SGLang's lora_id: its expert slot, its gate LoRA; and the current batch.

    ``shard``: (TP rank, ranks) of the routed experts' intermediate dimension held here; every rank holds its slice
    of each expert half, and all of its gates and LoRA Experts.
    """

    def __init__(self, budget: ExpertBudget, eviction_policy: str = "lru", shard: tuple[int, int] = (0, 1)):
        self.experts = ExpertPool(budget, eviction_policy, shard)
        self.gates = GateLoRA(lambda: self.batch)
        self.lora_experts = LoRAExpertsBank(lambda: self.batch)
        self.batch: AdapterBatch | None = None  # the forward in flight; None: no LoRA batch (warm-up, no --enable-lora)

    def load(self, lora_id, path: str, split: SplitAdapter, *, name: str | None = None, pinned: bool = False) -> bool:
        """Register the plugin's halves of a split composite adapter (gate LoRA, LoRA Experts, the expert half), all
        or nothing. Returns whether an expert half was registered."""
        experts = split.experts
        try:
            self.gates.load(lora_id, path, split.gates, split.scaling)
            self.lora_experts.load(lora_id, path, split.lora_experts)
            if experts is not None:
                self.experts.register(lora_id, experts, name=name, pinned=bool(pinned))
        except BaseException:
            self.gates.unload(lora_id)
            self.lora_experts.unload(lora_id)
            raise
        return experts is not None

    def unload(self, lora_id) -> None:
        self.gates.unload(lora_id)
        self.lora_experts.unload(lora_id)
        self.experts.unregister(lora_id)

    def prepare_batch(self, lora_ids, seq_lens, layer_lora: bool, expert_slots: bool = True) -> None:
        """The adapters of the forward about to run: their expert halves made resident, then each token's slot
        (``expert_slots`` False: no expert is on the kernel)."""
        if expert_slots:
            self.experts.prepare(set(lora_ids))
        slot_of = self.experts.slot_of if expert_slots else (lambda uid: -1)
        self.batch = AdapterBatch.build(lora_ids, seq_lens, slot_of, layer_lora)

    def slots_for(self, num_tokens: int):
        """The kernel ``slots`` argument of an experts call over this forward's ``num_tokens`` tokens."""
        return slots_for(self.batch, num_tokens, self.experts.default_slot)

    def router_lora_in_batch(self, gate_keys) -> bool:
        """Whether an adapter of the forward in flight has LoRA on one of these gates (router, shared-expert gate,
        in_proj_ba): then SGLang's modules, which the plugin's gate LoRA wraps, must run them."""
        if self.batch is None or not self.gates.adapters:
            return False
        for lora_id in set(self.batch.lora_ids):
            weights = self.gates.adapters.get(lora_id)
            if weights and any(key in weights for key in gate_keys):
                return True
        return False


_registry: AdapterRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> AdapterRegistry:
    """This process's AdapterRegistry (created on first use, with the global expert adapter)."""
    global _registry
    if _registry is not None:  # read per MoE layer and step: no lock once it exists
        return _registry
    with _registry_lock:
        if _registry is None:
            config = get_config()
            registry = AdapterRegistry(ExpertBudget.parse(config.max_expert_loras), _eviction_policy(),
                                       _moe_tp_shard())
            if config.expert_lora_path:
                registry.experts.load_global(config.expert_lora_path)
            _registry = registry
        return _registry


def _moe_tp_shard() -> tuple[int, int]:
    """(rank, ranks) of this process in the MoE layers' tensor parallelism (FusedMoE's moe_tp_rank / size)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return int(parallel.moe_tp_rank), int(parallel.moe_tp_size)


def _eviction_policy() -> str:
    from sglang.srt.runtime_context import get_lora

    return get_lora().lora_eviction_policy or "lru"
