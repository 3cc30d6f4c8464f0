"""A served checkpoint's tensors as its safetensors headers describe them (names, dtypes, shapes, files), without
reading any weight: what the packed-weight cache keys on and what ``kt_serve.plan`` counts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .safetensors_io import read_header

# A routed expert tensor of decoder layer N, as Qwen2/3-MoE, DeepSeek-V2/V3 and Qwen3.5 (language_model.) name them
EXPERT_TENSOR = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.mlp\.experts\.")
# A decoder layer's tensor (MTP / nextn layers are named mtp.* or numbered past num_hidden_layers)
LAYER_TENSOR = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")
DTYPE_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str            # the safetensors dtype name (BF16, F8_E4M3, ...)
    shape: tuple
    file: str             # the holding file's name
    offsets: tuple        # its data_offsets in that file

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 2)


def expert_layer(name: str) -> int | None:
    """The decoder layer whose routed experts ``name`` belongs to, or None."""
    match = EXPERT_TENSOR.match(name)
    return int(match.group(1)) if match else None


def tensor_entries(model_dir) -> list[TensorEntry]:
    """Every tensor of the checkpoint's ``*.safetensors`` files, from their headers."""
    entries = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        header, _ = read_header(path)
        for name, entry in header.items():
            if name != "__metadata__":
                entries.append(TensorEntry(name, entry["dtype"], tuple(entry["shape"]), path.name,
                                           tuple(entry["data_offsets"])))
    return entries
