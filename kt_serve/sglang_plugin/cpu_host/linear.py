"""A CPU host's dense layers on the kt_serve kernel: SGLang's bf16 linear layers and lm_head through PackedLinear
(kt_serve/kernel/linear.py), and FP8 block-quantized linears dequantized to bf16 at load.

Without AMX, SGLang's CPU engine runs every unquantized linear (q/k/v/o, shared experts, the router, lm_head) as
``F.linear`` / ``torch.matmul``, whose bf16 GEMV reads weights at about half the bandwidth our kernel streams
experts at. After the model is loaded, each such layer's weight is packed once
(:class:`kt_serve.kernel.linear.PackedLinear`) and the layer's quant method runs it; SGLang's LoRA wrappers call that
method for the base output and add their LoRA on top, so adapters are unaffected. Hosts with AMX keep SGLang's own
packed AMX kernel.

A packed layer's torch weight is then released (replaced by a zero-strided placeholder of the same shape and dtype,
so shape checks still pass and a write to it, e.g. a runtime weight update the packed copy would not see, fails
loudly) unless something reads it besides the quant method: the shared-expert gate (SGLang's fused CPU gate op
takes the weight), a weight tied to another module (embeddings), and lm_head with LoRA enabled (SGLang's LoRA
lm_head runs F.linear on the weight).

A plain decode batch's logits come straight from the packed lm_head (:func:`decode_logits`), past SGLang's logits
processor and its 0.3 ms a step of Python around the same product.

``--kt-cpu-ops auto|on|off`` (auto: with ``--kt-moe on``; norm.py is the other half).

SGLang 0.5.23 runs FP8 linears on a CPU only with AMX and sgl_kernel's ``fp8_scaled_mm_cpu`` ("Fp8LinearMethod on
CPU requires that CPU has AMX support"). The layers it covers there (attention, shared experts) are a small share
of an MoE checkpoint's bytes, so on a CPU host their weights are dequantized (W = w · scale_inv per block) when
loaded and served as bf16 linears (:class:`DequantizedFp8LinearMethod`, packed like the others), which the log says
once. Routed experts are not affected: they stay FP8 (or what ``--kt-expert-dtype`` asks) in the kernel.
"""

from __future__ import annotations

import collections
import logging

import torch
import torch.nn.functional as F
from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod

from kt_serve.kernel.weights import dequantize_fp8_to

from ..config import get_config
from ..log import log_once

logger = logging.getLogger(__name__)
_PACKED = "_kt_dense"  # the PackedLinear of a module


def packed_of(module):
    """The PackedLinear of a linear layer, or None (SGLang's LoRA wrapper has none: its base_layer may)."""
    return getattr(module, _PACKED, None)


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


def pack_model(model, enable_lora: bool = False, dense_dtype: str = "bf16", group_size: int = 128,
               lm_head_dtype: str = "bf16") -> int:
    """Packs every bf16 linear layer run by SGLang's unquantized (or our dequantized-FP8) method, and lm_head, and
    releases the torch weights nothing else reads. ``dense_dtype`` int8 / int4 quantizes the linear layers (not
    the routers), ``lm_head_dtype`` lm_head, at packing. Returns the packed bytes."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    from kt_serve.kernel.linear import PackedLinear

    owners = collections.Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    total, layers, released, by_format = 0, 0, 0, collections.Counter()
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        linear = isinstance(method, (UnquantizedLinearMethod, DequantizedFp8LinearMethod))
        lm_head = isinstance(module, ParallelLMHead)
        if not (linear or lm_head) or not _packable(module):
            continue
        bias = getattr(module, "bias", None) if linear else None
        fmt = lm_head_dtype if lm_head else dense_dtype if not _router(name) else "bf16"
        packed = PackedLinear(module.weight.data, bias if isinstance(bias, torch.Tensor) else None,
                              weight_format=fmt, group_size=group_size)
        setattr(module, _PACKED, packed)
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
    packed = packed_of(layer)
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
    packed = packed_of(lm_head)
    if (packed is None or hasattr(lm_head, "set_lora") or hidden_states.device.type != "cpu"
            or hidden_states.dtype != torch.bfloat16):
        return original(processor, hidden_states, lm_head, embedding_bias, **kwargs)
    logits = _packed_logits(processor, hidden_states, packed)
    if embedding_bias is not None:
        logits += embedding_bias
    return logits


def _packed_logits(processor, hidden_states, packed):
    fp32 = getattr(processor, "use_fp32_lm_head", False) or getattr(processor, "use_fp32_lm_head_output", False)
    return packed.forward(hidden_states, out_dtype=torch.float32 if fp32 else torch.bfloat16)


def _plain_decode_logits(processor, forward_batch, hidden_states, lm_head, aux_hidden_states,
                         hidden_states_before_norm) -> bool:
    """Whether LogitsProcessor.forward would do no more for this batch than lm_head (next-token logits only)."""
    from sglang.srt.layers import layernorm_sp, logits_processor
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    capture = getattr(forward_batch, "capture_hidden_mode", None)
    return (isinstance(forward_batch, ForwardBatch) and forward_batch.forward_mode.is_decode()
            and getattr(logits_processor, "_autotune_run_lm_head", None) is not False
            and aux_hidden_states is None and hidden_states_before_norm is None
            and (capture is None or not capture.need_capture())
            and getattr(forward_batch, "spec_info", None) is None
            and getattr(forward_batch, "next_token_logits_buffer", None) is None
            and getattr(forward_batch, "multi_item_delimiter_indices", None) is None
            and getattr(forward_batch, "token_indices_to_pool", None) is None
            and processor.logit_scale is None and not processor.final_logit_softcapping
            and not processor.do_tensor_parallel_all_gather and not processor.do_tensor_parallel_all_gather_dp_attn
            and getattr(processor, "expected_aux_hidden_states", None) is None
            and not layernorm_sp.runs_sp(forward_batch.forward_mode)
            and packed_of(lm_head) is not None and not hasattr(lm_head, "set_lora")
            and isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 2
            and hidden_states.dtype == torch.bfloat16 and hidden_states.device.type == "cpu")


def decode_logits(original, processor, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None,
                  hidden_states_before_norm=None):
    """AROUND LogitsProcessor.forward: a plain CPU decode batch's next-token logits straight from the packed lm_head.
    SGLang's forward would build a LogitsMetadata, prune, gather and copy around the same product (0.3 ms a step of
    Python, evals/profile_decode.py --timers); decode logprobs come from the sampler either way."""
    if not _plain_decode_logits(processor, logits_metadata, hidden_states, lm_head, aux_hidden_states,
                                hidden_states_before_norm):
        return original(processor, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states,
                        hidden_states_before_norm)
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    log_once(logger, "decode logits straight from the packed lm_head (SGLang's logits processor skipped)")
    logits = _packed_logits(processor, hidden_states, packed_of(lm_head))
    if logits.shape[-1] > processor.vocab_size:  # a padded lm_head, cut and made fp32 as _copy_logits_to_buffer does
        logits = logits[:, :processor.vocab_size]
    return LogitsProcessorOutput(next_token_logits=logits.float(),
                                 mm_input_embeds=getattr(logits_metadata, "mm_input_embeds", None))


def refuse_lora_on_quantized_lm_head(result, manager, *args, **kwargs):
    """AFTER LoRAManager.init_lora_modules: where SGLang wrapped lm_head for LoRA (its target modules, from the flag or
    the start-up adapters, name it), its LoRA layer runs lm_head in bf16: a quantized lm_head is refused at start."""
    lm_head_dtype = get_config().lm_head_dtype
    if lm_head_dtype != "bf16" and getattr(manager, "lm_head_module", None) is not None:
        raise ValueError(f"--kt-lm-head-dtype {lm_head_dtype}: the LoRA target modules include lm_head, whose LoRA "
                         "layer SGLang runs in bf16; serve adapters without lm_head LoRA or drop the flag")
    return result


def after_load_model(result, model_runner, *args, **kwargs):
    """AFTER ModelRunner.load_model (CPU host, --kt-cpu-ops on): pack the loaded model's dense layers."""
    config = get_config()
    pack_model(model_runner.model, enable_lora=bool(getattr(model_runner.server_args, "enable_lora", False)),
               dense_dtype=config.dense_dtype, group_size=config.expert_group_size, lm_head_dtype=config.lm_head_dtype)
    return result


# -- FP8 block-quantized linears ---------------------------------------------------------------------------
class DequantizedFp8LinearMethod(Fp8LinearMethod):
    """Registers the checkpoint's FP8 weight and block scales like Fp8LinearMethod, keeps bf16 after loading."""

    def __init__(self, quant_config):  # Fp8LinearMethod.__init__ picks GPU GEMM backends: not wanted here
        self.quant_config = quant_config
        self.use_mxfp8 = False
        self.block_quant = True
        self.weight_block_size = quant_config.weight_block_size
        self.is_checkpoint_fp8_serialized = True

    def process_weights_after_loading(self, layer) -> None:
        if not hasattr(layer, "weight_scale_inv"):
            return  # already dequantized (see dequantize_before_deepseek_post_load)
        dtype = getattr(layer, "orig_dtype", None) or torch.bfloat16
        weight = dequantize_fp8_to(layer.weight.data, layer.weight_scale_inv.data, self.weight_block_size, dtype)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        del layer.weight_scale_inv

    def apply(self, layer, x: torch.Tensor, bias=None) -> torch.Tensor:
        out = run(layer, x, bias)  # packed by the plugin's dense path (--kt-cpu-ops)
        return F.linear(x, layer.weight, bias) if out is None else out


def dequantize_before_deepseek_post_load(*args, **kwargs):
    """BEFORE DeepseekV2WeightLoaderMixin.post_load_weights on a CPU host: dequantize our FP8 linears now.

    DeepSeek's post_load_weights (inside load_weights, before the loader's process_weights_after_loading) splits
    kv_b_proj into MLA's absorbed w_kc / w_vc; seeing FP8 there on a CPU it requantizes the block-scaled weight to
    one per-tensor FP8 scale (block_quant_to_tensor_quant), a second rounding of every block but the largest.
    Dequantized to bf16 first, w_kc / w_vc are the checkpoint's weights exactly as on CUDA (block_quant_dequant).
    """
    model = args[0] if args else kwargs.get("self")
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), DequantizedFp8LinearMethod):
            module.quant_method.process_weights_after_loading(module)
    return None


def register_weight_loader_v2() -> None:
    """SGLang's linears pick their weight loader by the quant method's class *name* (WEIGHT_LOADER_V2_SUPPORTED):
    only the v2 loaders place a merged linear's block scales (qkv, gate_up) at block offsets, so ours is listed."""
    from sglang.srt.layers import linear

    if DequantizedFp8LinearMethod.__name__ not in linear.WEIGHT_LOADER_V2_SUPPORTED:
        linear.WEIGHT_LOADER_V2_SUPPORTED.append(DequantizedFp8LinearMethod.__name__)


def fp8_linear_method_cpu(original, quant_config, layer, prefix, *args, **kwargs):
    """AROUND Fp8Config.get_quant_method on a CPU host: block-quantized FP8 linears dequantized to bf16."""
    method = original(quant_config, layer, prefix, *args, **kwargs)
    if type(method) is not Fp8LinearMethod:
        return method
    if not (quant_config.is_checkpoint_fp8_serialized and quant_config.weight_block_size):
        raise ValueError(f"kt_serve: {prefix}: FP8 without block scales (weight_block_size) is not served on a CPU "
                         "host; use a block-quantized FP8 checkpoint or a bf16 one")
    if getattr(quant_config, "use_mxfp8", False):
        raise ValueError(f"kt_serve: {prefix}: MXFP8 checkpoints are not served on a CPU host")
    log_once(logger, "FP8 dense linears (attention, shared experts) are dequantized to bf16 at load on this CPU host "
             "(SGLang's FP8 linears need AMX); routed experts stay in the kernel")
    return DequantizedFp8LinearMethod(quant_config)
