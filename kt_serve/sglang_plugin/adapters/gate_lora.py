"""Per-request LoRA on the gating projections SGLang 0.5.23's LoRA manager has no layer for: the MoE router
(``mlp.gate``), the shared-expert gate (``mlp.shared_expert_gate``) and Qwen3.5's GDN beta / decay gates
(``linear_attn.in_proj_ba``, PEFT's ``in_proj_b`` | ``in_proj_a``) — what ``lora_target: all`` trains besides the
modules SGLang wraps.

With ``--enable-lora`` every such module's forward is wrapped at model load: its output gets s · (x Aᵀ) Bᵀ for the
tokens of each request whose adapter trained it (fp32 in between, one rounding into the output), the tokens read
from the batch's adapter ids (batch.py). The projections are small (outputs: the experts, 1, 2 × the GDN heads), so
a few torch matmuls per module suffice. Adapters are held here by SGLang's lora_id, loaded and unloaded with the
rest of the composite adapter, all-or-nothing (registry.py owns this and hands it the batch).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from .split import AdapterError

logger = logging.getLogger(__name__)

_TARGET_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(mlp\.gate|mlp\.shared_expert_gate|linear_attn\.in_proj_ba)$")


class GateLoRAError(AdapterError):
    pass


@dataclass
class GateTarget:
    """One wrapped module: the rows of each of its output parts that this rank holds."""

    name: str                              # full module path, for messages
    in_features: int
    part_rows: tuple[tuple[int, int], ...]  # per part: (first row of this rank's shard, rows on this rank)
    tp_size: int = 1                       # ranks the parts are split over
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.bfloat16    # SGLang's LoRA pool holds A and B in the model dtype; so do we
    unsupported: str | None = None         # why LoRA cannot apply here


@dataclass
class GateWeights:
    A: torch.Tensor                        # [r, in] fp32 (the ranks of all trained parts, stacked)
    B: torch.Tensor                        # [rows on this rank, r] fp32, times the scaling; zero off its parts


class GateLoRA:
    """``current_batch()``: the AdapterBatch of the forward in flight, or None (its owner, registry.py, keeps it)."""

    def __init__(self, current_batch):
        self.current_batch = current_batch
        self.targets: dict[tuple[int, str], GateTarget] = {}      # (layer, module in the layer) -> target
        self.adapters: dict[object, dict[tuple[int, str], GateWeights]] = {}  # lora_id -> its weights
        self.refusal: str | None = None    # why this server cannot take gate LoRA at all
        self.by_weight: dict[int, tuple[int, str]] = {}  # shared-expert gate weight's data_ptr -> its key

    # -- model load ---------------------------------------------------------------------------------------------
    def attach(self, model, server_args) -> None:
        from ..accelerator import graphs_fully_off

        if not graphs_fully_off(server_args):
            self.refusal = ("runs outside CUDA graphs, and this server captures them; start it with "
                            "--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled to serve "
                            "such adapters")
        for name, module in model.named_modules():
            match = _TARGET_RE.search(name)
            weight = getattr(module, "weight", None)
            if match is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                continue
            key = (int(match.group(1)), match.group(2))
            self.targets[key] = _describe(name, module)
            _wrap_forward(module, self, key)
            if key[1] == "mlp.shared_expert_gate":
                self.by_weight[weight.data_ptr()] = key
        logger.info("kt_serve: gate LoRA (router, shared-expert gate, GDN in_proj_ba) can apply to %d modules",
                    len(self.targets))

    # -- adapters -----------------------------------------------------------------------------------------------
    def load(self, lora_id, path: str, gates: dict, scaling: float) -> None:
        """gates: (layer, PEFT leaf) -> {"A": [r, in], "B": [out, r]} (formats.sglang_modules.split_gate_modules).
        The parts of one module (in_proj_b, in_proj_a) each keep their own A: their ranks are stacked."""
        from kt_serve.formats.sglang_modules import GATE_MODULES

        if not gates:
            return
        if self.refusal is not None:
            layer, leaf = next(iter(gates))
            raise GateLoRAError(f"{path}: LoRA on layer {layer} {leaf}: the plugin's gate LoRA {self.refusal}")
        parts: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for (layer, leaf), pair in sorted(gates.items()):
            gate = GATE_MODULES[leaf]
            target = self.targets.get((layer, gate.module))
            where = f"{path}: LoRA on layer {layer} {leaf}"
            if target is None:
                raise GateLoRAError(f"{where}: the model has no {gate.module} in decoder layer {layer}")
            if target.unsupported:
                raise GateLoRAError(f"{where}: {target.unsupported}")
            A, B = (pair[side].to(target.dtype).float() for side in "AB")
            first, rows = target.part_rows[gate.part]
            full_rows = rows * target.tp_size
            if A.dim() != 2 or A.shape[1] != target.in_features or B.dim() != 2 or B.shape != (full_rows, A.shape[0]):
                raise GateLoRAError(f"{where}: lora_A {list(A.shape)} / lora_B {list(B.shape)}, the model's "
                                    f"{target.name} expects [r, {target.in_features}] / [{full_rows}, r]")
            parts.setdefault((layer, gate.module), []).append((gate.part, A, B[first: first + rows]))
        weights = {}
        for key, held in parts.items():
            row_offsets = [0]
            for _, n in self.targets[key].part_rows:
                row_offsets.append(row_offsets[-1] + n)
            B = torch.zeros(row_offsets[-1], sum(A.shape[0] for _, A, _ in held))
            col = 0
            for part, A, B_part in held:
                B[row_offsets[part]: row_offsets[part + 1], col: col + A.shape[0]] = B_part
                col += A.shape[0]
            device = self.targets[key].device
            weights[key] = GateWeights(torch.cat([A for _, A, _ in held]).to(device), (B * scaling).to(device))
        self.adapters[lora_id] = weights

    def unload(self, lora_id) -> None:
        self.adapters.pop(lora_id, None)

    # -- forward ------------------------------------------------------------------------------------------------
    def add_delta_by_weight(self, weight: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
        """add_delta for the module whose weight this is (fused ops that take a weight, not the module)."""
        key = self.by_weight.get(weight.data_ptr())
        if key is not None:
            self.add_delta(key, x, out)

    def add_delta(self, key, x: torch.Tensor, out: torch.Tensor) -> None:
        info = self.current_batch()
        if info is None or not self.adapters:
            return
        if info.num_tokens != x.shape[0]:
            raise RuntimeError(f"kt_serve: gate LoRA on {self.targets[key].name} got {x.shape[0]} tokens but the "
                               f"LoRA batch has {info.num_tokens}")
        for lora_id, tokens in info.adapter_tokens():
            w = self.adapters.get(lora_id, {}).get(key)
            if w is None:
                continue
            if isinstance(tokens, torch.Tensor) and tokens.device != x.device:
                tokens = tokens.to(x.device)
            delta = (x[tokens].float() @ w.A.T) @ w.B.T
            out[tokens] = (out[tokens].float() + delta).to(out.dtype)


def _describe(name: str, module) -> GateTarget:
    """Rows per output part held by this rank: in_proj_ba is column-parallel (b | a, each split over TP ranks);
    the router and the shared-expert gate are replicated."""
    # SGLang's AMX path repacks weights, so the sizes come from the module where it has them
    in_features = _first(module, ("input_size", "in_features")) or module.weight.shape[1]
    sizes = getattr(module, "output_partition_sizes", None)
    if sizes is not None and len(sizes) > 1:
        rank, tp_size = _tp_rank_size(module)
        target = GateTarget(name, in_features, tuple((rank * n, n) for n in sizes), tp_size)
    else:
        rows = _first(module, ("output_size", "out_features")) or module.weight.shape[0]
        target = GateTarget(name, in_features, ((0, rows),))
    target.device = module.weight.device
    target.dtype = module.weight.dtype if module.weight.dtype.is_floating_point else torch.bfloat16
    if name.endswith("shared_expert_gate"):
        # SGLang's fused gate ops take the weight: on CPU hosts the plugin's ops add the LoRA (cpu_host/moe_block), not
        # SGLang's AMX kernel nor its GPU kernels
        if getattr(module, "use_intel_amx_backend", False):
            target.unsupported = "SGLang's AMX kernel reads this shared-expert gate's weight directly"
        elif module.weight.device.type != "cpu":
            target.unsupported = "SGLang's fused GPU kernel reads this shared-expert gate's weight directly"
    return target


def _tp_rank_size(module) -> tuple[int, int]:
    group = getattr(module, "tp_group", None)
    if group is None:
        return 0, 1
    from sglang.srt.layers.linear import get_group_rank_size

    return get_group_rank_size(group)


def _first(module, names):
    return next((getattr(module, n) for n in names if isinstance(getattr(module, n, None), int)), None)


def _wrap_forward(module, gate_lora: GateLoRA, key) -> None:
    """Replace the instance's forward; the module (its weights, its attributes) stays as SGLang built it."""
    original = module.forward

    def forward(x, *args, **kwargs):
        result = original(x, *args, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        gate_lora.add_delta(key, x, out)
        return result

    module.forward = forward
    module._kt_gate_lora = True


def wraps(module) -> bool:
    """Whether gate LoRA wraps this module's forward (a fused kernel reading its weight would skip the LoRA)."""
    return getattr(module, "_kt_gate_lora", False)
