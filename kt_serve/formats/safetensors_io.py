"""safetensors on disk: validated lazy reading, streaming writing, hashing, atomic output directories."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import struct
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open

from .names import FormatError, OutputExistsError

ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
if hasattr(torch, "float8_e4m3fn"):  # FP8 checkpoints (DeepSeek-V3, Qwen3-FP8)
    ST_DTYPES[torch.float8_e4m3fn] = "F8_E4M3"
TORCH_DTYPES = {name: dtype for dtype, name in ST_DTYPES.items()}
# save_file lays tensors out by dtype, widest first (the Rust Dtype enum, descending), then by name.
_ST_DTYPE_ORDER = ("U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3", "I8", "U8",
                   "BOOL")


class TensorFile:
    """Read-only view of the tensors of one file: names, shapes and dtypes without loading, tensors on demand."""

    def __init__(self, path: Path, tensors: Mapping[str, torch.Tensor] | None = None):
        self.path = Path(path)
        self._tensors = tensors  # in-memory (adapter_model.bin, or a dict handed over by the caller)
        self._held = None  # weakref.finalize closing the descriptor hold_open() keeps
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        if tensors is not None:
            for key, value in tensors.items():
                if not isinstance(value, torch.Tensor):
                    raise FormatError(self.path, f"entry {key} is not a tensor")
                self.shapes[key], self.dtypes[key] = tuple(value.shape), value.dtype
            return
        with self._open() as handle:
            for key in handle.keys():
                view = handle.get_slice(key)
                dtype = TORCH_DTYPES.get(view.get_dtype())
                if dtype is None:
                    raise FormatError(self.path, f"{key} has unsupported dtype {view.get_dtype()}")
                self.shapes[key], self.dtypes[key] = tuple(view.get_shape()), dtype

    def hold_open(self) -> None:
        """Keep the file open: later reads see these bytes even after the path is removed or replaced (an adapter
        registered once and read again on every load into the kernel). close() lets go."""
        if self._tensors is None and self._held is None:
            fd = os.open(self.path, os.O_RDONLY)
            self._held = weakref.finalize(self, os.close, fd)
            self._fd = fd

    def close(self) -> None:
        if self._held is not None:
            self._held()
            self._held = None

    @contextlib.contextmanager
    def _open(self):
        source = f"/proc/self/fd/{self._fd}" if self._held is not None else str(self.path)
        try:
            with safe_open(source, framework="pt", device="cpu") as handle:
                yield handle
        except (SafetensorError, OSError) as exc:
            problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise FormatError(self.path, f"not a readable safetensors file ({problem})") from None

    def keys(self) -> list[str]:
        return list(self.shapes)

    @contextlib.contextmanager
    def reader(self) -> Iterator:
        """Yields a `get(key) -> Tensor` function; for files, the mmap stays open for the block."""
        if self._tensors is not None:
            yield lambda key: self._tensors[key]
            return
        with self._open() as handle:
            yield handle.get_tensor

    def nbytes(self) -> int:
        return sum(_numel(shape) * _itemsize(self.dtypes[key]) for key, shape in self.shapes.items())


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class SafetensorsWriter:
    """Writes a safetensors file tensor by tensor, in any order, so only the tensors at hand are in memory.

    The layout (header text, tensor order, padding) is the one `safetensors.torch.save_file` produces, so a
    streamed file is byte-identical to one saved in one go.
    """

    def __init__(self, path: Path, layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None, align: int = 8):
        """``align``: the data starts at a multiple of it (the header padded with spaces; 8 as save_file does)."""
        self.path = Path(path)
        order = sorted(layout, key=lambda key: (_ST_DTYPE_ORDER.index(ST_DTYPES[layout[key][0]]), key))
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        self._slots: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        offset = 0
        for key in order:
            dtype, shape = layout[key]
            size = _numel(shape) * _itemsize(dtype)
            header[key] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._slots[key] = (dtype, tuple(shape), offset, size)
            offset += size
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-(8 + len(text)) % align)
        self._data_start = 8 + len(text)
        self._pending = set(self._slots)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._file.truncate(self._data_start + offset)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        dtype, shape, offset, size = self._slots[key]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{key}: expected {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}")
        self._pending.discard(key)
        if size:
            self._file.seek(self._data_start + offset)
            self._file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        if self._pending:
            self._file.close()
            raise ValueError(f"{self.path}: {len(self._pending)} tensors never written, e.g. {min(self._pending)}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        self._file.close()


def save_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
                 align: int = 8) -> None:
    writer = SafetensorsWriter(path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, metadata, align)
    try:
        for key, value in tensors.items():
            writer.write(key, value)
    except BaseException:
        writer.abort()
        raise
    writer.close()


def read_header(path: Path, fd: int | None = None) -> tuple[dict, int]:
    """A safetensors file's header (tensor entries and ``__metadata__``) and the offset its data starts at, read
    without mapping the file; the tensors' ``data_offsets`` are relative to that offset."""
    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY)
    try:
        raw = os.pread(fd, 8, 0)
        size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 2 <= size <= 100 << 20:
            raise FormatError(Path(path), "not a safetensors file (header size unreadable)")
        text = os.pread(fd, size, 8)
        header = json.loads(text) if len(text) == size else None
    except (ValueError, UnicodeDecodeError):
        header = None
    finally:
        if own:
            os.close(fd)
    if not isinstance(header, dict):
        raise FormatError(Path(path), "not a safetensors file (header is not a JSON object)")
    return header, 8 + size


def pread_into(fd: int, buffer: torch.Tensor, offset: int) -> int:
    """Reads ``buffer.nbytes`` bytes at ``offset`` of ``fd`` into a contiguous CPU tensor (no mapping, no extra
    copy); returns how many it got (fewer at the end of the file)."""
    view = memoryview(buffer.view(torch.uint8).reshape(-1).numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + (1 << 30)]], offset + done)
        if got <= 0:
            break
        done += got
    return done


def write_json(path: Path, data: Mapping) -> None:
    """JSON as PEFT and KT write it: indent=2, sorted keys, trailing newline."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise FormatError(path, f"not readable JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise FormatError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def sha256_file(path: Path, progress=None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(8 << 20), b""):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


def check_output_dir(path: Path, *, overwrite: bool) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise OutputExistsError(path, "output path exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputExistsError(path, "output directory is not empty (use --overwrite / overwrite=True to replace it)")


class StagedDir:
    """An output directory built under a temporary name in the same parent and renamed into place when complete."""

    def __init__(self, target: Path, *, overwrite: bool):
        self.target = Path(target).absolute()
        self.overwrite = overwrite
        check_output_dir(self.target, overwrite=overwrite)
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.tmp-", dir=self.target.parent))

    def publish(self) -> None:
        check_output_dir(self.target, overwrite=self.overwrite)
        old = None
        if self.target.exists():
            # The old output disappears only once the new one is complete, and for the instant of two renames.
            old = self.target.with_name(f".{self.target.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(self.target, old)
        try:
            os.rename(self.path, self.target)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # another process published the same directory between our check and rename
            raise OutputExistsError(self.target, "output directory is not empty (written concurrently)") from None
        if old is not None:
            shutil.rmtree(old)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@contextlib.contextmanager
def staged_dirs(targets: list[Path], *, overwrite: bool) -> Iterator[list[Path]]:
    """Yields temporary directories for `targets`; all are published if the block succeeds, none otherwise."""
    staged: list[StagedDir] = []
    try:
        for target in targets:
            staged.append(StagedDir(target, overwrite=overwrite))
        yield [entry.path for entry in staged]
        for entry in staged:
            entry.publish()
    finally:
        for entry in staged:
            entry.discard()  # no-op for published ones


@contextlib.contextmanager
def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm byte counter on stderr for large files; None (no bar) otherwise."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False) as bar:
        yield bar
