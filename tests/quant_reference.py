"""Independent torch references of the kernel's quantization rules (csrc/weights/packed_weights.cpp's top comment), on
fp32 ``[..., N, K]`` tensors: each returns the dequantized weights. Divisions in fp32 as in the kernel; torch.round
rounds half to even like nearbyint. Shared by the kernel, serving and training tests."""

from __future__ import annotations

import shutil

import torch

FP8 = torch.float8_e4m3fn


def ref_int8(w):
    """Per output row: s = amax / 127 (1 where 0), q = clamp(round(W / s), -127, 127)."""
    amax = w.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(w / s).clamp(-127, 127) * s


def ref_int4(w, group):
    """Asymmetric per row and K group (the last one partial): lo = min, s = (max - lo) / 15 (1 where flat), both
    stored as bf16 (nearest even), q = clamp(round((W - lo16) / s16), 0, 15), W ≈ q · s16 + lo16 rounded once (the
    kernel's fused multiply-add): in float64 q · s16 is exact and so is the sum (lo16 and q · s16 are of like
    magnitude), so the one rounding is the cast to fp32."""
    out = torch.empty_like(w)
    for k0 in range(0, w.shape[-1], group):  # groups start at multiples of `group`; the K padding is not in them
        seg = w[..., k0 : k0 + group]
        lo, hi = seg.amin(-1, keepdim=True), seg.amax(-1, keepdim=True)
        s = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo)).bfloat16().float()
        lo = lo.bfloat16().float()
        q = torch.round((seg - lo) / s).clamp(0, 15)
        out[..., k0 : k0 + group] = (q.double() * s.double() + lo.double()).float()
    return out


def ref_fp8(w, group):
    """From a float source, per 64 rows × K group: s = amax / 448 (1 where 0), q = e4m3(W / s), nearest even."""
    out = torch.empty_like(w)
    N, K = w.shape[-2:]
    for n0 in range(0, N, 64):  # the kernel's 64-row blocks
        for k0 in range(0, K, group):
            blk = w[..., n0 : n0 + 64, k0 : k0 + group]
            amax = blk.abs().amax(dim=(-2, -1), keepdim=True)
            s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
            out[..., n0 : n0 + 64, k0 : k0 + group] = (blk / s).clamp(-448, 448).to(FP8).float() * s
    return out


def ref_quantize(w, fmt, group=128):
    if fmt == "bf16":
        return w.to(torch.bfloat16).float()
    return {"int8": lambda: ref_int8(w), "int4": lambda: ref_int4(w, group), "fp8": lambda: ref_fp8(w, group)}[fmt]()


def write_expert_quantized_reference(model_dir, out_dir, fmt: str, group: int = 128, dense_fmt: str = "bf16",
                                     lm_head_fmt: str = "bf16"):
    """fp32 copy of checkpoint ``model_dir`` whose routed expert weights are their ``fmt`` dequantized values, its
    attention projections their ``dense_fmt`` ones (--kt-dense-dtype) and lm_head its ``lm_head_fmt`` ones
    (--kt-lm-head-dtype)."""
    from safetensors.torch import load_file, save_file

    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(model_dir, out_dir)
    state = load_file(out_dir / "model.safetensors")
    def quantized(k, v):
        if k.endswith("_proj.weight") and ".mlp.experts." in k:
            return ref_quantize(v.float(), fmt, group)
        if k.endswith("_proj.weight") and ".self_attn." in k:
            return ref_quantize(v.float(), dense_fmt, group)
        if k == "lm_head.weight":
            return ref_quantize(v.float(), lm_head_fmt, group)
        return v.float()
    ref = {k: quantized(k, v) for k, v in state.items()}
    save_file(ref, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir
