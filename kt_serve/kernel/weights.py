"""Base expert weights on their way into the kernel: bf16 (any float dtype, converted), or an FP8 checkpoint's
e4m3 tensors with their block scales, and the format the kernel packs them in.

Formats (``csrc/weights/weight_format.h`` has the byte layouts, ``csrc/weights/packed_weights.cpp`` the quantization
rules):

- ``bf16``: as given (an FP8 source is dequantized).
- ``fp8``: e4m3 with one fp32 scale per (column, K group); an FP8 checkpoint keeps its bytes and
  ``weight_scale_inv`` blocks exactly, bf16 weights are quantized per 64 rows × ``group_size`` K values.
- ``int8``: symmetric, one scale per output channel.
- ``int4``: asymmetric, a bf16 scale and a bf16 minimum per output channel and ``group_size`` K values, two values a
  byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

WEIGHT_FORMATS = ("bf16", "fp8", "int8", "int4")
_FP8 = getattr(torch, "float8_e4m3fn", None)


def as_bf16(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    return t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()


def expect(t: torch.Tensor, name: str, dtypes: tuple, shape: tuple) -> None:
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


def valid_group_size(group_size) -> bool:
    """K values per int4 scale (and per fp8 scale of a requantized bf16 matrix): a positive multiple of 64, the
    K step of every ISA's tile."""
    return (not isinstance(group_size, bool) and isinstance(group_size, int) and group_size >= 64
            and group_size % 64 == 0)


def fp8_blocks_kept(block_k: int) -> bool:
    """Whether FP8 weights with K blocks of ``block_k`` can be packed as stored: their scales must line up with the
    tiles' 64-value K steps (else they are requantized to int8 / int4 / bf16)."""
    return block_k % 64 == 0


def check_format(weight_format: str, group_size: int) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    if not valid_group_size(group_size):
        raise ValueError(f"group_size must be a positive multiple of 64 (K values per int4 / fp8 scale), got {group_size!r}")


def is_fp8(t) -> bool:
    return _FP8 is not None and isinstance(t, torch.Tensor) and t.dtype == _FP8


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KernelWeights:
    """The kernel constructor's weight arguments (addresses into ``keep``, which must outlive the call)."""

    E: int
    H: int
    I: int
    args: dict
    keep: tuple


def prepare(gate_proj, up_proj, down_proj, gate_up_proj, *, gate_scale_inv=None, up_scale_inv=None,
            down_scale_inv=None, gate_up_scale_inv=None, weight_block_size: Sequence[int] = (128, 128),
            weight_format: str = "bf16", group_size: int = 128) -> KernelWeights:
    """Validates the base weights (``gate_proj``/``up_proj`` ``[E, I, H]`` and ``down_proj`` ``[E, H, I]``, or a
    fused ``gate_up_proj`` ``[E, 2I, H]``) and returns the kernel's arguments. FP8 (``torch.float8_e4m3fn``)
    weights need their ``*_scale_inv`` ``[E, ceil(N / bn), ceil(K / bk)]`` for ``weight_block_size = [bn, bk]``."""
    check_format(weight_format, group_size)
    if down_proj is None:
        raise ValueError("down_proj [E, H, I] is required")
    fp8 = is_fp8(down_proj)
    if down_proj.dim() != 3:
        raise ValueError(f"down_proj must be 3-D [E, H, I], got shape {tuple(down_proj.shape)}")
    E, H, I = (int(d) for d in down_proj.shape)
    fused = gate_up_proj is not None
    if fused and (gate_proj is not None or up_proj is not None):
        raise ValueError("pass either gate_up_proj or gate_proj + up_proj, not both")
    if not fused and (gate_proj is None or up_proj is None):
        raise ValueError("gate_proj and up_proj [E, I, H] are required (or a fused gate_up_proj)")
    mats = {"gate_up_proj": (gate_up_proj, (E, 2 * I, H))} if fused else {
        "gate_proj": (gate_proj, (E, I, H)), "up_proj": (up_proj, (E, I, H))}
    mats["down_proj"] = (down_proj, (E, H, I))
    for name, (t, _) in mats.items():
        if is_fp8(t) != fp8:
            raise ValueError(f"{name} is {getattr(t, 'dtype', type(t).__name__)} but down_proj is {down_proj.dtype}: "
                             "all expert weights must be FP8 or all floating point")
    if not fp8:
        ready = {}
        for name, (t, shape) in mats.items():
            ready[name] = as_bf16(t, name)
            if tuple(ready[name].shape) != shape:
                raise ValueError(f"{name} has shape {tuple(ready[name].shape)}, expected {shape} from down_proj")
        gate, up, strides = _gate_up(ready, E, I, H, 2)
        down = ready["down_proj"]
        args = dict(gate=gate, gate_estride=strides, up=up, up_estride=strides, down=down.data_ptr(),
                    down_estride=H * I, fp8=False)
        return KernelWeights(E, H, I, args, tuple(ready.values()))

    bn, bk = _block_size(weight_block_size, weight_format)
    scales = {"gate_up_proj": gate_up_scale_inv} if fused else {"gate_proj": gate_scale_inv, "up_proj": up_scale_inv}
    scales["down_proj"] = down_scale_inv
    keep = []
    for name, (t, shape) in mats.items():
        expect(t, name, (_FP8,), shape)
        s = scales[name]
        sshape = (E, _ceil(shape[1], bn), _ceil(shape[2], bk))
        if s is None:
            raise ValueError(f"{name} is FP8: its weight_scale_inv {sshape} is required")
        expect(s, f"{name} scale_inv", (torch.float32,), sshape)
        keep += [t, s]
    if fused and I % bn:
        raise ValueError(f"gate_up_proj: the intermediate size {I} must be a multiple of the FP8 block rows {bn} "
                         "to split the fused scales")
    gate, up, strides = _gate_up({n: t for n, (t, _) in mats.items()}, E, I, H, 1)
    gs, us, sstride = _gate_up(scales, E, I // bn if fused else _ceil(I, bn), _ceil(H, bk), 4)
    ds = scales["down_proj"]
    args = dict(gate=gate, gate_estride=strides, up=up, up_estride=strides, down=down_proj.data_ptr(),
                down_estride=H * I, fp8=True, gate_scale=gs, gate_sstride=sstride, up_scale=us, up_sstride=sstride,
                down_scale=ds.data_ptr(), down_sstride=int(ds[0].numel()), block_n=bn, block_k=bk)
    return KernelWeights(E, H, I, args, tuple(keep))


def _gate_up(mats: dict, E: int, rows: int, cols: int, itemsize: int):
    """(gate address, up address, elements between experts) of separate or fused gate/up matrices."""
    if "gate_up_proj" in mats:
        t = mats["gate_up_proj"]
        return t.data_ptr(), t.data_ptr() + rows * cols * itemsize, int(t[0].numel())
    return mats["gate_proj"].data_ptr(), mats["up_proj"].data_ptr(), int(mats["gate_proj"][0].numel())


def _block_size(weight_block_size, weight_format: str) -> tuple:
    try:
        bn, bk = (int(v) for v in weight_block_size)
    except (TypeError, ValueError):
        raise ValueError(f"weight_block_size must be [rows, cols], got {weight_block_size!r}") from None
    if bn < 1 or bk < 1:
        raise ValueError(f"weight_block_size must be positive, got {[bn, bk]}")
    if weight_format == "fp8" and not fp8_blocks_kept(bk):
        raise ValueError(f"weight_block_size {[bn, bk]}: packing FP8 as it is needs K blocks that are a multiple of "
                         "64 (pass weight_format int8 to requantize)")
    return bn, bk


def fp8_to_bf16(w: torch.Tensor, scale_inv: torch.Tensor, weight_block_size: Optional[Sequence[int]]) -> torch.Tensor:
    """bf16 of :func:`dequantize_fp8` (the same values, rounded to nearest even) for a 2-D matrix, in the kernel:
    one pass at memory speed instead of torch's fp32 temporaries (a whole model's FP8 attention projections took
    about 10 s on 2 cores)."""
    from kt_serve import _kernel

    bn, bk = (int(v) for v in (weight_block_size or (128, 128)))
    N, K = (int(d) for d in w.shape)
    expect(w, "w", (_FP8,), (N, K))
    expect(scale_inv, "scale_inv", (torch.float32,), (_ceil(N, bn), _ceil(K, bk)))
    out = torch.empty((N, K), dtype=torch.bfloat16)
    _kernel.fp8_to_bf16(w.data_ptr(), N, K, scale_inv.data_ptr(), bn, bk, out.data_ptr())
    return out


def dequantize_fp8_to(w: torch.Tensor, scale_inv: torch.Tensor, weight_block_size: Optional[Sequence[int]],
                      dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantize_fp8` in ``dtype``: a 2-D matrix to bf16 in the kernel (:func:`fp8_to_bf16`), anything else
    through torch."""
    if dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous():
        return fp8_to_bf16(w, scale_inv.float().contiguous(), weight_block_size)
    return dequantize_fp8(w, scale_inv, weight_block_size).to(dtype)


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, weight_block_size: Optional[Sequence[int]]) -> torch.Tensor:
    """fp32 ``w · scale`` of an FP8 block-quantized matrix ``[..., N, K]`` with ``scale_inv`` ``[..., ceil(N/bn),
    ceil(K/bk)]`` (the checkpoint layout)."""
    bn, bk = (int(v) for v in (weight_block_size or (128, 128)))
    N, K = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :N, :].repeat_interleave(bk, dim=-1)[..., :K]
    return w.float() * s


# Bytes per routed-expert weight in the kernel: the values plus their 32-bit scale words per 64-column block
# (csrc/weights/weight_format.h): int8 an fp32 scale per row of K values, fp8 one per column and K group, int4 a bf16
# scale and a bf16 minimum per column and group.
def bytes_per_weight(fmt: str, k: int, group_size: int = 128, fp8_block_k: int = 128) -> float:
    return {"bf16": 2.0, "int8": 1.0 + 4 / k, "fp8": 1.0 + 4 / fp8_block_k, "int4": 0.5 + 4 / group_size}[fmt]


def expert_bytes(H: int, I: int, fmt: str, group_size: int = 128) -> float:
    """Bytes of one expert's packed base weights in ``fmt`` (gate and up have K = H, down K = I)."""
    return H * I * (2 * bytes_per_weight(fmt, H, group_size) + bytes_per_weight(fmt, I, group_size))


def expert_memory(config: dict, group_size: int = 128) -> dict:
    """Routed-expert bytes per format for a HF config.json (its text_config for multimodal checkpoints)."""
    text = config.get("text_config") or config
    E = text.get("num_experts") or text.get("n_routed_experts") or text.get("num_local_experts")
    H, I, layers = text["hidden_size"], text["moe_intermediate_size"], text["num_hidden_layers"]
    moe_layers = layers - int(text.get("first_k_dense_replace", 0)) - len(text.get("mlp_only_layers") or [])
    return {fmt: E * moe_layers * expert_bytes(H, I, fmt, group_size) for fmt in WEIGHT_FORMATS}


def main(argv=None) -> int:
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(description="Routed-expert memory per kernel format for HF configs.")
    ap.add_argument("configs", nargs="+", help="config.json files or checkpoint dirs")
    ap.add_argument("--group-size", type=int, default=128, help="int4 group size (K values per scale)")
    args = ap.parse_args(argv)
    print("| model | " + " | ".join(f"{f} GiB" for f in WEIGHT_FORMATS) + " |")
    print("|---|" + "---|" * len(WEIGHT_FORMATS))
    for c in args.configs:
        path = Path(c) / "config.json" if Path(c).is_dir() else Path(c)
        mem = expert_memory(json.loads(path.read_text()), args.group_size)
        print(f"| {path.parent.name if path.name == 'config.json' else path.stem} | "
              + " | ".join(f"{mem[f] / 2**30:.1f}" for f in WEIGHT_FORMATS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
