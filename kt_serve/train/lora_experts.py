"""KT-FT LoRA Experts in training (``kt_use_lora_experts``): N dense SwiGLU MLPs per MoE layer, beside the routed
experts, whose mean is added to the MoE block's output (formats/lora_experts.py has the math and KT's keys).

As KT builds them: registered as ``mlp.lora_experts`` on every MoE block (dense layers get none), no biases,
``le_down`` zeros and ``le_gate`` / ``le_up`` kaiming-uniform (a=√5, nn.Linear's own init), so the term starts at
exactly 0; trained as ordinary parameters (base learning rate, weight decay). Held in fp32 like PEFT's LoRA
weights (the input is cast to them, the output back), written in fp32, which KT's loader and ours both read.
They are attached after PEFT wraps the model, so ``lora_target: all`` never puts LoRA on them.
"""

from __future__ import annotations

import torch
from torch import nn

from kt_serve.formats.lora_experts import LORA_EXPERT_KEY_RE, lora_expert_key
from kt_serve.formats.names import peft_saved_key


class LoRAExpert(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.le_gate = nn.Linear(hidden, intermediate, bias=False)
        self.le_up = nn.Linear(hidden, intermediate, bias=False)
        self.le_down = nn.Linear(intermediate, hidden, bias=False)
        nn.init.zeros_(self.le_down.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.le_down(nn.functional.silu(self.le_gate(x)) * self.le_up(x))


class LoRAExpertList(nn.ModuleList):
    """``mlp.lora_experts``: L(x) = (E_0(x) + ... + E_{N-1}(x)) / N, summed in order as KT does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self[0].le_gate.weight.dtype)
        out = self[0](h)
        for expert in self[1:]:
            out = out + expert(h)
        return (out / len(self)).to(x.dtype)


def _add_to_block_output(block, args, kwargs, output):
    x = args[0] if args else kwargs["hidden_states"]
    if isinstance(output, tuple):  # (hidden_states, router_logits) in some transformers MoE blocks
        return (output[0] + block.lora_experts(x), *output[1:])
    return output + block.lora_experts(x)


def attach_lora_experts(blocks, num: int, intermediate: int) -> int:
    """Give each MoE block (module path, block) its LoRA Experts and the hook adding them; returns the count of
    trainable values."""
    total = 0
    for _, block in blocks:
        hidden = block.experts.hidden_size
        block.lora_experts = LoRAExpertList([LoRAExpert(hidden, intermediate) for _ in range(num)])
        block.register_forward_hook(_add_to_block_output, with_kwargs=True)
        total += sum(p.numel() for p in block.lora_experts.parameters())
    return total


def lora_experts_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """KT's keys (``base_model.model.model.layers.{L}.mlp.lora_experts.{j}.le_*.weight``, the layer's absolute
    index, the same prefix for every family) and the trained values."""
    state = {}
    for name, param in model.named_parameters():
        match = LORA_EXPERT_KEY_RE.match(name)
        if match:
            layer, j, proj = int(match.group(1)), int(match.group(2)), match.group(3)
            state[peft_saved_key(lora_expert_key(layer, j, proj))] = param.detach().cpu().contiguous()
    return state
