"""FP8 block-quantized dense linears on a CPU host: dequantized to bf16 once at load.

SGLang 0.5.23 runs FP8 linears on a CPU only with AMX and sgl_kernel's ``fp8_scaled_mm_cpu`` ("Fp8LinearMethod on
CPU requires that CPU has AMX support"). The layers it covers there (attention, shared experts) are a small share
of an MoE checkpoint's bytes, so on a CPU host their weights are dequantized (W = w · scale_inv per block) when
loaded and served as bf16 linears, which the log says once. Routed experts are not affected: they stay FP8 (or
what ``--kt-expert-dtype`` asks) in the kernel.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod

logger = logging.getLogger(__name__)
_logged = False


class DequantizedFp8LinearMethod(Fp8LinearMethod):
    """Registers the checkpoint's FP8 weight and block scales like Fp8LinearMethod, keeps bf16 after loading."""

    def __init__(self, quant_config):  # Fp8LinearMethod.__init__ picks GPU GEMM backends: not wanted here
        self.quant_config = quant_config
        self.use_mxfp8 = False
        self.block_quant = True
        self.weight_block_size = quant_config.weight_block_size
        self.is_checkpoint_fp8_serialized = True

    def process_weights_after_loading(self, layer) -> None:
        from kt_serve.kernel_weights import dequantize_fp8

        if not hasattr(layer, "weight_scale_inv"):
            return  # already dequantized (see dequantize_before_deepseek_post_load)
        dtype = getattr(layer, "orig_dtype", None) or torch.bfloat16
        weight = dequantize_fp8(layer.weight.data, layer.weight_scale_inv.data, self.weight_block_size).to(dtype)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        del layer.weight_scale_inv

    def apply(self, layer, x: torch.Tensor, bias=None) -> torch.Tensor:
        from .dense_linear import run

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
    global _logged
    method = original(quant_config, layer, prefix, *args, **kwargs)
    if type(method) is not Fp8LinearMethod:
        return method
    if not (quant_config.is_checkpoint_fp8_serialized and quant_config.weight_block_size):
        raise ValueError(f"kt_serve: {prefix}: FP8 without block scales (weight_block_size) is not served on a CPU "
                         "host; use a block-quantized FP8 checkpoint or a bf16 one")
    if getattr(quant_config, "use_mxfp8", False):
        raise ValueError(f"kt_serve: {prefix}: MXFP8 checkpoints are not served on a CPU host")
    if not _logged:
        logger.info("kt_serve: FP8 dense linears (attention, shared experts) are dequantized to bf16 at load on "
                    "this CPU host (SGLang's FP8 linears need AMX); routed experts stay in the kernel")
        _logged = True
    return DequantizedFp8LinearMethod(quant_config)
