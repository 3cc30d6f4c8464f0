"""The kernel's worker pool (csrc/common/thread_pool.h), the ISA table it runs, and how it shares the CPU cores of
one process with torch's OpenMP threads.

After each parallel op torch's OpenMP threads (GNU libgomp) spin for ~300k iterations before sleeping. Between two
layers' MoE calls that keeps them on the very cores the kernel's workers need: at 8 decode streams
(``evals/bench_serving.py --moe-only``) the MoE layer took 7.4 ms instead of 5.0. A short spin keeps back-to-back
torch ops cheap and frees the cores soon after. libgomp reads the setting when it is loaded, so this must run
before torch is imported (the SGLang plugin calls it in the launcher, before the schedulers are spawned).
"""

from __future__ import annotations

import os

from kt_serve import _kernel  # pybind11 only, no torch: share_cores_with_torch must still run before torch loads

TORCH_OMP_SPIN = ("GOMP_SPINCOUNT", "10000")


def share_cores_with_torch(environ=os.environ) -> None:
    """Shorten torch's OpenMP spin, only where the user chose neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ[TORCH_OMP_SPIN[0]] = TORCH_OMP_SPIN[1]


def set_num_threads(n: int, cpus=()) -> None:
    """Size of the kernel's worker pool, the calling thread included (n < 1: physical cores, or one per CPU in
    ``cpus``); with ``cpus``, worker i runs on cpus[i % len(cpus)] only (the caller is not moved)."""
    _kernel.set_num_threads(int(n), [int(c) for c in cpus])


def num_threads() -> int:
    return _kernel.num_threads()


def set_idle_spin_us(us: int) -> None:
    """How long the kernel's workers poll for the next call before they sleep, in microseconds: a decode step
    makes a dozen calls or more a fraction of a millisecond apart, and each wake-up of a sleeping worker costs
    tens of microseconds. Default ``KT_SERVE_IDLE_SPIN_US``, else 1000; 0 sleeps at once (a host whose cores
    other work needs). The poll yields the core to any other runnable thread after its first 50 µs."""
    _kernel.set_idle_spin_us(int(us))


def idle_spin_us() -> int:
    return _kernel.idle_spin_us()


def cpu_isa() -> str:
    """The kernel table this CPU gets: the best of ``amx_bf16``, ``avx512_bf16``, ``avx2`` (AVX2 + FMA) and
    ``portable`` it supports. ``KT_SERVE_ISA`` (or ``isa=`` of the modules) names one to force it, e.g. ``avx2``
    or ``portable``; naming one this CPU lacks is an error."""
    return _kernel.cpu_isa()
