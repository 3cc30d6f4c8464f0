"""kt_adapter_manifest.json: what KT's save_kt_adapter_artifacts writes, and the checks its loader makes."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from .names import FUSED_EXPERT_LORA_FILE, KT_ADAPTER_MANIFEST_FILE, KT_ADAPTER_MANIFEST_VERSION, FormatError
from .safetensors_io import ST_DTYPES, progress_bar, read_json, sha256_file


def tensor_contract(layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, dict]:
    return {key: {"shape": list(shape), "dtype": ST_DTYPES[dtype]} for key, (dtype, shape) in sorted(layout.items())}


def build_manifest(directory: Path, files: list[str], *, base_model_name_or_path: str, rank: int, alpha: float,
                   fused_layout: Mapping, expert_weight_format: str = "bf16") -> dict:
    artifacts = {}
    for name in sorted(files):
        path = directory / name
        record = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        if name == FUSED_EXPERT_LORA_FILE:
            contract = tensor_contract(fused_layout)
            record.update({"tensor_count": len(contract), "tensors": contract})
        artifacts[name] = record
    return {
        "version": KT_ADAPTER_MANIFEST_VERSION,
        "status": "ready",
        "expert_weight_format": expert_weight_format,
        "base": {"model_name_or_path": base_model_name_or_path},
        "lora": {"rank": rank, "alpha": float(alpha)},
        "artifacts": artifacts,
    }


def read_manifest(directory: Path) -> dict | None:
    path = directory / KT_ADAPTER_MANIFEST_FILE
    if not path.exists():
        return None
    manifest = read_json(path)
    if manifest.get("version") != KT_ADAPTER_MANIFEST_VERSION or manifest.get("status") != "ready":
        raise FormatError(path, f"expected version={KT_ADAPTER_MANIFEST_VERSION} and status='ready', got "
                                f"version={manifest.get('version')!r} status={manifest.get('status')!r}")
    if not isinstance(manifest.get("artifacts"), dict):
        raise FormatError(path, "has no artifacts table")
    return manifest


def verify_manifest(directory: Path, manifest: Mapping, *, rank: int, alpha: float | None,
                    fused_layout: Mapping | None, progress: bool = False) -> None:
    """Sizes, sha256, the fused tensor contract and rank/alpha must match the files (KT fails closed too)."""
    path = directory / KT_ADAPTER_MANIFEST_FILE
    artifacts = manifest["artifacts"]
    for name, record in sorted(artifacts.items()):
        file = directory / name
        if name != Path(name).name or not isinstance(record, dict):
            raise FormatError(path, f"invalid artifact record {name!r}")
        if not file.is_file():
            raise FormatError(path, f"lists {name}, which is missing")
        if record.get("size") != file.stat().st_size:
            raise FormatError(path, f"size mismatch for {name}: manifest {record.get('size')}, "
                                    f"file {file.stat().st_size}")
    total = sum(record["size"] for record in artifacts.values())
    with progress_bar(total, "sha256", progress and total > (256 << 20)) as bar:
        for name, record in sorted(artifacts.items()):
            if sha256_file(directory / name, bar) != record.get("sha256"):
                raise FormatError(path, f"sha256 mismatch for {name}")
    fused = artifacts.get(FUSED_EXPERT_LORA_FILE)
    if fused_layout is not None and fused is not None and "tensors" in fused:
        if fused["tensors"] != tensor_contract(fused_layout):
            raise FormatError(path, f"tensor contract of {FUSED_EXPERT_LORA_FILE} does not match the file")
    lora = manifest.get("lora") or {}
    if "rank" in lora and lora["rank"] != rank:
        raise FormatError(path, f"lora.rank={lora['rank']} but the tensors have rank {rank}")
    if "alpha" in lora and alpha is not None and float(lora["alpha"]) != float(alpha):
        raise FormatError(path, f"lora.alpha={lora['alpha']} but adapter_config.json has lora_alpha={alpha}")
