"""Make stock sglang==0.5.23 importable and runnable on a CPU-only host (no-op where a GPU stack exists).

Called by launch/install.sh with the venv's python. Idempotent: each shim carries a marker and is (re)written only
when missing. It never touches a real ``sgl_kernel`` or a working torchvision. What it fixes (notes/sglang-on-cpu.md):

1. torchvision 0.28.0's default wheel links libtorch_cuda, so ``import torchvision`` dies on CPU torch with
   "operator torchvision::nms does not exist"; the op-registration import is guarded.
2. sglang's CPU engine imports ``sgl_kernel`` at module level, whose published wheels are CUDA-only; a pure-Python
   stand-in lets every ``from sgl_kernel... import X`` succeed (X raises if called), so layers take their torch path.
3. ``SGLANG_USE_CPU_ENGINE=1`` is required on a CPU host: a ``.pth`` sets it (setdefault) in every interpreter of
   this venv, before any sglang import, so the launcher and all spawned schedulers see it.

pin_memory on CPU-only torch is handled at run time by the plugin (kt_serve/sglang_plugin/cpu_host/compat.py).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path

MARKER = "kt_serve CPU shim"
SITE = Path(sysconfig.get_paths()["purelib"])

SGL_KERNEL_STUB = f'''"""{MARKER}: pure-Python stand-in for sgl_kernel on a CPU-only host (ops raise if called)."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kt_serve_cpu_stub"
__path__ = []
KT_SERVE_STUB = True


def _attr(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stub: op {{name!r}} is not available on this CPU-only install")

    op.__name__ = name
    return op


__getattr__ = _attr


class _Sub(types.ModuleType):
    def __getattr__(self, name):
        return _attr(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # sgl_kernel.scalar_type must stay unfound so that sglang falls back to its own MockScalarTypes.
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sgl_kernel.") and fullname != "sgl_kernel.scalar_type":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Sub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
'''

CPU_ENGINE_PTH = f'import os; os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # {MARKER}\n'

TORCHVISION_REGISTRATIONS = "    _autograd_registrations,\n    _meta_registrations,\n"
TORCHVISION_GUARDED = (
    f"try:  # {MARKER}: the CUDA-linked _C cannot register its ops on CPU torch\n"
    "    from torchvision import _autograd_registrations, _meta_registrations\n"
    "except Exception:\n"
    "    pass\n"
)


def _gpu_stack() -> str | None:
    """Why this host counts as a GPU host, or None on a CPU-only one."""
    import torch

    if torch.version.cuda or getattr(torch.version, "hip", None):
        return f"torch {torch.__version__} is a GPU build"
    if torch.cuda.is_available():
        return "a CUDA device is visible"
    return None


def _real_sgl_kernel() -> bool:
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        return False
    return MARKER not in Path(spec.origin).read_text(errors="replace")


def _torchvision_imports() -> bool:
    code = "import torchvision.transforms"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def shim_torchvision() -> str:
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        return "torchvision: not installed, nothing to do"
    init = Path(spec.origin)
    text = init.read_text()
    if MARKER in text:
        return "torchvision: already shimmed"
    if _torchvision_imports():
        return "torchvision: imports fine, left alone"
    if TORCHVISION_REGISTRATIONS not in text:
        raise SystemExit(f"{init}: unexpected content, cannot guard the op registrations (expected torchvision 0.28.0)")
    # Drop the two registration modules from the combined import and import them under a guard before it.
    start = text.rindex("from torchvision import (", 0, text.index(TORCHVISION_REGISTRATIONS))
    patched = text[:start] + TORCHVISION_GUARDED + text[start:].replace(TORCHVISION_REGISTRATIONS, "", 1)
    init.write_text(patched)
    if not _torchvision_imports():
        init.write_text(text)
        raise SystemExit("torchvision: still fails to import after the shim (restored the original)")
    return "torchvision: guarded the op registrations"


def shim_sgl_kernel() -> str:
    if _real_sgl_kernel():
        return "sgl_kernel: a real sgl_kernel is installed, left alone"
    target = SITE / "sgl_kernel" / "__init__.py"
    if target.exists() and target.read_text() == SGL_KERNEL_STUB:
        return "sgl_kernel: stand-in already installed"
    target.parent.mkdir(exist_ok=True)
    target.write_text(SGL_KERNEL_STUB)
    return "sgl_kernel: installed the pure-Python stand-in"


def shim_cpu_engine_env() -> str:
    target = SITE / "kt_serve_cpu_engine.pth"
    if target.exists() and target.read_text() == CPU_ENGINE_PTH:
        return "SGLANG_USE_CPU_ENGINE: .pth already installed"
    target.write_text(CPU_ENGINE_PTH)
    return "SGLANG_USE_CPU_ENGINE: installed kt_serve_cpu_engine.pth"


def main() -> None:
    why_gpu = _gpu_stack()
    if why_gpu:
        print(f"[cpu_shims] {why_gpu}: no shims installed")
        return
    for step in (shim_torchvision, shim_sgl_kernel, shim_cpu_engine_env):
        print(f"[cpu_shims] {step()}")


if __name__ == "__main__":
    main()
