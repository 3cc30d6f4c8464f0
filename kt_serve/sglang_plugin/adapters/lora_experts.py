"""KT-FT LoRA Experts per request: each request's rows get its adapter's L(x) added to the MoE block's output.

L(x) = (1/N) Σ_j down_j · (SiLU(gate_j · x) ⊙ (up_j · x)), on the block's input x (formats/lora_experts.py), added
after the block has combined routed and shared experts, so it is scaled neither by ``routed_scaling_factor`` nor
by the shared-expert gate, as KT defines it. SGLang has no layer for them, so the plugin applies them: an AFTER
hook on the MoE block's forward (manager_hooks.py) of Qwen2-MoE / Qwen3.5-MoE, Qwen3-MoE and DeepSeek, with the
batch's token groups (batch.py); on a CPU host in the kernel's packed linears (fp32 sums), on an accelerator in
torch. Every TP rank holds them; where the block's output is still to be summed over the ranks, rank 0 alone adds
them. The Qwen3 decode stack leaves batches that use them to SGLang's layer loop.
"""

from __future__ import annotations

import re

import torch

from ..accelerator import emulated
from .split import AdapterError

_MOE_BLOCKS = ("Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "DeepseekV2MoE")
_LAYER_OF = re.compile(r"layers\.(\d+)\.mlp$")
_LAYER_ATTR = "_kt_lora_experts_layer"


class LoRAExpertsBank:
    """Per adapter (SGLang's lora_id): every MoE layer's LoRA Experts, fused for the forward.
    ``current_batch()``: the AdapterBatch of the forward in flight (the registry keeps it)."""

    def __init__(self, current_batch):
        self.current_batch = current_batch
        self.adapters: dict[object, dict[int, _Layer]] = {}
        self.moe_layers: dict[int, int] = {}  # MoE layer id -> hidden size, from the loaded model
        self.dtype = torch.bfloat16
        self.device = torch.device("cpu")

    def attach(self, model, dtype, device) -> None:
        """After model load: note each MoE block's layer (by its module path), the model's dtype and device."""
        self.dtype, self.device = dtype, torch.device(device)
        for name, module in model.named_modules():
            match = _LAYER_OF.search(name)
            if match and type(module).__name__ in _MOE_BLOCKS:
                layer = int(match.group(1))
                setattr(module, _LAYER_ATTR, layer)
                self.moe_layers[layer] = int(module.experts.hidden_size)

    def load(self, lora_id, path: str, lora_experts) -> None:
        """Check ``lora_experts`` (formats.lora_experts.LoRAExperts) against the model's MoE layers and keep them."""
        if lora_experts is None:
            return
        extra = sorted(set(lora_experts.layers) - set(self.moe_layers))
        if extra:
            raise AdapterError(f"{path}: LoRA Experts for layer(s) {extra}, which are not MoE layers of this model "
                               f"(MoE layers: {sorted(self.moe_layers)})")
        layer = min(lora_experts.layers)
        if lora_experts.hidden_size != self.moe_layers[layer]:
            raise AdapterError(f"{path}: LoRA Experts have H={lora_experts.hidden_size}, the model's hidden size is "
                               f"{self.moe_layers[layer]}")
        self.adapters[lora_id] = {layer: _Layer(t, self.dtype, self.device)
                                  for layer, t in lora_experts.layers.items()}

    def unload(self, lora_id) -> None:
        self.adapters.pop(lora_id, None)

    def in_batch(self) -> bool:
        batch = self.current_batch()
        return bool(self.adapters) and batch is not None and any(uid in self.adapters for uid in set(batch.lora_ids))

    def add_to_output(self, block, x: torch.Tensor, out) -> None:
        """out[rows of adapter a] += L_a(x[rows]) for every adapter of the batch with LoRA Experts here."""
        if not self.in_batch():
            return
        layer = getattr(block, _LAYER_ATTR, None)
        if layer is None:
            return
        if not isinstance(out, torch.Tensor):
            raise RuntimeError(f"kt_serve: MoE layer {layer} returned {type(out).__name__} (a deferred combine); "
                               f"LoRA Experts need its output tensor")
        if not _adds_here(block):
            return
        x = x.view(-1, x.shape[-1])
        flat = out.view(-1, out.shape[-1])
        for uid, rows in self.current_batch().adapter_tokens():
            weights = self.adapters.get(uid, {}).get(layer)
            if weights is not None:
                flat[rows] += weights(x[rows]).to(flat.dtype)


class _Layer:
    """One layer's N LoRA Experts as two matrices: gate and up of every expert stacked [N·2I, H] (one GEMM), and
    the downs side by side [H, N·I] (one GEMM sums the N outputs). On a CPU host both are the kernel's packed
    bf16 linears with fp32 sums and outputs; elsewhere torch's in the model's dtype."""

    def __init__(self, t: dict, dtype, device):
        N, I, H = t["gate"].shape
        self.N, self.I = N, I
        gate_up = torch.stack([t["gate"], t["up"]], dim=1).reshape(N * 2 * I, H)
        down = t["down"].permute(1, 0, 2).reshape(H, N * I)
        if device.type == "cpu" and not emulated():  # the emulation runs the accelerator host's torch path
            from kt_serve.kernel.linear import PackedLinear

            self.gate_up, self.down = PackedLinear(gate_up), PackedLinear(down)
        else:
            self.gate_up = gate_up.to(device=device, dtype=dtype).contiguous()
            self.down = down.to(device=device, dtype=dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """L(x) = (1/N) Σ_j down_j (SiLU(gate_j x) ⊙ up_j x) for rows x [T, H]."""
        if isinstance(self.down, torch.Tensor):
            gu = torch.nn.functional.linear(x, self.gate_up)
        else:
            gu = self.gate_up.forward(x.to(torch.bfloat16).contiguous(), out_dtype=torch.float32)
        gu = gu.view(-1, self.N, 2, self.I)
        h = (torch.nn.functional.silu(gu[:, :, 0]) * gu[:, :, 1]).reshape(-1, self.N * self.I)
        if isinstance(self.down, torch.Tensor):
            return torch.nn.functional.linear(h, self.down) / self.N
        return self.down.forward(h.to(torch.bfloat16), out_dtype=torch.float32) / self.N


def _adds_here(block) -> bool:
    """Whether this rank adds L: every rank where the block's output is already summed over the TP ranks, else
    rank 0 only."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if parallel.tp_size == 1:
        return True
    reduced = getattr(block, "reduce_results", None)
    if reduced is None:
        reduced = getattr(block.experts, "reduce_results", True)
    return bool(reduced) or parallel.tp_rank == 0

