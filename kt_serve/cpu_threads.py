"""The kernel's worker pool and torch's OpenMP threads share the CPU cores of one process.

After each parallel op torch's OpenMP threads (GNU libgomp) spin for ~300k iterations before sleeping. Between two
layers' MoE calls that keeps them on the very cores the kernel's workers need: at 8 decode streams
(``evals/bench_serving.py --moe-only``) the MoE layer took 7.4 ms instead of 5.0. A short spin keeps back-to-back
torch ops cheap and frees the cores soon after. libgomp reads the setting when it is loaded, so this must run
before torch is imported (the SGLang plugin calls it in the launcher, before the schedulers are spawned).
"""

from __future__ import annotations

import os

TORCH_OMP_SPIN = ("GOMP_SPINCOUNT", "10000")


def share_cores_with_torch(environ=os.environ) -> None:
    """Shorten torch's OpenMP spin, only where the user chose neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ[TORCH_OMP_SPIN[0]] = TORCH_OMP_SPIN[1]
