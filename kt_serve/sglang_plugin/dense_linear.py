"""A CPU host's dense layers on the kt_serve kernel: SGLang's bf16 linear layers and lm_head through PackedLinear.

Without AMX, SGLang's CPU engine runs every unquantized linear (q/k/v/o, shared experts, the router, lm_head) as
``F.linear`` / ``torch.matmul``, whose bf16 GEMV reads weights at about half the bandwidth our kernel streams
experts at. After the model is loaded, each such layer's weight is packed once (:class:`kt_serve.dense.PackedLinear`)
and the layer's quant method runs it; SGLang's LoRA wrappers call that method for the base output and add their
LoRA on top, so adapters are unaffected. Hosts with AMX keep SGLang's own packed AMX kernel.

A packed layer's torch weight is then released (replaced by a zero-strided placeholder of the same shape and dtype,
so shape checks still pass and a write to it, e.g. a runtime weight update the packed copy would not see, fails
loudly) unless something reads it besides the quant method: the shared-expert gate (SGLang's fused CPU gate op
takes the weight), a weight tied to another module (embeddings), and lm_head with LoRA enabled (SGLang's LoRA
lm_head runs F.linear on the weight).

``--kt-cpu-ops auto|on|off`` (auto: with ``--kt-moe on``; cpu_norm.py is the other half).
"""

from __future__ import annotations

import collections
import logging

import torch

logger = logging.getLogger(__name__)

UNQUANTIZED_LINEAR = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod"
LOGITS_PROCESSOR = "sglang.srt.layers.logits_processor.LogitsProcessor"
_ATTR = "_kt_dense"  # the PackedLinear of a module


def _packable(module) -> bool:
    from sglang.srt.utils.common import use_intel_amx_backend

    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16 and not use_intel_amx_backend(module))


def _release(weight: torch.Tensor) -> None:
    weight.data = torch.zeros((), dtype=weight.dtype).expand(weight.shape)


def _router(name: str) -> bool:
    """A MoE router or shared-expert gate: kept in bf16 whatever --kt-dense-dtype says (its logits pick experts)."""
    return name.endswith(".gate") or name.endswith("shared_expert_gate")


def pack_model(model, enable_lora: bool = False, dense_dtype: str = "bf16", group_size: int = 128) -> int:
    """Packs every bf16 linear layer run by SGLang's unquantized (or our dequantized-FP8) method, and lm_head, and
    releases the torch weights nothing else reads. ``dense_dtype`` int8 / int4 quantizes the linear layers (not
    the routers nor lm_head) at packing. Returns the packed bytes."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    from kt_serve.dense import PackedLinear

    from .fp8_linear import DequantizedFp8LinearMethod

    owners = collections.Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    total, layers, released, by_format = 0, 0, 0, collections.Counter()
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        linear = isinstance(method, (UnquantizedLinearMethod, DequantizedFp8LinearMethod))
        lm_head = isinstance(module, ParallelLMHead)
        if not (linear or lm_head) or not _packable(module):
            continue
        bias = getattr(module, "bias", None) if linear else None
        fmt = dense_dtype if linear and not _router(name) else "bf16"
        packed = PackedLinear(module.weight.data, bias if isinstance(bias, torch.Tensor) else None,
                              weight_format=fmt, group_size=group_size)
        setattr(module, _ATTR, packed)
        total += packed.weight_bytes
        by_format[fmt] += 1
        layers += 1
        read_elsewhere = (name.endswith("shared_expert_gate") or owners[module.weight.data_ptr()] > 1
                          or (lm_head and enable_lora))
        if not read_elsewhere:
            released += module.weight.numel() * module.weight.element_size()
            _release(module.weight)
    if layers:
        formats = ", ".join(f"{n} {fmt}" for fmt, n in sorted(by_format.items()))
        logger.info("kt_serve: %d dense layers (linear and lm_head) on the kt_serve kernel (%s; %.1f MiB packed, "
                    "isa %s; %.1f MiB of torch weights released)", layers, formats, total / 2**20, packed.isa,
                    released / 2**20)
    return total


def run(layer, x: torch.Tensor, bias=None):
    """The layer's output through its PackedLinear, or None when it has none (or x is not a CPU bf16 tensor)."""
    packed = getattr(layer, _ATTR, None)
    if packed is None or x.device.type != "cpu" or x.dtype != torch.bfloat16:
        return None
    if bias is None or bias is getattr(layer, "bias", None):  # the layer's own bias is packed with it (fp32)
        return packed.forward(x, with_bias=bias is not None)
    return packed.forward(x, with_bias=False) + bias


def linear_apply(original, method, layer, x, bias=None):
    """AROUND UnquantizedLinearMethod.apply."""
    out = run(layer, x, bias)
    return original(method, layer, x, bias) if out is None else out


def compute_lm_head(original, processor, hidden_states, lm_head, embedding_bias=None, **kwargs):
    """AROUND LogitsProcessor._compute_lm_head: a packed lm_head (not LoRA-wrapped) gives the logits, in fp32
    where SGLang would compute them in fp32, else in the hidden states' dtype as its matmul does."""
    packed = getattr(lm_head, _ATTR, None)
    if (packed is None or hasattr(lm_head, "set_lora") or hidden_states.device.type != "cpu"
            or hidden_states.dtype != torch.bfloat16):
        return original(processor, hidden_states, lm_head, embedding_bias, **kwargs)
    fp32 = getattr(processor, "use_fp32_lm_head", False) or getattr(processor, "use_fp32_lm_head_output", False)
    logits = packed.forward(hidden_states, out_dtype=torch.float32 if fp32 else torch.bfloat16)
    if embedding_bias is not None:
        logits += embedding_bias
    return logits


def after_load_model(result, model_runner, *args, **kwargs):
    """AFTER ModelRunner.load_model (CPU host, --kt-cpu-ops on): pack the loaded model's dense layers."""
    from .config import get_config

    config = get_config()
    pack_model(model_runner.model, enable_lora=bool(getattr(model_runner.server_args, "enable_lora", False)),
               dense_dtype=config.dense_dtype, group_size=config.expert_group_size)
    return result
