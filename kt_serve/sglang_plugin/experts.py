"""Routed experts of SGLang's ``FusedMoE`` on the kt_serve kernel: a quant method that SGLang's layer calls.

``FusedMoE.forward_impl`` runs dispatch -> ``quant_method.apply`` -> combine -> TP all-reduce, so only the expert
math is replaced; router, top-k (grouped top-k, bias), shared experts and attention stay SGLang's. ``apply``
returns ``sum_k w_k * expert_k(x)`` like SGLang's own CPU path; models apply ``routed_scaling_factor`` after it.

Memory: the checkpoint's expert tensors land in CPU staging buffers (never on the GPU); as soon as a layer has all
of its experts, they are packed into the kernel and the staging buffers are released, so the peak stays near the
packed size plus one layer. Tensor parallel: TP rank 0 holds the full experts and computes every token once; the
other ranks return zeros and SGLang's all-reduce sums the two.
"""

from __future__ import annotations

import logging
import threading

import torch

from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from . import batch
from .config import get_config

logger = logging.getLogger(__name__)

_registry = None
_registry_lock = threading.Lock()


def get_registry():
    """This process's ExpertAdapterRegistry (created on first MoE layer, with the global adapter if any)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            from kt_serve.kernel import set_num_threads

            from .adapters import ExpertAdapterRegistry

            config = get_config()
            if config.threads > 0:
                set_num_threads(config.threads)
            registry = ExpertAdapterRegistry(config.max_expert_loras)
            if config.expert_lora_path and _is_compute_rank():
                registry.load_global(config.expert_lora_path)
            _registry = registry
        return _registry


def _is_compute_rank() -> bool:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_rank == 0


class KTRoutedExpertsMethod(FusedMoEMethodBase):
    """FusedMoE quant method whose experts live in ``kt_serve.kernel.MoEExperts`` (CPU), in the format of
    ``--kt-expert-dtype``. ``fp8_block``: the checkpoint's experts are FP8 with [rows, cols] scale blocks."""

    runner = None

    def __init__(self, fp8_block=None):
        super().__init__()
        self.experts = None          # kt_serve.kernel.MoEExperts once packed (TP rank 0 only)
        self.compute_rank = _is_compute_rank()
        self.fp8_block = fp8_block
        self._loaded: set[tuple[int, str, bool]] = set()

    @property
    def weight_format(self) -> str:
        fmt = get_config().expert_dtype
        return ("fp8" if self.fp8_block else "bf16") if fmt == "auto" else fmt

    # -- weights -------------------------------------------------------------------------------------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        if layer.moe_runner_config.activation != "silu" or not layer.moe_runner_config.is_gated:
            raise ValueError(f"kt_serve: MoE layer {layer.layer_id} uses activation "
                             f"{layer.moe_runner_config.activation!r}; the kernel implements gated SiLU only")
        if layer.moe_runner_config.apply_router_weight_on_input:
            raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: apply_router_weight_on_input is unsupported")
        if extra_weight_attrs.get("with_bias"):
            raise ValueError(f"kt_serve: MoE layer {layer.layer_id} has expert biases; the kernel has none")
        # full (unsharded) intermediate size: this rank computes every token's experts completely
        full_i = extra_weight_attrs.get("moe_intermediate_size") or intermediate_size_per_partition * layer.moe_tp_size
        self.shape = (num_experts, hidden_size, full_i)
        E, H, I = self.shape if self.compute_rank else (0, 0, 0)
        # CPU staging; untouched pages of torch.empty cost no memory, so only the layer being loaded is resident
        dtype = torch.float8_e4m3fn if self.fp8_block else torch.bfloat16
        staging = {"w13_weight": (E, 2 * I, H), "w2_weight": (E, H, I)}
        if self.fp8_block:
            bn, bk = self.fp8_block
            if I % bn:
                raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: intermediate size {I} is not a multiple of "
                                 f"the FP8 block rows {bn}")
            if self.weight_format == "fp8" and bk % 64:
                raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: FP8 blocks [{bn}, {bk}]: the kernel keeps "
                                 "FP8 experts as stored only for K blocks that are a multiple of 64; pass "
                                 "--kt-expert-dtype int8, int4 or bf16 to requantize them at load")
            staging.update({"w13_weight_scale_inv": (E, 2 * I // bn, -(-H // bk)),
                            "w2_weight_scale_inv": (E, -(-H // bn), -(-I // bk))})
        for name, shape in staging.items():
            t = torch.empty(shape, dtype=torch.float32 if "scale" in name else dtype, device="cpu")
            param = torch.nn.Parameter(t, requires_grad=False)
            param.weight_loader = self._weight_loader(layer)
            layer.register_parameter(name, param)

    def _weight_loader(self, layer):
        def load(param, loaded_weight, weight_name=None, shard_id=None, expert_id=None, *args, **kwargs):
            if not self.compute_rank:
                return
            if expert_id is None or shard_id not in ("w1", "w2", "w3"):
                raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: unsupported expert weight {weight_name} "
                                 f"(shard {shard_id}, expert {expert_id}); per-expert checkpoints only")
            E = self.shape[0]
            expert_id = int(expert_id)
            if not 0 <= expert_id < E:
                raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: checkpoint expert {expert_id} is outside "
                                 f"the layer's {E} experts")
            scale = param is getattr(layer, "w13_weight_scale_inv", None) or param is getattr(layer, "w2_weight_scale_inv", None)
            target = param.data[expert_id]
            if shard_id != "w2":  # gate rows first, then up, in w13 and in its scales
                half = target.shape[0] // 2
                target = target[:half] if shard_id == "w1" else target[half:]
            if tuple(target.shape) != tuple(loaded_weight.shape):
                raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: {weight_name} has shape "
                                 f"{tuple(loaded_weight.shape)}, expected {tuple(target.shape)}")
            target.copy_(loaded_weight)
            self._loaded.add((expert_id, shard_id, scale))
            if len(self._loaded) == 3 * E * (2 if self.fp8_block else 1):
                self._pack(layer)

        return load

    def _pack(self, layer) -> None:
        from kt_serve.kernel import MoEExperts

        registry = get_registry()
        config = get_config()
        kwargs = {}
        if self.fp8_block:
            kwargs = dict(gate_up_scale_inv=layer.w13_weight_scale_inv.data, down_scale_inv=layer.w2_weight_scale_inv.data,
                          weight_block_size=self.fp8_block)
        self.experts = MoEExperts(gate_up_proj=layer.w13_weight.data, down_proj=layer.w2_weight.data,
                                  max_slots=config.max_expert_loras, weight_format=self.weight_format,
                                  group_size=config.expert_group_size, **kwargs)
        # the kernel holds its own packed copy now: release SGLang's
        for name in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
            if hasattr(layer, name):
                getattr(layer, name).data = torch.empty(0)
        self._loaded.clear()
        registry.add_layer(layer.layer_id, self.experts)
        logger.info("kt_serve: packed MoE layer %d (E=%d, H=%d, I=%d) into the kernel: %s experts from a %s "
                    "checkpoint, %.1f MiB (isa %s)", layer.layer_id, *self.shape, self.experts.weight_format,
                    "fp8" if self.fp8_block else "bf16", self.experts.weight_bytes / 2**20, self.experts.isa)

    def process_weights_after_loading(self, layer) -> None:
        if self.compute_rank and self.experts is None:
            E = self.shape[0]
            want = 3 * E * (2 if self.fp8_block else 1)
            raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: checkpoint gave {len(self._loaded)} of "
                             f"{want} expert tensors" + (" (weights and weight_scale_inv)" if self.fp8_block else ""))

    # -- runner --------------------------------------------------------------------------------------------
    def create_moe_runner(self, layer, moe_runner_config) -> None:
        self.moe_runner_config = moe_runner_config

    def get_moe_runner_backend(self, layer):
        return None

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        topk_output = dispatch_output.topk_output
        if TopKOutputChecker.format_is_bypassed(topk_output):
            topk_output = topk_output.to_standard()
        x = dispatch_output.hidden_states
        if not self.compute_rank:
            return StandardCombineInput(hidden_states=torch.zeros_like(x))
        topk_weights, topk_ids = topk_output.topk_weights, topk_output.topk_ids
        slots = batch.slots_for(x.shape[0], get_registry().default_slot)
        if x.device.type == "cpu":
            out = self._forward_cpu(x, topk_ids, topk_weights, slots)
        else:
            out = self._forward_offload(x, topk_ids, topk_weights, slots)
        return StandardCombineInput(hidden_states=out)

    def _forward_cpu(self, x, topk_ids, topk_weights, slots):
        y = self.experts.forward_sft(x.to(torch.bfloat16).contiguous(), topk_ids.contiguous(),
                                     topk_weights.float().contiguous(), save_for_backward=False, slots=slots)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _forward_offload(self, x, topk_ids, topk_weights, slots):
        """Accelerator host: attention stays on the device, the routed experts run in the CPU kernel.

        Activations and routing go device -> host into pinned buffers (non_blocking, so the three copies overlap);
        only the current stream is waited for, once: where SGLang runs the shared expert on its side stream
        (alt_stream in qwen2_moe / deepseek_v2), that overlaps the kernel. The kernel writes into a pinned output
        whose copy back is non_blocking too. torch's pinned-memory cache makes the buffers free after the first
        calls and keeps each one until its copies are done, so none is reused under a copy in flight.
        Also runs, without pinning or waiting, for tensors already on the CPU (how the tests drive it).
        """
        device = x.device
        pin = device.type != "cpu"

        def to_host(t, dtype):
            host = torch.empty(t.shape, dtype=dtype, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            return host

        x_cpu = to_host(x, torch.bfloat16)
        ids_cpu = to_host(topk_ids, topk_ids.dtype)
        w_cpu = to_host(topk_weights, torch.float32)
        if pin:
            torch.cuda.current_stream(device).synchronize()
        y = torch.empty(x_cpu.shape, dtype=torch.bfloat16, pin_memory=pin)
        self.experts.forward_sft(x_cpu, ids_cpu, w_cpu, save_for_backward=False, slots=slots, out=y)
        return y.to(device, dtype=x.dtype, non_blocking=pin)
