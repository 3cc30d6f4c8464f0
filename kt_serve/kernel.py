"""Python side of the C++ MoE-LoRA kernel (``kt_serve._kernel``).

Routed SwiGLU experts with per-expert LoRA on gate, up and down (s = alpha / r)::

    g = x Wgᵀ + s (x Agᵀ) Bgᵀ     u = x Wuᵀ + s (x Auᵀ) Buᵀ     h = silu(g) u
    y = h Wdᵀ + s (h Adᵀ) Bdᵀ     out[t] = Σ_k w[t, k] y_k

Tensors cross into C++ as raw addresses, so this module checks every dtype, shape and layout first and raises
``ValueError`` naming the argument; the extension never sees a tensor it could misread.

- :class:`MoEExperts` — one MoE layer: packed base weights, a table of adapter slots, ``forward_sft`` /
  ``backward``. Serving calls ``forward_sft(..., save_for_backward=False)``, which keeps no state.
- :class:`MoELoRAExperts` — ``nn.Module`` for training: ``y = experts(x, topk_ids, topk_weights)`` with gradients
  for x, the routing weights and the six LoRA parameters.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch

from kt_serve import _kernel

__all__ = ["ExpertLoRA", "MoEExperts", "MoELoRAExperts", "set_num_threads", "num_threads", "cpu_isa"]

LORA_FIELDS = ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")
# KT fused-file names of the six tensors, in LORA_FIELDS order.
KT_NAMES = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")


def set_num_threads(n: int) -> None:
    """Size of the kernel's worker pool, the calling thread included (default: physical cores)."""
    _kernel.set_num_threads(int(n))


def num_threads() -> int:
    return _kernel.num_threads()


def cpu_isa() -> str:
    """The kernel table this CPU gets: ``avx512_bf16`` or ``portable`` (``KT_SERVE_ISA=portable`` forces it)."""
    return _kernel.cpu_isa()


@dataclass
class ExpertLoRA:
    """One expert adapter of one MoE layer, in the KT layout (A ``[E, r, in]``, B ``[E, out, r]``)."""

    gate_a: torch.Tensor  # [E, r, H]
    gate_b: torch.Tensor  # [E, I, r]
    up_a: torch.Tensor  # [E, r, H]
    up_b: torch.Tensor  # [E, I, r]
    down_a: torch.Tensor  # [E, r, I]
    down_b: torch.Tensor  # [E, H, r]
    alpha: float

    @property
    def rank(self) -> int:
        return int(self.gate_a.shape[1])

    @property
    def scaling(self) -> float:
        return float(self.alpha) / self.rank

    @classmethod
    def from_kt(cls, tensors: Mapping[str, torch.Tensor], alpha: float) -> "ExpertLoRA":
        """From the KT fused names (``gate_lora_a`` …) of one layer."""
        missing = [n for n in KT_NAMES if n not in tensors]
        if missing:
            raise ValueError(f"expert LoRA: missing tensors {missing} (expected {list(KT_NAMES)})")
        return cls(*(tensors[n] for n in KT_NAMES), alpha=float(alpha))

    def to_kt(self) -> dict:
        return {n: getattr(self, f) for n, f in zip(KT_NAMES, LORA_FIELDS)}

    def tensors(self) -> tuple:
        return tuple(getattr(self, f) for f in LORA_FIELDS)

    def check(self, E: int, H: int, I: int, what: str = "expert LoRA") -> int:
        """Checks the six shapes against (E, H, I) and one rank; returns the rank."""
        r = self.rank
        expected = {
            "gate_a": (E, r, H), "gate_b": (E, I, r), "up_a": (E, r, H),
            "up_b": (E, I, r), "down_a": (E, r, I), "down_b": (E, H, r),
        }
        for name, shape in expected.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{what}: {name} has shape {tuple(t.shape)}, expected {shape} "
                    f"(E={E}, H={H}, I={I}, rank={r} from gate_a; all projections must share one rank)"
                )
        if r < 1:
            raise ValueError(f"{what}: rank must be >= 1")
        if not math.isfinite(float(self.alpha)):
            raise ValueError(f"{what}: alpha must be finite, got {self.alpha}")
        return r


def _as_bf16(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    return t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()


def _expect(t: torch.Tensor, name: str, dtypes: tuple, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


class MoEExperts:
    """Routed experts of one MoE layer on the CPU kernel, with up to ``max_slots`` expert adapters at once.

    Base weights (any float dtype, converted to bf16) are ``gate_proj``/``up_proj`` ``[E, I, H]`` and
    ``down_proj`` ``[E, H, I]``, or a fused ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first). They are packed
    into the kernel's layout at construction; the caller may free its tensors afterwards.
    """

    def __init__(
        self,
        gate_proj: Optional[torch.Tensor] = None,
        up_proj: Optional[torch.Tensor] = None,
        down_proj: Optional[torch.Tensor] = None,
        *,
        gate_up_proj: Optional[torch.Tensor] = None,
        max_tokens: int = 65536,
        max_slots: int = 64,
        isa: str = "auto",
    ):
        if down_proj is None:
            raise ValueError("down_proj [E, H, I] is required")
        down = _as_bf16(down_proj, "down_proj")
        if down.dim() != 3:
            raise ValueError(f"down_proj must be 3-D [E, H, I], got shape {tuple(down.shape)}")
        E, H, I = down.shape
        if gate_up_proj is not None:
            if gate_proj is not None or up_proj is not None:
                raise ValueError("pass either gate_up_proj or gate_proj + up_proj, not both")
            gate_up = _as_bf16(gate_up_proj, "gate_up_proj")
            if tuple(gate_up.shape) != (E, 2 * I, H):
                raise ValueError(f"gate_up_proj has shape {tuple(gate_up.shape)}, expected {(E, 2 * I, H)} from down_proj")
            keep = (gate_up, down)
            gate_ptr, up_ptr, gu_stride = gate_up.data_ptr(), gate_up.data_ptr() + I * H * 2, 2 * I * H
            strides = (gu_stride, gu_stride)
        else:
            if gate_proj is None or up_proj is None:
                raise ValueError("gate_proj and up_proj [E, I, H] are required (or a fused gate_up_proj)")
            gate, up = _as_bf16(gate_proj, "gate_proj"), _as_bf16(up_proj, "up_proj")
            for name, t in (("gate_proj", gate), ("up_proj", up)):
                if tuple(t.shape) != (E, I, H):
                    raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {(E, I, H)} from down_proj")
            keep = (gate, up, down)
            gate_ptr, up_ptr, strides = gate.data_ptr(), up.data_ptr(), (I * H, I * H)
        if max_tokens < 1 or max_slots < 1:
            raise ValueError("max_tokens and max_slots must be >= 1")
        self._k = _kernel.MoELoRA(
            E, H, I, gate_ptr, strides[0], up_ptr, strides[1], down.data_ptr(), H * I,
            int(max_tokens), int(max_slots), isa,
        )
        del keep  # packed copies live in the kernel now
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.max_tokens, self.max_slots = int(max_tokens), int(max_slots)
        self._adapters: dict = {}  # slot -> ExpertLoRA (bf16 copies, kept for introspection)
        self._grads: dict = {}  # slot -> ExpertLoRA of fp32 buffers (kept alive while registered)
        self._lock = threading.Lock()
        self._saved_T: Optional[int] = None
        self._saved_k: Optional[int] = None

    @property
    def isa(self) -> str:
        return self._k.isa

    def _check_slot(self, slot: int) -> int:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.max_slots:
            raise ValueError(f"slot must be an int in 0..{self.max_slots - 1}, got {slot!r}")
        return slot

    def set_adapter(self, slot: int, lora: ExpertLoRA) -> None:
        """Loads (or replaces) the adapter in ``slot``; calls in flight on other slots are not disturbed."""
        self._check_slot(slot)
        r = lora.check(self.num_experts, self.hidden_size, self.intermediate_size)
        t = [_as_bf16(x, f"lora.{f}") for x, f in zip(lora.tensors(), LORA_FIELDS)]
        self._k.set_adapter(slot, r, float(lora.alpha), *(x.data_ptr() for x in t))
        with self._lock:
            self._adapters[slot] = ExpertLoRA(*t, alpha=float(lora.alpha))

    def remove_adapter(self, slot: int) -> None:
        self._check_slot(slot)
        self._k.remove_adapter(slot)
        with self._lock:
            self._adapters.pop(slot, None)

    def has_adapter(self, slot: int) -> bool:
        return self._k.has_adapter(self._check_slot(slot))

    def set_grad_buffers(self, slot: int, grads: ExpertLoRA) -> None:
        """Registers fp32 gradient buffers for ``slot`` (KT layout); ``backward`` accumulates into them."""
        self._check_slot(slot)
        with self._lock:
            lora = self._adapters.get(slot)
        if lora is None:
            raise ValueError(f"slot {slot}: load an adapter before registering its gradient buffers")
        for f in LORA_FIELDS:
            _expect(getattr(grads, f), f"grads.{f}", (torch.float32,), tuple(getattr(lora, f).shape))
        self._k.set_grad_buffers(slot, *(t.data_ptr() for t in grads.tensors()))
        with self._lock:
            self._grads[slot] = grads

    def _slots_arg(self, slots, T: int) -> tuple:
        """(per-token slots address or 0, the slot every token uses when that address is 0)."""
        if slots is None:
            return 0, -1
        if isinstance(slots, int) and not isinstance(slots, bool):
            if slots != -1:
                self._check_slot(slots)
            return 0, slots
        _expect(slots, "slots", (torch.int32,), (T,))
        return slots.data_ptr(), -1

    def forward_sft(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        save_for_backward: bool = False,
        slots: Union[None, int, torch.Tensor] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``out[t] = Σ_k w[t,k] · expert_{ids[t,k]}(x[t])`` with the LoRA of ``slots[t]`` (-1: base only).

        x bf16 ``[T, H]``; topk_ids int32/int64 ``[T, k]`` (ids < 0 or >= E are skipped); topk_weights fp32
        ``[T, k]``; slots None, one int for every token, or int32 ``[T]``. Returns ``out`` (bf16 ``[T, H]``):
        a new tensor, or the one given (e.g. pinned memory, for a copy to an accelerator).
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"x must be a 2-D tensor [T, H], got {getattr(x, 'shape', type(x).__name__)}")
        T = int(x.shape[0])
        _expect(x, "x", (torch.bfloat16,), (T, self.hidden_size))
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
            raise ValueError(f"topk_ids must be a 2-D tensor [T, k], got {getattr(topk_ids, 'shape', None)}")
        k = int(topk_ids.shape[1])
        _expect(topk_ids, "topk_ids", (torch.int32, torch.int64), (T, k))
        _expect(topk_weights, "topk_weights", (torch.float32,), (T, k))
        if k < 1:
            raise ValueError("topk_ids must have at least one column")
        if T > self.max_tokens:
            raise ValueError(f"x has T={T} tokens, more than max_tokens={self.max_tokens} of this MoEExperts")
        slots_ptr, uniform_slot = self._slots_arg(slots, T)
        if out is None:
            out = torch.empty((T, self.hidden_size), dtype=torch.bfloat16)
        else:
            _expect(out, "out", (torch.bfloat16,), (T, self.hidden_size))
        if T == 0:
            if save_for_backward:
                self._saved_T, self._saved_k = 0, k
            return out
        self._k.forward(
            T, k, x.data_ptr(), topk_ids.data_ptr(), topk_ids.dtype == torch.int64, topk_weights.data_ptr(),
            slots_ptr, uniform_slot, out.data_ptr(), bool(save_for_backward),
        )
        if save_for_backward:
            self._saved_T, self._saved_k = T, k
        return out

    def backward(self, grad_out: torch.Tensor) -> tuple:
        """Gradients of the last ``forward_sft(save_for_backward=True)``: ``(grad_x bf16 [T,H], grad_topk_weights
        fp32 [T,k])``. The LoRA gradients are accumulated into the buffers of :meth:`set_grad_buffers`."""
        if self._saved_T is None:
            raise ValueError("backward() needs a preceding forward_sft(..., save_for_backward=True)")
        T, k = self._saved_T, self._saved_k
        _expect(grad_out, "grad_out", (torch.bfloat16,), (T, self.hidden_size))
        grad_x = torch.empty((T, self.hidden_size), dtype=torch.bfloat16)
        grad_w = torch.empty((T, k), dtype=torch.float32)
        self._saved_T = None
        if T > 0:
            self._k.backward(grad_out.data_ptr(), grad_x.data_ptr(), grad_w.data_ptr())
        return grad_x, grad_w


class _ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, module, *lora_params):
        ctx.module = module
        ctx.in_dtype = x.dtype
        xb = x.detach().to(torch.bfloat16).contiguous()
        ids = topk_ids.detach().contiguous()
        if ids.dtype not in (torch.int32, torch.int64):
            ids = ids.to(torch.int64)
        w = topk_weights.detach().to(torch.float32).contiguous()
        # Inside Function.forward grad mode is off; needs_input_grad says whether a backward will come.
        y = module._experts.forward_sft(xb, ids, w, save_for_backward=any(ctx.needs_input_grad), slots=0)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        m = ctx.module
        for g in m._grad_buffers.tensors():
            g.zero_()
        gx, gw = m._experts.backward(grad_y.detach().to(torch.bfloat16).contiguous())
        lora_grads = tuple(g.clone() for g in m._grad_buffers.tensors())
        return (gx.to(ctx.in_dtype), None, gw, None) + lora_grads


class MoELoRAExperts(torch.nn.Module):
    """Training module: frozen base experts in the kernel, trainable expert LoRA as fp32 parameters.

    ``y = experts(x, topk_ids, topk_weights)``; autograd gives gradients for x, topk_weights and the six
    ``*_lora_*`` parameters (KT layout and names). A is Kaiming-uniform(a=√5) on the ``[E·r, in]`` view and B zero,
    as KT initialises them.
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
    ):
        super().__init__()
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        self._experts = MoEExperts(
            gate_proj, up_proj, down_proj, gate_up_proj=gate_up_proj, max_tokens=max_tokens, max_slots=1, isa=isa
        )
        E, H, I = self._experts.num_experts, self._experts.hidden_size, self._experts.intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.rank, self.alpha = rank, float(alpha)
        shapes = {
            "gate_lora_a": (E, rank, H), "gate_lora_b": (E, I, rank), "up_lora_a": (E, rank, H),
            "up_lora_b": (E, I, rank), "down_lora_a": (E, rank, I), "down_lora_b": (E, H, rank),
        }
        for name, shape in shapes.items():
            p = torch.zeros(shape, dtype=torch.float32)
            if name.endswith("_a"):
                torch.nn.init.kaiming_uniform_(p.view(E * rank, shape[2]), a=math.sqrt(5))
            self.register_parameter(name, torch.nn.Parameter(p))
        self._grad_buffers = ExpertLoRA(*(torch.zeros(s, dtype=torch.float32) for s in shapes.values()), alpha=alpha)
        self._synced_version: Optional[tuple] = None

    def lora(self) -> ExpertLoRA:
        """The current LoRA as a bf16 :class:`ExpertLoRA` (for saving or serving)."""
        return ExpertLoRA(*(getattr(self, n).detach().to(torch.bfloat16) for n in KT_NAMES), alpha=self.alpha)

    def _sync(self) -> None:
        # The kernel holds bf16 copies of the LoRA; refresh them when a parameter changed (optimizer step).
        version = tuple((getattr(self, n)._version, getattr(self, n).data_ptr()) for n in KT_NAMES)
        if version != self._synced_version:
            self._experts.set_adapter(0, self.lora())
            self._experts.set_grad_buffers(0, self._grad_buffers)
            self._synced_version = version

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x must be [T, {self.hidden_size}], got {tuple(x.shape)}")
        self._sync()
        params = [getattr(self, n) for n in KT_NAMES]
        return _ExpertsFunction.apply(x, topk_ids, topk_weights, self, *params)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, rank={self.rank}, alpha={self.alpha}, "
                f"isa={self._experts.isa}")
