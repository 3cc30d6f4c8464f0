"""Native FP8 checkpoints in training (the cookbook's "Native FP8 + LoRA").

transformers loads an FP8 block-quantized checkpoint on a CPU by dequantizing it to bf16, and splits the scale grid
evenly where a dimension is not a multiple of the block (../shared/notes: it is then not the checkpoint's model).
So after loading, the routed experts are packed into the kernel from the file's own e4m3 weights and
``weight_scale_inv`` blocks (in ``kt_expert_weight_format``: fp8 keeps them exactly), and every dense FP8 linear
gets W = w · scale_inv recomputed from the file. Keys are read lazily, one tensor at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kt_serve.kernel.weights import dequantize_fp8_to

PROJS = ("gate_proj", "up_proj", "down_proj")


class Fp8Checkpoint:
    def __init__(self, model_dir):
        self.dir = Path(model_dir)
        config = json.loads((self.dir / "config.json").read_text())
        text = config.get("text_config") or {}
        q = config.get("quantization_config") or text.get("quantization_config") or {}
        self.block = [int(v) for v in q.get("weight_block_size") or ()]
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.files = {k: self.dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            with safe_open(self.dir / "model.safetensors", "pt") as f:
                self.files = {k: self.dir / "model.safetensors" for k in f.keys()}

    @staticmethod
    def detect(model_dir) -> "Fp8Checkpoint | None":
        """An Fp8Checkpoint when config.json says ``quant_method: fp8`` with block scales, else None; other
        quantizations are refused naming the format."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
        if not q:
            return None
        method = q.get("quant_method")
        if method != "fp8" or not q.get("weight_block_size"):
            raise ValueError(f"{model_dir}/config.json: quantization_config.quant_method {method!r}"
                             + ("" if method != "fp8" else " without weight_block_size")
                             + " is not read; train from a bf16 or FP8 block-quantized checkpoint "
                             "(kt_expert_weight_format then quantizes the experts in the kernel)")
        return Fp8Checkpoint(model_dir)

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self.files:
            raise ValueError(f"{self.dir}: FP8 checkpoint has no tensor {key}")
        with safe_open(self.files[key], "pt") as f:
            return f.get_tensor(key)

    def expert_weights(self, block_path: str, num_experts: int) -> dict:
        """The MoEExperts arguments of the routed experts at ``block_path`` (e.g. ``model.layers.3.mlp``): per-expert
        keys ``experts.{e}.{gate,up,down}_proj.weight`` (+ ``weight_scale_inv``) stacked, or fused ``gate_up_proj``."""
        prefix = f"{block_path}.experts"
        fused = f"{prefix}.gate_up_proj"
        if fused in self.files:
            return dict(gate_up_proj=self.tensor(fused), gate_up_scale_inv=self.tensor(f"{fused}_scale_inv").float(),
                        down_proj=self.tensor(f"{prefix}.down_proj"),
                        down_scale_inv=self.tensor(f"{prefix}.down_proj_scale_inv").float(),
                        weight_block_size=self.block)
        out = {"weight_block_size": self.block}
        for proj in PROJS:
            keys = [f"{prefix}.{e}.{proj}.weight" for e in range(num_experts)]
            out[proj] = torch.stack([self.tensor(k) for k in keys])
            out[f"{proj.split('_')[0]}_scale_inv"] = torch.stack(
                [self.tensor(k.replace(".weight", ".weight_scale_inv")).float() for k in keys])
        return out

    @torch.no_grad()
    def restore_dense(self, model: torch.nn.Module) -> int:
        """Sets every nn.Linear with FP8 weights in the file to the file's dequantized values; returns how many."""
        n = 0
        for path, module in model.named_modules():
            key = f"{path}.weight"
            if isinstance(module, torch.nn.Linear) and f"{path}.weight_scale_inv" in self.files:
                module.weight.copy_(dequantize_fp8_to(self.tensor(key), self.tensor(f"{path}.weight_scale_inv"),
                                                      self.block, module.weight.dtype))
                n += 1
        return n
