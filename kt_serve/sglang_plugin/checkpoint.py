"""Reading the served checkpoint: tensor by tensor within the memory the packed model needs, without the expert
tensors of layers the packed-weight cache (kernel/weight_cache.py) already holds.

SGLang's default safetensors loader reads whole shard files in a thread pool ("peak CPU RAM ≈ (max_workers + 2) ×
shard_file_size"), or maps each file, so its touched pages count in the process's RSS until the file is done: on a
whole model that is gigabytes above what the packed model keeps. With ``--kt-moe on`` both iterators are replaced by
:func:`checkpoint_tensors`, which reads one tensor at a time with ``pread`` (in file order) into a tensor SGLang's
weight loader copies and drops: the only checkpoint bytes resident are the tensor at hand and the MoE layer being
staged (experts.py packs each layer as soon as it is complete and releases its staging), at most two layers
(``IN_FLIGHT``) where a threaded loader packs while the reader runs on.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kt_serve.formats.checkpoint import LAYER_TENSOR, expert_layer
from kt_serve.formats.safetensors_io import TORCH_DTYPES, pread_into, read_header
from kt_serve.kernel import weight_cache

from .config import get_config

logger = logging.getLogger(__name__)


class _CacheReads:
    """Per checkpoint directory, the MoE layers whose experts are read from the packed-weight cache: their checkpoint
    tensors are not read. A layer is added while the model is built (create_weights), once its file's header
    matched; its regions are then read in the background (weight_cache.CacheReader) while SGLang reads the rest
    of the checkpoint, and ``finish`` installs them at the end of that read. A layer whose file proves corrupt or
    truncated only then is read from the checkpoint after all: ``finish`` returns it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._layers: dict[str, dict[int, tuple]] = {}  # checkpoint -> layer -> (future of its experts, install)
        self._reader = None

    def add(self, model_dir: str, layer_id: int, layer_read, install) -> None:
        with self._lock:
            if self._reader is None:
                self._reader = weight_cache.CacheReader()
            future = self._reader.submit(layer_read)
            self._layers.setdefault(os.path.realpath(model_dir), {})[int(layer_id)] = (future, install)

    def of(self, model_dir: str) -> frozenset:
        with self._lock:
            return frozenset(self._layers.get(os.path.realpath(model_dir), ()))

    def finish(self, model_dir: str) -> set[int]:
        """Waits for the layers of ``model_dir`` and installs each (in layer order); returns those that cannot be
        served from the cache (said in one log line each), now no longer skipped."""
        with self._lock:
            layers = self._layers.pop(os.path.realpath(model_dir), {})
        missed = set()
        for layer_id in sorted(layers):
            future, install = layers[layer_id]
            try:
                experts = future.result()
            except weight_cache.CacheMiss as miss:
                logger.warning("kt_serve: packed-weight cache: MoE layer %d packed from the checkpoint again: %s",
                               layer_id, miss)
                missed.add(layer_id)
                continue
            install(experts)
        return missed


CACHE_READS = _CacheReads()


class _LayersInFlight:
    """MoE layers whose expert tensors the reader has handed out but whose packing has not finished.

    SGLang's DeepSeek loader hands every CPU tensor to a thread pool and reads on: while one worker packs a layer
    (seconds of quantization), the reader would run ahead and the pool's queue and the staging buffers would hold
    layer after layer of checkpoint tensors. So the reader waits before a new layer's first tensor while ``limit``
    layers are in flight and a pack is running (it finishes, and frees its layer, without the reader). A loader
    that packs on the reading thread never waits: no pack runs while it reads.
    """

    def __init__(self, limit: int = 2):
        self.limit = limit
        self._cond = threading.Condition()
        self._open: set[int] = set()
        self._packing = 0
        self.peak = 0

    def admit(self, layer: int) -> None:
        with self._cond:
            if layer in self._open:
                return
            while len(self._open) >= self.limit and self._packing:
                self._cond.wait()
            self._open.add(layer)
            self.peak = max(self.peak, len(self._open))

    @contextlib.contextmanager
    def packing(self, layer: int):
        with self._cond:
            self._packing += 1
        try:
            yield
        finally:
            with self._cond:
                self._packing -= 1
                self._open.discard(layer)
                self._cond.notify_all()


IN_FLIGHT = _LayersInFlight()


class _CacheWriter:
    """Writes packed layers to the packed-weight cache on one background thread, so the loader reads and packs the
    next layer meanwhile; the load waits for the writes at its end. A failed write costs the cache only: logged."""

    def __init__(self):
        self._pool = None
        self._writes = []

    def store(self, layer_id: int, experts, path, key) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kt_cache_writer")
        self._writes.append((layer_id, path, self._pool.submit(weight_cache.store, path, experts, key)))

    def wait(self) -> None:
        writes, self._writes = self._writes, []
        for layer_id, path, write in writes:
            try:
                write.result()
            except OSError as exc:
                logger.warning("kt_serve: packed-weight cache: MoE layer %d not written to %s: %s", layer_id, path, exc)
        if writes:
            logger.info("kt_serve: packed-weight cache: %d MoE layers written to %s", len(writes), writes[0][1].parent)


CACHE_WRITER = _CacheWriter()


READERS = 4                  # reads in flight: a disk gives more with several requests queued
READ_AHEAD_BYTES = 256 << 20  # what may be read ahead of the loader (it overlaps the loader's packing)


def checkpoint_tensors(files, *args, **kwargs):
    """(name, tensor) of every tensor of ``files`` (safetensors) in file order, read by READERS threads up to
    READ_AHEAD_BYTES ahead of the caller; the expert tensors of layers read from the cache skipped, unless their
    cache files prove unusable (then they come last). Takes (and ignores) the options of the SGLang iterators it
    stands in for."""
    yield from _read_tensors(files, lambda layer, cached: layer is None or layer not in cached)
    missed = set().union(*(CACHE_READS.finish(d) for d in sorted({os.path.dirname(f) for f in files})))
    if missed:
        yield from _read_tensors(files, lambda layer, cached: layer in missed)


def _read_tensors(files, wanted):
    """The tensors of ``files`` that ``wanted(expert layer or None, layers read from the cache)`` takes."""
    pending: collections.deque = collections.deque()  # (name, future of its tensor, bytes)
    ahead = 0
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(READERS))
        for path, name, entry, fd, data_start in _tensors_to_read(files, stack, wanted):
            dtype = TORCH_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, which the kt_serve loader "
                                 f"does not read (expected one of {', '.join(TORCH_DTYPES)})")
            tensor = torch.empty(entry["shape"], dtype=dtype)
            begin, end = entry["data_offsets"]
            if end - begin != tensor.nbytes:
                raise ValueError(f"{path}: tensor {name}: its header gives {end - begin} bytes for shape "
                                 f"{entry['shape']} {entry['dtype']}")
            pending.append((path, name, pool.submit(pread_into, fd, tensor, data_start + begin), tensor))
            ahead += tensor.nbytes
            while pending and (ahead > READ_AHEAD_BYTES or len(pending) > 4 * READERS):
                ahead -= yield from _next_read(pending)
        while pending:
            yield from _next_read(pending)


def _next_read(pending):
    path, name, future, tensor = pending.popleft()
    if future.result() != tensor.nbytes:
        raise ValueError(f"{path}: tensor {name} is truncated (the file ends inside it)")
    yield name, tensor
    return tensor.nbytes


def _tensors_to_read(files, stack, wanted):
    """(path, name, header entry, descriptor, data start) in read order; a new MoE layer's first tensor waits for
    room (IN_FLIGHT) before it is handed out."""
    for path in files:
        cached = CACHE_READS.of(os.path.dirname(path))
        header, data_start = read_header(path)
        header.pop("__metadata__", None)
        fd = os.open(path, os.O_RDONLY)
        stack.callback(os.close, fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for name, entry in sorted(header.items(), key=_layer_then_offset):
            layer = expert_layer(name)
            if not wanted(layer, cached):
                continue
            if layer is not None:
                IN_FLIGHT.admit(layer)
            yield path, name, entry, fd, data_start


def _layer_then_offset(item):
    """Read order within a file: by decoder layer, then as stored, so a layer's experts arrive together even in a
    file that interleaves layers (each staged layer costs its checkpoint bytes until it is complete)."""
    match = LAYER_TENSOR.match(item[0])
    return (int(match.group(1)) if match else -1, item[1]["data_offsets"][0])


def replace_safetensors_iterator(original, hf_weights_files, *args, **kwargs):
    """AROUND SGLang's safetensors iterators in its model loader (hooks.py): ours instead, unless a file holds a
    dtype this reader has no torch type for (then SGLang's, said once: whole files in memory while loading)."""
    for path in hf_weights_files:
        header, _ = read_header(path)
        unknown = sorted({e["dtype"] for k, e in header.items() if k != "__metadata__"} - set(TORCH_DTYPES))
        if unknown:
            logger.warning("kt_serve: %s holds %s tensors, which the kt_serve checkpoint reader does not read: "
                           "SGLang's reader loads this checkpoint (no bound on the memory it stages)", path,
                           ", ".join(unknown))
            for model_dir in sorted({os.path.dirname(f) for f in hf_weights_files}):
                CACHE_READS.finish(model_dir)  # its reader gives every tensor: a layer not installed now packs
            return original(hf_weights_files, *args, **kwargs)
    return checkpoint_tensors(hf_weights_files)


# -- the packed-weight cache of this checkpoint ---------------------------------------------------------------------
def cache_root() -> Path | None:
    """--kt-weight-cache: a directory, 'auto' (default: under $KT_SERVE_CACHE or ~/.cache/kt_serve) or 'off'."""
    value = get_config().weight_cache
    if value == "off":
        return None
    return weight_cache.default_root() if value == "auto" else Path(value).expanduser()


def layer_cache(model_dir: str, layer_id: int, key_fields: dict):
    """(file, LayerKey) of one MoE layer's packed experts under --kt-weight-cache, or None (kernel/weight_cache.py)."""
    root = cache_root()
    return None if root is None else weight_cache.layer_file(root, model_dir, layer_id, key_fields)
