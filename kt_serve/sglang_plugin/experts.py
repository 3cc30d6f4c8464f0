"""Routed experts of SGLang's ``FusedMoE`` on the kt_serve kernel: a quant method that SGLang's layer calls.

``FusedMoE.forward_impl`` runs dispatch -> ``quant_method.apply`` -> combine -> TP all-reduce, so only the expert
math is replaced; router, top-k (grouped top-k, bias), shared experts and attention stay SGLang's. ``apply``
returns ``sum_k w_k * expert_k(x)``, times ``routed_scaling_factor`` where the model leaves that to the MoE runner
(CUDA; accelerator.py decides, after load).

Memory: the checkpoint's expert tensors land in CPU staging buffers (never on the GPU); as soon as a layer has all
of its experts, they are packed into the kernel and the staging buffers are released, so the peak stays near the
packed size plus one layer. Tensor parallel (``--tp-size N``): each rank holds and computes its 1/N slice of every
expert's intermediate dimension (gate / up rows, down columns; the expert adapters sliced to match, adapters/
expert_pool.py), and SGLang's all-reduce sums the ranks' partial outputs, as for its own MoE path.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading

import torch

from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from kt_serve.kernel.weights import fp8_blocks_kept

from . import accelerator, checkpoint
from .adapters.registry import get_registry
from .config import get_config, local_model_config

logger = logging.getLogger(__name__)


@functools.cache
def _size_kernel_pool() -> None:
    """Once per process, before the first layer packs: --kt-threads, else the kernel's default (physical cores).
    Where SGLang's CPU engine gives this rank other cores than this thread may use (TP ranks, NUMA nodes, SMT
    siblings, or its AMX setup narrowing this thread to one core), the kernel's workers are pinned to the rank's cores, one each:
    the ranks compute their expert slices at once, and each rank's experts are placed in its node's memory by the
    threads that pack or read them (first touch)."""
    import os

    from .cpu_host.compat import rank_cpus

    threads, cpus = get_config().threads, rank_cpus() or []
    allowed = os.sched_getaffinity(0)
    if set(cpus) == allowed:  # the rank's cores are exactly this thread's: nothing to pin
        cpus = []
    elif cpus and not allowed <= set(cpus):  # this thread runs the pool's task 0 too: on the rank's cores
        os.sched_setaffinity(0, cpus)
    if threads > 0 or cpus:
        from kt_serve.kernel.threads import set_num_threads

        set_num_threads(threads, cpus)
        logger.info("kt_serve: kernel pool of %d threads%s", threads or len(cpus),
                    f" pinned to CPUs {cpus}" if cpus else "")


class KTRoutedExpertsMethod(FusedMoEMethodBase):
    """FusedMoE quant method whose experts live in ``kt_serve.kernel.experts.MoEExperts`` (CPU), in the format of
    ``--kt-expert-dtype``. ``fp8_block``: the checkpoint's experts are FP8 with [rows, cols] scale blocks."""

    runner = None

    def __init__(self, fp8_block=None):
        super().__init__()
        self.adapters = get_registry()
        self.experts = None          # kt_serve.kernel.experts.MoEExperts once packed
        self.shard = (0, 1)          # (TP rank, ranks): this rank's slice of each expert's intermediate dimension
        self.emulated_accelerator = accelerator.emulated()  # CPU tensors through the accelerator host's path
        self.routed_scale = 1.0  # what the model leaves to the MoE runner (set_routed_scales, after load)
        self.fp8_block = fp8_block
        self._loaded: set[tuple[int, str, bool]] = set()
        self._loaded_lock = threading.Lock()  # DeepSeek's loader fills one layer from several threads
        self.cache = None  # (file, LayerKey) of this layer in the packed-weight cache, where there is one

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
        self.shard = (int(layer.moe_tp_rank), int(layer.moe_tp_size))
        ranks = self.shard[1]
        full_i = checkpoint_moe_intermediate_size() or intermediate_size_per_partition * ranks
        if full_i % ranks:
            raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: intermediate size {full_i} does not split over "
                             f"--tp-size {ranks} ranks")
        self.shape = (num_experts, hidden_size, full_i // ranks)  # this rank's slice
        E, H, I = self.shape
        # CPU staging; untouched pages of torch.empty cost no memory, so only the layer being loaded is resident
        dtype = torch.float8_e4m3fn if self.fp8_block else torch.bfloat16
        staging = {"w13_weight": (E, 2 * I, H), "w2_weight": (E, H, I)}
        if self.fp8_block:
            bn, bk = self.fp8_block
            if ranks > 1 and (I % bn or I % bk):  # a rank's slice must hold whole scale blocks
                raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: intermediate size {full_i} over --tp-size "
                                 f"{ranks} is {I} a rank, not a multiple of the FP8 blocks {list(self.fp8_block)}; "
                                 "serve it with a --tp-size that splits it into whole blocks")
            if self.weight_format == "fp8" and not fp8_blocks_kept(bk):
                raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: FP8 blocks [{bn}, {bk}]: the kernel keeps "
                                 "FP8 experts as stored only for K blocks that are a multiple of 64; pass "
                                 "--kt-expert-dtype int8, int4 or bf16 to requantize them at load")
            staging.update({"w13_weight_scale_inv": (E, 2 * -(-I // bn), -(-H // bk)),  # gate's rows, then up's
                            "w2_weight_scale_inv": (E, -(-H // bn), -(-I // bk))})
        for name, shape in staging.items():
            t = torch.empty(shape, dtype=torch.float32 if "scale" in name else dtype, device="cpu")
            param = torch.nn.Parameter(t, requires_grad=False)
            param.weight_loader = self._weight_loader(layer)
            layer.register_parameter(name, param)
        self._read_cache(layer)

    # -- the packed-weight cache (kernel/weight_cache.py; checkpoint.py keys it and skips the cached tensors) -------
    def _read_cache(self, layer) -> None:
        model_dir = served_model_dir()
        if model_dir is None:
            return
        self.cache = checkpoint.layer_cache(model_dir, layer.layer_id, dict(
            weight_format=self.weight_format, group_size=get_config().expert_group_size, shard=self.shard,
            shape=self.shape))
        if self.cache is None:
            return
        from kt_serve.kernel import weight_cache

        _size_kernel_pool()
        try:  # the header here; the regions in the background, while SGLang reads the rest of the checkpoint
            layer_read = weight_cache.open_layer(*self.cache, max_slots=self.adapters.experts.budget.kernel_slots)
        except weight_cache.CacheMiss as miss:
            if self.cache[0].exists():
                logger.warning("kt_serve: packed-weight cache: MoE layer %d packed from the checkpoint again: %s",
                               layer.layer_id, miss)
            return
        origin = f"read from the packed-weight cache {self.cache[0].parent}"
        checkpoint.CACHE_READS.add(model_dir, layer.layer_id, layer_read,
                                   lambda experts: self._install(layer, experts, origin))

    def _weight_loader(self, layer):
        def load(param, loaded_weight, weight_name=None, shard_id=None, expert_id=None, *args, **kwargs):
            if expert_id is None or shard_id not in ("w1", "w2", "w3"):
                raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: unsupported expert weight {weight_name} "
                                 f"(shard {shard_id}, expert {expert_id}); per-expert checkpoints only")
            E = self.shape[0]
            expert_id = int(expert_id)
            if not 0 <= expert_id < E:
                raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: checkpoint expert {expert_id} is outside "
                                 f"the layer's {E} experts")
            if self.experts is not None:  # read from the cache (staging released): a loader that gives its tensors
                return
            scale = param is getattr(layer, "w13_weight_scale_inv", None) or param is getattr(layer, "w2_weight_scale_inv", None)
            target = param.data[expert_id]
            if shard_id != "w2":  # gate rows first, then up, in w13 and in its scales
                half = target.shape[0] // 2
                target = target[:half] if shard_id == "w1" else target[half:]
            loaded_weight = self._rank_slice(loaded_weight, 0 if shard_id != "w2" else 1, target.shape)
            if tuple(target.shape) != tuple(loaded_weight.shape):
                raise ValueError(f"kt_serve: MoE layer {layer.layer_id}: {weight_name} has shape "
                                 f"{tuple(loaded_weight.shape)}, expected {tuple(target.shape)}")
            target.copy_(loaded_weight)
            with self._loaded_lock:  # the tensor completing the layer packs it, once, whichever thread brings it
                self._loaded.add((expert_id, shard_id, scale))
                if len(self._loaded) == 3 * E * (2 if self.fp8_block else 1):
                    with checkpoint.IN_FLIGHT.packing(layer.layer_id):
                        self._pack(layer)

        return load

    def _rank_slice(self, loaded_weight, dim: int, want):
        """This rank's slice of a checkpoint expert tensor (or of its FP8 scales) along the intermediate dimension
        ``dim`` (w1 / w3 rows, w2 columns), when it holds every rank's."""
        rank, ranks = self.shard
        if ranks == 1 or loaded_weight.shape[dim] != want[dim] * ranks:
            return loaded_weight
        return loaded_weight.narrow(dim, rank * want[dim], want[dim])

    def _pack(self, layer) -> None:
        from kt_serve.kernel.experts import MoEExperts

        _size_kernel_pool()
        config = get_config()
        w13, I = layer.w13_weight.data, self.shape[2]
        weights = {"gate_up_proj": w13}
        if self.fp8_block:
            s13, bn = layer.w13_weight_scale_inv.data, self.fp8_block[0]
            weights.update(gate_up_scale_inv=s13, down_scale_inv=layer.w2_weight_scale_inv.data,
                           weight_block_size=self.fp8_block)
            if I % bn:  # a partial edge block of scale rows: gate's and up's scale grids passed apart
                rows = -(-I // bn)
                del weights["gate_up_proj"], weights["gate_up_scale_inv"]
                weights.update(gate_proj=w13[:, :I].contiguous(), up_proj=w13[:, I:].contiguous(),
                               gate_scale_inv=s13[:, :rows].contiguous(), up_scale_inv=s13[:, rows:].contiguous())
        experts = MoEExperts(down_proj=layer.w2_weight.data, **weights,
                             max_slots=self.adapters.experts.budget.kernel_slots,
                             weight_format=self.weight_format, group_size=config.expert_group_size)
        self._loaded.clear()
        self._install(layer, experts, f"packed from a {'fp8' if self.fp8_block else 'bf16'} checkpoint")
        if self.cache is not None:
            checkpoint.CACHE_WRITER.store(layer.layer_id, experts, *self.cache)

    def _install(self, layer, experts, origin: str) -> None:
        self.experts = experts
        # the kernel holds its own packed copy now: release SGLang's staging
        for name in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
            if hasattr(layer, name):
                getattr(layer, name).data = torch.empty(0)
        self.adapters.experts.add_layer(layer.layer_id, experts)
        rank, ranks = self.shard
        logger.info("kt_serve: MoE layer %d (E=%d, H=%d, I=%d%s) in the kernel: %s experts %s, %.2f MiB (isa %s)",
                    layer.layer_id, *self.shape, f": TP rank {rank}'s 1/{ranks}" if ranks > 1 else "",
                    experts.weight_format, origin, experts.weight_bytes / 2**20, experts.isa)

    def process_weights_after_loading(self, layer) -> None:
        if self.experts is None and self.cache is not None:  # a loader that bypassed the checkpoint reader
            checkpoint.CACHE_READS.finish(served_model_dir())
        if self.experts is None:
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
        topk_weights, topk_ids = topk_output.topk_weights, topk_output.topk_ids
        if self.routed_scale != 1.0:  # folded into the fp32 weights: exact, and no pass over the output
            topk_weights = topk_weights.float() * self.routed_scale
        slots = self.adapters.slots_for(x.shape[0])
        if x.device.type == "cpu" and not self.emulated_accelerator:
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
        Also runs, without pinning or waiting, for tensors already on the CPU (the accelerator emulation).
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


# -- hooks (hooks.py registers them) --------------------------------------------------------------------------
def keep_shared_experts_separate(context, server_args, *args, role=None, **kwargs):
    """AFTER runtime_context.publish in a scheduler: no shared-expert fusion into the routed FusedMoE.

    SGLang can fuse DeepSeek / Qwen2-MoE shared experts into FusedMoE as extra experts (by default for DeepSeek-V3
    on CUDA). The kernel would then hold them as routed experts that expert adapters do not cover, and SGLang's LoRA
    manager would lose its shared_experts target; kept separate, they run as SGLang's dense MLP (on the GPU).
    """
    if role != "scheduler":
        return context
    if server_args.enforce_shared_experts_fusion:
        raise ValueError("--enforce-shared-experts-fusion: the kt_serve kernel runs routed experts only and keeps "
                         "shared experts in SGLang's MLP; drop the flag or pass --kt-moe off")
    context.override("kt_serve", disable_shared_experts_fusion=True)
    return context


_fused_moe_signature = None


def fused_moe_init(*args, **kwargs):
    """BEFORE FusedMoE.__init__: give bf16 and FP8 MoE layers our quant method (routed experts in the kernel)."""
    global _fused_moe_signature
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    if _fused_moe_signature is None:
        _fused_moe_signature = inspect.signature(getattr(FusedMoE.__init__, "__wrapped__", FusedMoE.__init__))
    bound = _fused_moe_signature.bind(*args, **kwargs)
    layer = bound.arguments["self"]
    if getattr(layer, "is_shared_fused_moe", False):
        return None
    if bound.arguments.get("quant_method") is not None:
        raise ValueError("kt_serve: this MoE layer comes with its own quant method; the kt_serve kernel takes bf16 "
                         "and FP8 block-quantized experts; pass --kt-moe off to use SGLang's own MoE path")
    fp8_block = checkpoint_fp8_block(bound.arguments.get("quant_config"), bound.arguments.get("prefix", ""))
    kwargs["quant_method"] = KTRoutedExpertsMethod(fp8_block)
    return args, kwargs


def served_model_dir() -> str | None:
    """The served checkpoint's path, or None outside a server (the method built on its own)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        return get_server_args().model_path
    except ValueError:
        return None


@functools.cache
def checkpoint_moe_intermediate_size() -> int | None:
    """The routed experts' intermediate size as the served checkpoint stores it (None: not a local checkpoint, or no
    such field). SGLang's CPU engine pads its config's to a multiple of the TP size times the FP8 block
    (configs/update_config.py adjust_config_with_unaligned_cpu_tp) and loads into padded buffers; the kernel holds
    the checkpoint's own size, so no padded rows are computed and expert adapters keep their shapes."""
    from sglang.srt.runtime_context import get_server_args

    config = local_model_config(get_server_args().model_path) or {}
    value = (config.get("text_config") or config).get("moe_intermediate_size")
    return value if isinstance(value, int) and value > 0 else None


def checkpoint_fp8_block(quant_config, prefix: str):
    """The [rows, cols] of the FP8 scale blocks of this MoE layer's checkpoint experts, or None for bf16 experts.
    Refuses, naming the format and the flags to use, a checkpoint quantization the kernel does not read."""
    if quant_config is None:
        return None
    name = quant_config.get_name()
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    if isinstance(quant_config, Fp8Config):
        from sglang.srt.layers.quantization.utils import is_layer_skipped

        if is_layer_skipped(prefix, quant_config.ignored_layers, fused_mapping=quant_config.packed_modules_mapping):
            return None  # listed under modules_to_not_convert: bf16 experts
        if (quant_config.is_checkpoint_fp8_serialized and quant_config.weight_block_size
                and not getattr(quant_config, "use_mxfp8", False)):
            return tuple(int(v) for v in quant_config.weight_block_size)
        name = "fp8 without block scales" if quant_config.is_checkpoint_fp8_serialized else "fp8 (online)"
    raise ValueError(f"kt_serve: MoE checkpoint quantization '{name}' is not read by the kt_serve kernel (it reads "
                     "bf16 and FP8 block-quantized experts); serve a bf16 or FP8 checkpoint, with "
                     "--kt-expert-dtype int8 or int4 to quantize it at load, or pass --kt-moe off")


def set_routed_scales(result, model_runner, *args, **kwargs):
    """AFTER ModelRunner.load_model: the routed_scaling_factor each MoE layer's method owes (accelerator.py), once
    the emulation (if on) has switched the model files to their accelerator branches."""
    if accelerator.emulated():
        accelerator.emulate_after_load()
        logger.warning("kt_serve: %s=1: serving through the accelerator host's code (experts through the offload "
                       "path, the model files' accelerator switches on) on CPU tensors", accelerator.EMULATION_ENV)
    scaled = {}
    for block in model_runner.model.modules():
        layer = getattr(block, "experts", None)
        method = getattr(layer, "quant_method", None)
        if isinstance(method, KTRoutedExpertsMethod):
            method.routed_scale = accelerator.routed_scale(block, layer)
            if method.routed_scale != 1.0:
                scaled.setdefault(method.routed_scale, []).append(layer.layer_id)
    checkpoint.CACHE_WRITER.wait()
    if checkpoint.IN_FLIGHT.peak:
        logger.info("kt_serve: checkpoint read with at most %d MoE layers staged at once", checkpoint.IN_FLIGHT.peak)
    for scale, layers in scaled.items():
        logger.info("kt_serve: routed_scaling_factor %g applied by the kernel's MoE method in %d layers (the model "
                    "leaves it to the MoE runner on this host)", scale, len(layers))
    return result


def check_global_adapter(result, model_runner, *args, **kwargs):
    """AFTER ModelRunner.load_model: refuse --kt-expert-lora-path on a model without MoE layers, or naming layers
    that are not MoE layers; size an auto expert-adapter budget from the memory available now and log it."""
    config = get_config()
    import psutil

    pool = get_registry().experts
    if config.expert_lora_path and not pool.layers:
        raise ValueError(f"--kt-expert-lora-path {config.expert_lora_path}: model "
                         f"{model_runner.model_config.model_path} has no MoE layers with routed experts")
    pool.finish_load(psutil.virtual_memory().available // pool.shard[1])  # the TP ranks share this host's memory
    return result
