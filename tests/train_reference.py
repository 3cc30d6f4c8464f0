"""Independent pure-torch reference trainer for MoE LoRA SFT (used by tests/test_train*.py and evals/bench_train.py).

Plain torch throughout, sharing no code with kt_serve.train: the HF model in fp32, routed-expert LoRA as explicit
per-expert math on the model's fused weights (the formula of notes/kt-adapter-format.md section 5), PEFT-style
LoRA (``y = W x + s * B A x``) on linear layers, the router's LoRA as a parametrisation of its weight
(``W + s * B A``), AdamW with global-norm clipping and an LR schedule written out from its formula.

LoRA tensors are named canonically, the way they are saved:
  non-expert  ``base_model.model.<module path>.lora_A.weight`` / ``.lora_B.weight``  (A [r,in], B [out,r])
  experts     ``layers.{L}.experts.{gate|up|down}_lora_{a|b}``                     (KT fused layout)
A LoRA is attached exactly where ``init`` provides tensors.
"""

from __future__ import annotations

import math
import re
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

IGNORE_INDEX = -100
PEFT_PREFIX = "base_model.model."
_EXPERT_KEY = re.compile(r"^layers\.(\d+)\.experts\.(gate|up|down)_lora_(a|b)$")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor, scaling: float):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(a.clone().float())
        self.lora_B = nn.Parameter(b.clone().float())
        self.scaling = scaling

    def forward(self, x):
        delta = (x.float() @ self.lora_A.T) @ self.lora_B.T
        return self.base(x) + (self.scaling * delta).to(x.dtype)


class RouterLoRA(nn.Module):
    """Parametrisation of a router weight [E,H]: W + s * B A."""

    def __init__(self, a, b, scaling):
        super().__init__()
        self.lora_A = nn.Parameter(a.clone().float())
        self.lora_B = nn.Parameter(b.clone().float())
        self.scaling = scaling

    def forward(self, weight):
        return weight + (self.scaling * self.lora_B @ self.lora_A).to(weight.dtype)


class LoRAExperts(nn.Module):
    """Routed experts with LoRA, one expert at a time:
    g = x Wg^T + s (x Ag^T) Bg^T ; u = x Wu^T + s (x Au^T) Bu^T ; y = (silu(g) u) Wd^T + s ((silu(g) u) Ad^T) Bd^T ;
    out[t] = sum_k w[t,k] y_k."""

    def __init__(self, gate_up_proj, down_proj, lora: dict[str, torch.Tensor], scaling: float):
        super().__init__()
        inter = gate_up_proj.shape[1] // 2
        self.register_buffer("w_gate", gate_up_proj[:, :inter].detach().float().clone())
        self.register_buffer("w_up", gate_up_proj[:, inter:].detach().float().clone())
        self.register_buffer("w_down", down_proj.detach().float().clone())
        self.lora = nn.ParameterDict({k: nn.Parameter(v.clone().float()) for k, v in lora.items()})
        self.scaling = scaling

    def _proj(self, x, e, w, name):
        a, b = self.lora[f"{name}_lora_a"][e], self.lora[f"{name}_lora_b"][e]
        return x @ w[e].T + self.scaling * (x @ a.T) @ b.T

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = hidden_states.float()
        out = torch.zeros_like(x)
        for e in range(self.w_gate.shape[0]):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            xe = x[token]
            h = F.silu(self._proj(xe, e, self.w_gate, "gate")) * self._proj(xe, e, self.w_up, "up")
            y = self._proj(h, e, self.w_down, "down")
            out = out.index_add(0, token, y * top_k_weights[token, slot, None].float())
        return out.to(hidden_states.dtype)


def saved_name(product_param: str) -> str:
    """kt_serve.train parameter name -> the canonical (saved) name above, to start both trainers from one init."""
    m = re.match(r"^base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.(\w+_lora_[ab])$", product_param)
    return f"layers.{m.group(1)}.experts.{m.group(2)}" if m else product_param.replace(".default", "")


def build_model(model_dir, init: dict[str, torch.Tensor], alpha: float):
    """fp32 HF model with LoRA attached where ``init`` names it; returns (model, {canonical name: Parameter})."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    model.requires_grad_(False)
    params: dict[str, nn.Parameter] = {}
    pending = dict(init)
    experts_by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for key in list(pending):
        m = _EXPERT_KEY.match(key)
        if m:
            experts_by_layer.setdefault(int(m.group(1)), {})[f"{m.group(2)}_lora_{m.group(3)}"] = pending.pop(key)
    for path, module in list(model.named_modules()):
        gate_up = getattr(getattr(module, "experts", None), "gate_up_proj", None)
        layer_m = re.search(r"layers\.(\d+)\.", path + ".")
        if isinstance(gate_up, torch.Tensor) and layer_m and int(layer_m.group(1)) in experts_by_layer:
            layer = int(layer_m.group(1))
            lora = experts_by_layer.pop(layer)
            rank = lora["gate_lora_a"].shape[1]
            module.experts = LoRAExperts(module.experts.gate_up_proj, module.experts.down_proj, lora, alpha / rank)
            for name, p in module.experts.lora.items():
                params[f"layers.{layer}.experts.{name}"] = p
        a_key, b_key = f"{PEFT_PREFIX}{path}.lora_A.weight", f"{PEFT_PREFIX}{path}.lora_B.weight"
        if a_key not in pending:
            continue
        a, b = pending.pop(a_key), pending.pop(b_key)
        scaling = alpha / a.shape[0]
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        if isinstance(module, nn.Linear):
            wrapped = LoRALinear(module, a, b, scaling)
            setattr(parent, leaf, wrapped)
        else:  # a router: weight [E, H] used through F.linear inside the module's forward
            wrapped = RouterLoRA(a, b, scaling)
            parametrize.register_parametrization(module, "weight", wrapped)
        params[a_key], params[b_key] = wrapped.lora_A, wrapped.lora_B
    if pending or experts_by_layer:
        raise KeyError(f"init names modules the model does not have: {sorted(pending)[:4]} {sorted(experts_by_layer)}")
    return model, params


def lr_factor(kind: str, step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(kind)


def train(model_dir, steps: list[list[dict[str, torch.Tensor]]], init: dict[str, torch.Tensor], *, alpha: float,
          lr: float, scheduler: str = "linear", warmup_steps: int = 0, total_steps: int | None = None,
          max_grad_norm: float = 1.0, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
    """Train on ``steps`` (per optimizer step, its micro-batches: input_ids, attention_mask, labels).
    Returns (per-step losses, final canonical LoRA tensors in fp32, per-step (seconds, tokens))."""
    model, params = build_model(model_dir, init, alpha)
    model.train()
    total_steps = total_steps or len(steps)
    optimizer = torch.optim.AdamW(list(params.values()), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    losses, timings = [], []
    for step, micro_batches in enumerate(steps):
        start, tokens = time.perf_counter(), 0
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(scheduler, step, warmup_steps, total_steps)
        num_labels = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches)
        step_loss = 0.0
        for batch in micro_batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            labels = batch["labels"][:, 1:]
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            mask = labels != IGNORE_INDEX
            picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            loss_sum = -(picked * mask).sum()
            (loss_sum / num_labels).backward()
            step_loss += loss_sum.item()
            tokens += int(batch["attention_mask"].sum())
        grads = [p.grad for p in params.values() if p.grad is not None]
        norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads))
        if max_grad_norm > 0:
            coef = min(1.0, max_grad_norm / (float(norm) + 1e-6))
            for g in grads:
                g.mul_(coef)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss / num_labels)
        timings.append((time.perf_counter() - start, tokens))
    return losses, {k: p.detach().clone() for k, p in params.items()}, timings
