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

import hashlib
import json
import logging
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kt_serve import _kernel
from kt_serve.formats.checkpoint import expert_layer, tensor_entries
from kt_serve.formats.names import FormatError
from kt_serve.formats.safetensors_io import pread_into, read_header, save_tensors
from kt_serve.kernel.experts import MoEExperts

# The byte layout of packed blocks (csrc/weights/weight_format.h) and of the regions: bump on any change, so files
# written by another layout are stale rather than misread.
LAYOUT_VERSION = 1
REGION_NAMES = ("gate", "up", "down", "gate_scales", "up_scales", "down_scales")
logger = logging.getLogger(__name__)
_FORMAT_TAG = "kt_serve packed experts"
# Each region starts 4 KiB-aligned in the file (padding tensors between them), so it is read with O_DIRECT straight
# into the kernel's (2 MiB-aligned) buffers: a whole model's cache is read at the disk's speed, by several reads in
# flight, without a second copy in the page cache (measured on the 2-core VM, 5 GB of a Qwen3-30B-A3B int4 cache:
# buffered, one reader 0.56 GB/s; O_DIRECT, one reader 1.26; two readers 2.09).
ALIGN = 4096
READERS = 4
CHUNK = 32 << 20


def region_key(i: int) -> str:
    """The file's name of region i; the padding after it is this name + ".pad" (names sort in region order)."""
    return f"{i}.{REGION_NAMES[i]}"


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
    """Writes the layer file atomically (a temporary file in the same directory, fsynced, then renamed); its pages
    are dropped from the page cache afterwards (the kernel holds these bytes already)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    regions = experts.packed_regions()
    tensors, end = {}, 0
    for i, region in enumerate(regions):
        tensors[region_key(i)] = region
        end += region.numel()
        if i + 1 < len(regions) and end % ALIGN:
            tensors[region_key(i) + ".pad"] = torch.zeros(-end % ALIGN, dtype=torch.uint8)
            end += -end % ALIGN
    metadata = key.metadata()
    metadata["group"] = str(experts.group_size)
    metadata["checksums"] = json.dumps([f"{_checksum(t):016x}" for t in regions])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_tensors(tmp, tensors, metadata, align=ALIGN)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load(path: Path, key: LayerKey, *, max_tokens: int = 65536, max_slots: int = 64, isa: str = "auto") -> MoEExperts:
    """The layer's experts read from its file into the kernel's memory; raises :class:`CacheMiss` naming why the
    file cannot be served."""
    return open_layer(path, key, max_tokens=max_tokens, max_slots=max_slots, isa=isa).read()


@dataclass
class LayerRead:
    """A layer file whose header matches its key: the kernel's (empty) experts and where each region is in the file.
    ``read()`` fills them and checks the checksums."""

    path: Path
    experts: MoEExperts
    regions: list        # (name, region tensor, file offset, checksum)

    def read(self) -> MoEExperts:
        try:
            complete = _read_regions(self.path, [(region, offset) for _, region, offset, _ in self.regions])
        except OSError as exc:
            raise CacheMiss(f"{self.path.name}: unreadable ({exc})") from None
        if not complete:
            raise CacheMiss(f"{self.path.name}: truncated while it was read")
        for name, region, _, checksum in self.regions:
            if f"{_checksum(region):016x}" != checksum:
                raise CacheMiss(f"{self.path.name}: corrupt ({name}'s bytes do not match their checksum)")
        return self.experts


def open_layer(path: Path, key: LayerKey, *, max_tokens: int = 65536, max_slots: int = 64,
               isa: str = "auto") -> LayerRead:
    """Checks the layer file's header against ``key`` and the kernel's layout (raises :class:`CacheMiss` naming why
    it cannot be served) and allocates the experts its regions are read into; reads nothing else."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CacheMiss(f"{path.name}: not cached yet") from None
    try:
        header, data_start = read_header(path, fd)
        size = os.fstat(fd).st_size
    except FormatError as exc:
        raise CacheMiss(f"{path.name}: unreadable ({exc})") from None
    finally:
        os.close(fd)
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
    names = [region_key(i) for i in range(len(regions))]
    stored = [k for k in header if k != "__metadata__" and not k.endswith(".pad")]
    if sorted(stored) != names or len(checksums) != len(regions):
        raise CacheMiss(f"{path.name}: its regions are not the {len(regions)} this kernel packs")
    placed = []
    for name, region, checksum in zip(names, regions, checksums):
        begin, end = header[name]["data_offsets"]
        if end - begin != region.numel():
            raise CacheMiss(f"{path.name}: {name} has {end - begin} bytes, this kernel packs {region.numel()}")
        if data_start + end > size:
            raise CacheMiss(f"{path.name}: truncated ({size} bytes, its header needs {data_start + end})")
        placed.append((name, region, data_start + begin, checksum))
    return LayerRead(path, experts, placed)


class CacheReader:
    """Reads layer files in the background, in the order they are submitted, while the caller goes on (a server
    reads the rest of its checkpoint meanwhile). Two layers are in progress at once, so one layer's fresh memory
    is faulted in while the other's regions are read: on a host where first touching memory is slow (a VM whose
    freed memory goes back to the hypervisor: about 1 GB/s a core on the 2-core test VM) that costs as much as the
    disk read."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kt_cache_reader")

    def submit(self, layer: LayerRead):
        """A future of the layer's experts (or of the :class:`CacheMiss` that says why they cannot be served)."""
        return self._pool.submit(layer.read)


_read_pool = None
_read_pool_lock = threading.Lock()


def _readers() -> ThreadPoolExecutor:
    """READERS threads every layer read shares, so reads in flight stay at READERS however many layers are read."""
    global _read_pool
    with _read_pool_lock:
        if _read_pool is None:
            _read_pool = ThreadPoolExecutor(READERS, thread_name_prefix="kt_cache_io")
        return _read_pool


def _read_regions(path: Path, jobs) -> bool:
    """Reads each (region, file offset) in chunks, READERS at a time: with O_DIRECT where the region's address and
    offset are aligned (the last partial block, and a file system without O_DIRECT, through the page cache)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        direct = None
    chunks = []
    for region, offset in jobs:
        n = region.numel()
        _kernel.prefault(region.data_ptr(), n)  # fresh memory: faulted in by the pool first (common/checksum.h)
        aligned = direct is not None and region.data_ptr() % ALIGN == 0 and offset % ALIGN == 0
        head = n - n % ALIGN if aligned else 0
        chunks += [(direct, region, start, min(CHUNK, head - start), offset) for start in range(0, head, CHUNK)]
        if head < n:
            chunks.append((fd, region, head, n - head, offset))

    def read(chunk) -> bool:
        handle, region, start, length, offset = chunk
        part = region[start:start + length]
        try:
            return pread_into(handle, part, offset + start) == length
        except OSError:  # O_DIRECT refused for this read: the page cache then
            return handle is direct and pread_into(fd, part, offset + start) == length

    try:
        reads = [_readers().submit(read, chunk) for chunk in chunks]
        wait(reads)  # every read done before any error is raised: none may still write into the regions after
        return all(f.result() for f in reads)
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)


def _checksum(region: torch.Tensor) -> int:
    return _kernel.checksum(region.data_ptr(), region.numel()) if region.numel() else 0


# -- where a checkpoint's layers live in a cache directory (the server's --kt-weight-cache, the trainer's
# kt_weight_path) -----------------------------------------------------------------------------------------------
def layer_file(root: Path, model_dir: str, layer_id: int, key_fields: dict):
    """(file, LayerKey) of one MoE layer's packed experts under ``root``, or None where there is none to use: the
    checkpoint's expert tensors are not found by name, or ``root`` cannot be written (said once). The layer is then
    packed from the checkpoint. ``key_fields``: the LayerKey's fields but its source."""
    source = expert_sources(os.path.realpath(model_dir)).get(int(layer_id))
    where = _model_cache_dir(Path(root), os.path.realpath(model_dir)) if source is not None else None
    if where is None:
        return None
    key = LayerKey(source=source, **key_fields)
    rank, ranks = key.shard
    return where / f"{key.weight_format}-g{key.group_size}-tp{rank}of{ranks}" / f"layer_{int(layer_id):04d}.safetensors", key


_model_dirs: dict = {}  # (root, checkpoint) -> its directory in the cache, or None where it cannot be made


def _deleted(source: dict) -> bool:
    """Whether the checkpoint a cache directory was made for is deleted, not merely out of reach: its directory is
    gone and the filesystem it was on is still mounted, i.e. the nearest directory above it that exists is on the
    device the checkpoint was on (an unmounted drive leaves its mount point, on another device). Without the device
    (directories made before it was recorded), only a checkpoint whose parent directory is still there."""
    path = Path(source["model_path"])
    if path.is_dir():
        return False
    if "device" not in source:
        return path.parent.is_dir()
    above = path.parent
    while not above.is_dir() and above != above.parent:
        above = above.parent
    return os.stat(above).st_dev == source["device"]


def _model_cache_dir(root: Path, model_dir: str) -> Path | None:
    """One directory per checkpoint path. The first time a process uses ``root``, the directories of deleted
    checkpoints are removed (a cache must not grow without bound as models come and go; see _deleted)."""
    if (root, model_dir) in _model_dirs:
        return _model_dirs[root, model_dir]
    if not any(r == root for r, _ in _model_dirs):
        for entry in root.glob("*/source.json") if root.is_dir() else ():
            try:
                deleted = _deleted(json.loads(entry.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if deleted:
                shutil.rmtree(entry.parent, ignore_errors=True)
    where = root / f"{Path(model_dir).name}-{hashlib.sha256(model_dir.encode()).hexdigest()[:16]}"
    try:
        where.mkdir(parents=True, exist_ok=True)
        if not (where / "source.json").exists():
            source = {"model_path": model_dir, "device": os.stat(model_dir).st_dev}
            (where / "source.json.tmp").write_text(json.dumps(source) + "\n")  # renamed whole: never half-written
            os.replace(where / "source.json.tmp", where / "source.json")
    except OSError as exc:
        logger.warning("kt_serve: packed-weight cache %s cannot be written (%s): experts are packed from the "
                       "checkpoint at every start", root, exc)
        where = None
    _model_dirs[root, model_dir] = where
    return where


_sources: dict[str, dict[int, str]] = {}
_sources_lock = threading.Lock()


def expert_sources(model_dir: str) -> dict[int, str]:
    """Per decoder layer, a digest of its routed expert tensors as the checkpoint holds them: their names, dtypes,
    shapes and offsets, and each holding file's name, size and modification time. Read from the headers only."""
    with _sources_lock:
        if model_dir not in _sources:
            stats = {path.name: path.stat() for path in Path(model_dir).glob("*.safetensors")}
            entries: dict[int, list] = {}
            for e in tensor_entries(model_dir):
                layer = expert_layer(e.name)
                if layer is not None:
                    stat = stats[e.file]
                    entries.setdefault(layer, []).append((e.name, e.dtype, e.shape, e.offsets, e.file, stat.st_size,
                                                          stat.st_mtime_ns))
            _sources[model_dir] = {layer: hashlib.sha256(json.dumps(sorted(items)).encode()).hexdigest()
                                   for layer, items in entries.items()}
        return _sources[model_dir]
