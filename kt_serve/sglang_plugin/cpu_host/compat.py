"""Run-time fixes for SGLang's CPU engine on a host without any accelerator: what a CPU-only host is, its cores split
between TP ranks (launcher), pinned memory dropped (schedulers).

Per-model fixes live with their model (models/). Import-time problems (CUDA-linked torchvision, missing sgl_kernel,
SGLANG_USE_CPU_ENGINE) are fixed by launch/cpu_shims/install_shims.py, because they bite before any plugin runs.
Everything here is a no-op when CUDA is available.
"""

from __future__ import annotations

import functools
import os

import torch

# torch factories that SGLang's LoRA code calls with pin_memory=True (lora/layers.py, mem_pool.py, torch_backend.py)
_PIN_MEMORY_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like",
                         "ones_like", "full_like", "as_tensor", "empty_strided", "randn", "rand")


def cpu_only_host() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and not torch.cuda.is_available()


def split_cores_between_ranks(server_args, environ=os.environ) -> None:
    """SGLang's CPU engine gives each rank one NUMA node's cores and refuses more ranks than nodes unless
    SGLANG_CPU_OMP_THREADS_BIND names cores per rank (sglang/srt/utils/numa_utils.py). With fewer nodes than
    ranks (e.g. --tp-size 2 on a one-node host) split the physical cores evenly instead. Runs in the launcher,
    before the schedulers are spawned; a user's own setting wins."""
    if not cpu_only_host() or environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        return
    from sglang.srt.utils.common import get_cpu_ids_by_node

    ranks = server_args.tp_size * server_args.pp_size * server_args.dp_size
    nodes = get_cpu_ids_by_node()
    cpus = [c for node in nodes for c in node.split(",")]
    if ranks <= len(nodes) or ranks > len(cpus):
        return  # SGLang's default binding works, or it explains why no binding can
    per = len(cpus) // ranks
    environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(",".join(cpus[i * per:(i + 1) * per]) for i in range(ranks))


def rank_cpus(environ=os.environ) -> list[int] | None:
    """The CPUs SGLang's CPU engine gives this rank: its SGLANG_CPU_OMP_THREADS_BIND entry, else its NUMA node's
    physical cores (numa_utils.init_threads_binding, by the rank's device index); None off a CPU-only host."""
    if not cpu_only_host():
        return None
    from sglang.srt.runtime_context import get_device

    index = int(get_device().gpu_id or 0)
    bind = environ.get("SGLANG_CPU_OMP_THREADS_BIND")
    if not bind or bind == "all":
        from sglang.srt.utils.common import get_cpu_ids_by_node

        entries = get_cpu_ids_by_node()
    else:
        entries = bind.split("|")
    if not 0 <= index < len(entries):
        return None
    cpus = []
    for part in entries[index].split(","):
        first, _, last = part.strip().partition("-")
        cpus += list(range(int(first), int(last or first) + 1))
    return cpus


def _drop_pin_memory(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    wrapper._kt_serve_no_pin = True
    return wrapper


def disable_pin_memory() -> None:
    """pin_memory=True raises on CPU-only torch (sglang#31894); pinning has no meaning without a device anyway."""
    if getattr(torch.Tensor.pin_memory, "_kt_serve_no_pin", False):
        return
    for name in _PIN_MEMORY_FACTORIES:
        setattr(torch, name, _drop_pin_memory(getattr(torch, name)))

    def pin_memory(self, *args, **kwargs):
        return self

    def is_pinned(self, *args, **kwargs):
        return False

    pin_memory._kt_serve_no_pin = True
    torch.Tensor.pin_memory = pin_memory
    torch.Tensor.is_pinned = is_pinned
