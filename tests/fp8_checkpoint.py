"""Writes an FP8 block-quantized checkpoint (the DeepSeek-V3 / Qwen3-FP8 layout) from a tiny bf16 one, and the fp32
checkpoint of the same dequantized weights for the HF reference.

Every linear weight of attention, routed experts and shared experts becomes ``weight`` float8_e4m3fn [out, in] with
``weight_scale_inv`` fp32 [ceil(out/128), ceil(in/128)], W = w · scale_inv per block (edge blocks partial where a
dimension is not a multiple of 128); embeddings, norms, the router gate and lm_head stay bf16 and are listed in
``modules_to_not_convert`` the way Qwen's FP8 releases list them. The dequantization here is written out in plain
torch (transformers splits a partial scale grid evenly, so it is not a reference for such dims).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

BLOCK = (128, 128)
FP8_MAX = 448.0
# the linears that FP8 releases quantize: attention projections, routed and shared experts
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
             "gate_proj", "up_proj", "down_proj")


def is_quantized(key: str) -> bool:
    parts = key.split(".")
    return key.endswith(".weight") and len(parts) >= 2 and parts[-2] in QUANTIZED


def quantize_block_fp8(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)]): per block s = amax / 448 (1 for an all-zero block),
    q = e4m3(W / s)."""
    bn, bk = block
    w = w.float()
    N, K = w.shape
    nb, kb = -(-N // bn), -(-K // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:N, :K] = w
    blocks = padded.view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:N, :K]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """fp32 W[i, j] = q[i, j] · scale_inv[i // bn, j // bk]."""
    bn, bk = block
    N, K = q.shape
    rows = torch.arange(N) // bn
    cols = torch.arange(K) // bk
    return q.float() * scale_inv[rows[:, None], cols[None, :]]


def not_converted(keys) -> list[str]:
    """Module names kept in bf16, as Qwen's FP8 configs list them (lm_head, embeddings, norms, router gates)."""
    return sorted({k.rsplit(".", 1)[0] for k in keys if not is_quantized(k)})


def write_fp8_checkpoint(bf16_dir, fp8_dir, reference_dir, block=BLOCK) -> tuple[Path, Path]:
    """From ``bf16_dir`` write ``fp8_dir`` (FP8 block-quantized, config with quantization_config) and
    ``reference_dir`` (fp32, the FP8 checkpoint's dequantized weights, no quantization_config); returns both."""
    from safetensors.torch import load_file, save_file

    bf16_dir, fp8_dir, reference_dir = Path(bf16_dir), Path(fp8_dir), Path(reference_dir)
    for out in (fp8_dir, reference_dir):
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(bf16_dir, out)
        (out / "model.safetensors").unlink()
    state = load_file(bf16_dir / "model.safetensors")
    fp8, ref = {}, {}
    for key, value in state.items():
        if is_quantized(key):
            q, s = quantize_block_fp8(value, block)
            fp8[key], fp8[key.removesuffix("weight") + "weight_scale_inv"] = q, s
            ref[key] = dequantize_block_fp8(q, s, block)
        else:
            fp8[key], ref[key] = value, value.float()
    save_file(fp8, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(ref, reference_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((bf16_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block),
                                     "modules_to_not_convert": not_converted(state)}
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    config.pop("quantization_config")
    config["dtype"] = "float32"
    (reference_dir / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_dir, reference_dir
