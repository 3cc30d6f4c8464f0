"""Packed-weight cache: one MoE layer's routed experts as the kernel packed them, in a file that a later start reads
straight into the kernel's memory instead of reading the checkpoint's experts and quantizing them again.

A layer file is a safetensors file (inspectable with any safetensors tool) of uint8 tensors, the kernel's packed
regions (``MoEExperts.packed_regions``: gate, up, down values, then their scales), with metadata: what the bytes
were packed from (``LayerKey``: a digest of the checkpoint's tensors, the served format and group size, the TP
slice, the shape), the kernel's layout version and a checksum of each region. A file whose key differs is stale,
one shorter than its header says is truncated, one whose bytes do not match their checksums is corrupt: each is
reported as a :class:`CacheMiss` with the reason, and the caller packs the layer from the checkpoint again and
rewrites the file. Files are written under a temporary name and renamed, so a crash leaves no half-written file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kt_serve import _kernel
from kt_serve.formats.names import FormatError
from kt_serve.formats.safetensors_io import pread_into, read_header, save_tensors
from kt_serve.kernel.experts import MoEExperts

# The byte layout of packed blocks (csrc/weights/weight_format.h) and of the regions: bump on any change, so files
# written by another layout are stale rather than misread.
LAYOUT_VERSION = 1
REGION_NAMES = ("gate", "up", "down", "gate_scales", "up_scales", "down_scales")
_FORMAT_TAG = "kt_serve packed experts"


class CacheMiss(Exception):
    """The layer file cannot be served (absent, stale, truncated, corrupt); the message says which and why."""


@dataclass(frozen=True)
class LayerKey:
    """What a layer's packed bytes depend on, besides the kernel's layout."""

    source: str            # digest of the checkpoint's expert tensors of this layer (names, dtypes, shapes, files)
    weight_format: str     # bf16 / fp8 / int8 / int4
    group_size: int        # the --kt-expert-group-size asked for (the packed layout's group is stored apart)
    shard: tuple           # (TP rank, ranks): the slice of the intermediate dimension
    shape: tuple           # (E, H, I) of that slice

    def metadata(self) -> dict:
        return {"kt_serve": _FORMAT_TAG, "layout_version": str(LAYOUT_VERSION), "key": json.dumps(asdict(self))}


def default_root() -> Path:
    """``$KT_SERVE_CACHE/packed_experts`` (default ``~/.cache/kt_serve/packed_experts``)."""
    return Path(os.environ.get("KT_SERVE_CACHE") or Path.home() / ".cache" / "kt_serve") / "packed_experts"


def store(path: Path, experts: MoEExperts, key: LayerKey) -> None:
    """Writes the layer file atomically (a temporary file in the same directory, fsynced, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    regions = experts.packed_regions()
    tensors = dict(zip(REGION_NAMES, regions))
    metadata = key.metadata()
    metadata["group"] = str(experts.group_size)
    metadata["checksums"] = json.dumps([f"{_checksum(t):016x}" for t in regions])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_tensors(tmp, tensors, metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load(path: Path, key: LayerKey, *, max_tokens: int = 65536, max_slots: int = 64, isa: str = "auto") -> MoEExperts:
    """The layer's experts read from its file into the kernel's memory; raises :class:`CacheMiss` naming why the
    file cannot be served."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CacheMiss(f"{path.name}: not cached yet") from None
    try:
        return _load(fd, path, key, max_tokens, max_slots, isa)
    finally:
        os.close(fd)


def _load(fd: int, path: Path, key: LayerKey, max_tokens: int, max_slots: int, isa: str) -> MoEExperts:
    try:
        header, data_start = read_header(path, fd)
    except FormatError as exc:
        raise CacheMiss(f"{path.name}: unreadable ({exc})") from None
    meta = header.get("__metadata__") or {}
    if meta.get("kt_serve") != _FORMAT_TAG:
        raise CacheMiss(f"{path.name}: not a kt_serve packed-experts file")
    if meta.get("layout_version") != str(LAYOUT_VERSION):
        raise CacheMiss(f"{path.name}: stale (kernel layout version {meta.get('layout_version')}, this kernel's is "
                        f"{LAYOUT_VERSION})")
    try:
        stored_key = json.loads(meta["key"])
        group = int(meta["group"])
        checksums = json.loads(meta["checksums"])
    except (KeyError, ValueError, TypeError):
        raise CacheMiss(f"{path.name}: metadata unreadable") from None
    changed = [name for name, value in asdict(key).items() if json.loads(json.dumps(value)) != stored_key.get(name)]
    if changed:
        raise CacheMiss(f"{path.name}: stale ({', '.join(changed)} changed since it was written)")
    E, H, I = key.shape
    try:
        experts = MoEExperts.empty(E, H, I, weight_format=key.weight_format, group_size=group,
                                   max_tokens=max_tokens, max_slots=max_slots, isa=isa)
    except ValueError as exc:
        raise CacheMiss(f"{path.name}: its layout does not fit this kernel ({exc})") from None
    regions = experts.packed_regions()
    names = [n for n in REGION_NAMES if n in header]
    if names != list(REGION_NAMES[:len(regions)]) or len(checksums) != len(regions):
        raise CacheMiss(f"{path.name}: regions {names}, expected {list(REGION_NAMES[:len(regions)])}")
    size = os.fstat(fd).st_size
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    for name, region, checksum in zip(names, regions, checksums):
        begin, end = header[name]["data_offsets"]
        if end - begin != region.numel():
            raise CacheMiss(f"{path.name}: {name} has {end - begin} bytes, this kernel packs {region.numel()}")
        if data_start + end > size or pread_into(fd, region, data_start + begin) != region.numel():
            raise CacheMiss(f"{path.name}: truncated ({size} bytes, its header needs {data_start + end})")
        if f"{_checksum(region):016x}" != checksum:
            raise CacheMiss(f"{path.name}: corrupt ({name}'s bytes do not match their checksum)")
    return experts


def _checksum(region: torch.Tensor) -> int:
    return _kernel.checksum(region.data_ptr(), region.numel()) if region.numel() else 0
