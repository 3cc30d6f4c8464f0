"""Training half of the expert kernel: autograd over :class:`kt_serve.kernel.experts.MoEExperts` and the gradient
checkpointing phases it honours.

- :class:`MoELoRAExperts` — ``nn.Module``: ``y = experts(x, topk_ids, topk_weights)`` with gradients for x, the
  routing weights and the six LoRA parameters (KT layout and names).
- :func:`expert_checkpoint_contexts` — ``context_fn`` for ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Optional

import torch

from kt_serve.formats.names import KT_TENSOR_NAMES, kt_shapes
from kt_serve.kernel.experts import ExpertLoRA, MoEExperts, check_dropout, check_seed


class _CheckpointPhase(threading.local):
    """Where the current forward runs with respect to gradient checkpointing (per thread: a recompute runs in
    the thread that runs the backward)."""

    phase: Optional[str] = None  # None (not checkpointed), "forward" (first forward) or "recompute"
    retain: bool = False


_PHASE = _CheckpointPhase()


@contextlib.contextmanager
def _checkpoint_phase(phase: str, retain: bool):
    saved = (_PHASE.phase, _PHASE.retain)
    _PHASE.phase, _PHASE.retain = phase, retain
    try:
        yield
    finally:
        _PHASE.phase, _PHASE.retain = saved


def expert_checkpoint_contexts(retain: bool):
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: tells the kernel's experts
    whether they run in a checkpointed layer's first forward or in its recompute.

    - ``retain=False`` (recompute): the first forward keeps no kernel state; the recompute, which the layer's
      backward triggers, runs the experts again with state saved, and the backward frees it. Expert activations
      of one layer at a time.
    - ``retain=True`` (KT's ``kt_cpu_activation: retain``): the first forward keeps the kernel state and its
      output; the recompute returns that output without running the experts again.
    """
    return _checkpoint_phase("forward", retain), _checkpoint_phase("recompute", retain)


class _ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, module, dropout, dropout_seed, *lora_params):
        ctx.module = module
        ctx.in_dtype = x.dtype
        # Inside Function.forward grad mode is off; needs_input_grad says whether a backward will come.
        wants_backward = any(ctx.needs_input_grad)
        phase, retain = _PHASE.phase, _PHASE.retain
        ctx.checkpointed = phase is not None and wants_backward
        if ctx.checkpointed:
            # A tensor saved through autograd: unpacking it in backward makes checkpointing recompute the layer
            # (and so this forward, with state saved) before the kernel's backward runs.
            ctx.save_for_backward(topk_weights)
            ctx.release = not retain
        if ctx.checkpointed and phase == "recompute" and retain:
            return module._retained_output.pop().clone()  # the kernel kept its state from the first forward
        xb = x.detach().to(torch.bfloat16).contiguous()
        ids = topk_ids.detach().contiguous()
        if ids.dtype not in (torch.int32, torch.int64):
            ids = ids.to(torch.int64)
        w = topk_weights.detach().to(torch.float32).contiguous()
        save = wants_backward and not (phase == "forward" and not retain)
        y = module._experts.forward_sft(
            xb, ids, w, save_for_backward=save, slots=0, dropout=dropout, dropout_seed=dropout_seed
        ).to(x.dtype)
        if ctx.checkpointed and phase == "forward" and retain:
            module._retained_output = [y.clone()]
        return y

    @staticmethod
    def backward(ctx, grad_y):
        m = ctx.module
        if ctx.checkpointed:
            ctx.saved_tensors  # noqa: B018 - triggers this layer's recompute first (see forward)
        for g in m._grad_buffers.tensors():
            g.zero_()
        gx, gw = m._experts.backward(grad_y.detach().to(torch.bfloat16).contiguous())
        if ctx.checkpointed and ctx.release:
            m._experts.release_saved()
        lora_grads = tuple(g.clone() for g in m._grad_buffers.tensors())
        return (gx.to(ctx.in_dtype), None, gw, None, None, None) + lora_grads


class MoELoRAExperts(torch.nn.Module):
    """Training module: frozen base experts in the kernel, trainable expert LoRA as fp32 parameters.

    ``y = experts(x, topk_ids, topk_weights)``; autograd gives gradients for x, topk_weights and the six
    ``*_lora_*`` parameters (KT layout and names). A is Kaiming-uniform(a=√5) on the ``[E·r, in]`` view and B zero,
    as KT initialises them.

    The frozen base is packed in ``weight_format`` (bf16, fp8, int8, int4; FP8 checkpoint tensors with their
    ``*_scale_inv`` as :class:`MoEExperts` takes them): gradients flow through the dequantized weights.

    ``packed``: the frozen base already packed (``MoEExperts.empty`` filled from a packed-weight cache) instead of the
    weight tensors.

    ``dropout`` is PEFT's ``lora_dropout`` on the expert LoRA inputs, applied in training mode only. Its masks
    come from ``dropout_seed`` (an int attribute, 0 initially): the trainer sets it before each forward (per
    micro-batch and layer), so a resumed run reproduces them.
    """

    def __init__(
        self,
        gate_proj: Optional[torch.Tensor] = None,
        up_proj: Optional[torch.Tensor] = None,
        down_proj: Optional[torch.Tensor] = None,
        *,
        gate_up_proj: Optional[torch.Tensor] = None,
        rank: int,
        alpha: float,
        max_tokens: int = 65536,
        isa: str = "auto",
        dropout: float = 0.0,
        weight_format: str = "bf16",
        group_size: int = 128,
        packed: Optional[MoEExperts] = None,
        **scales,
    ):
        super().__init__()
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        self.dropout = check_dropout(dropout)
        self.dropout_seed = 0
        # packed: the base already in the kernel (read from a packed-weight cache), one adapter slot
        self._experts = packed or MoEExperts(
            gate_proj, up_proj, down_proj, gate_up_proj=gate_up_proj, max_tokens=max_tokens, max_slots=1, isa=isa,
            weight_format=weight_format, group_size=group_size, **scales,
        )
        E, H, I = self._experts.num_experts, self._experts.hidden_size, self._experts.intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.rank, self.alpha = rank, float(alpha)
        shapes = kt_shapes(E, H, I, rank)
        for name, shape in shapes.items():
            p = torch.zeros(shape, dtype=torch.float32)
            if name.endswith("_a"):
                torch.nn.init.kaiming_uniform_(p.view(E * rank, shape[2]), a=math.sqrt(5))
            self.register_parameter(name, torch.nn.Parameter(p))
        self._grad_buffers = ExpertLoRA(*(torch.zeros(s, dtype=torch.float32) for s in shapes.values()), alpha=alpha)
        self._synced_version: Optional[tuple] = None

    def lora(self) -> ExpertLoRA:
        """The current LoRA as a bf16 :class:`ExpertLoRA` (for saving or serving)."""
        return ExpertLoRA(*(getattr(self, n).detach().to(torch.bfloat16) for n in KT_TENSOR_NAMES), alpha=self.alpha)

    def _sync(self) -> None:
        # The kernel holds bf16 copies of the LoRA; refresh them when a parameter changed (optimizer step).
        version = tuple((getattr(self, n)._version, getattr(self, n).data_ptr()) for n in KT_TENSOR_NAMES)
        if version != self._synced_version:
            self._experts.set_adapter(0, self.lora())
            self._experts.set_grad_buffers(0, self._grad_buffers)
            self._synced_version = version

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x must be [T, {self.hidden_size}], got {tuple(x.shape)}")
        self._sync()
        params = [getattr(self, n) for n in KT_TENSOR_NAMES]
        p = self.dropout if self.training else 0.0
        return _ExpertsFunction.apply(x, topk_ids, topk_weights, self, p, check_seed(self.dropout_seed), *params)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, rank={self.rank}, alpha={self.alpha}, "
                f"dropout={self.dropout}, isa={self._experts.isa}, weight_format={self._experts.weight_format}")
