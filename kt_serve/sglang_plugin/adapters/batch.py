"""Per-batch adapter selection: request adapter ids -> one kernel slot per token, and the tokens of each adapter.

Built once per forward batch (AFTER ``LoRAManager.prepare_lora_batch``, registry.py) and handed to the adapter
registry, where every MoE layer and gate LoRA of that forward reads it: their ``forward`` only sees hidden states.
Without ``--enable-lora`` no batch is ever prepared and every token uses the default slot (the global
``--kt-expert-lora-path`` adapter, or none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AdapterBatch:
    num_tokens: int
    # int32 [T] on CPU: kernel slot per token (-1 = base experts only); None when every token shares one slot
    token_slots: torch.Tensor | None
    # that shared slot (the kernel then needs no per-token array)
    uniform_slot: int
    lora_ids: list
    seq_lens: list[int]
    layer_lora: bool = False  # some request's adapter has LoRA inside the decoder layers (SGLang's half)
    _groups: list | None = None

    @classmethod
    def build(cls, lora_ids, seq_lens, slot_of, layer_lora: bool = False) -> "AdapterBatch":
        """lora_ids: adapter id (or None) per request; seq_lens: tokens per request in this forward;
        slot_of: maps an adapter id (or None) to its kernel slot (-1: none); layer_lora: see the field."""
        slots = [slot_of(uid) for uid in lora_ids]
        seq_lens = [int(n) for n in seq_lens]
        num_tokens = sum(seq_lens)
        if len(set(slots)) <= 1:
            return cls(num_tokens, None, slots[0] if slots else -1, list(lora_ids), seq_lens, layer_lora)
        token_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int32),
                                              torch.tensor(seq_lens, dtype=torch.int64))
        return cls(num_tokens, token_slots, -1, list(lora_ids), seq_lens, layer_lora)

    def adapter_tokens(self) -> list[tuple[object, slice | torch.Tensor]]:
        """(adapter id, its tokens: a slice, or an int64 index tensor when its requests are not adjacent) per
        adapter of the batch, requests without one left out; computed once per batch."""
        if self._groups is None:
            runs: dict[object, list[tuple[int, int]]] = {}
            start = 0
            for uid, n in zip(self.lora_ids, self.seq_lens):
                if uid is not None and n:
                    spans = runs.setdefault(uid, [])
                    if spans and spans[-1][1] == start:
                        spans[-1] = (spans[-1][0], start + n)
                    else:
                        spans.append((start, start + n))
                start += n
            self._groups = [(uid, slice(*spans[0]) if len(spans) == 1
                             else torch.cat([torch.arange(a, b) for a, b in spans])) for uid, spans in runs.items()]
        return self._groups


def slots_for(batch: AdapterBatch | None, num_tokens: int, default_slot: int):
    """Kernel ``slots`` argument for a forward over ``num_tokens`` tokens: an int or an int32 tensor [T]."""
    if batch is None:
        return default_slot
    if batch.num_tokens != num_tokens:
        raise RuntimeError(f"kt_serve: MoE layer got {num_tokens} tokens but the LoRA batch has "
                           f"{batch.num_tokens}; per-request expert adapters cannot be mapped")
    return batch.uniform_slot if batch.token_slots is None else batch.token_slots


def forward_batch_seq_lens(forward_batch) -> list[int]:
    """Tokens per request in this forward: the extend lengths for prefill (and mixed) batches, else 1."""
    mode = forward_batch.forward_mode
    if mode.is_extend() and forward_batch.extend_seq_lens_cpu is not None:
        return [int(n) for n in forward_batch.extend_seq_lens_cpu]
    return [1] * len(forward_batch.lora_ids)
