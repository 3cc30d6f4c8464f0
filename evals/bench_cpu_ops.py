"""Benchmark of the small ops of a CPU decode step that the plugin runs in one C++ pass (--kt-cpu-ops): rotary
embedding (kt_serve/rotary.py) and RMSNorm (kt_serve/norm.py) against SGLang's own ``forward_native`` (what its CPU
engine runs without AMX), in one process, at Qwen3-30B-A3B's shapes (32 q / 4 kv heads of 128, hidden 2048).

    python evals/bench_cpu_ops.py [--tokens 1 8 512] [--repeats 200]

Implementations take turns call by call (a drift of the machine hits both alike); times are medians in µs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from kt_serve.cpu_threads import share_cores_with_torch

share_cores_with_torch()

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernel import cpu_model  # noqa: E402

from kt_serve.kernel import cpu_isa, num_threads  # noqa: E402
from kt_serve.norm import rms_norm  # noqa: E402
from kt_serve.rotary import rotary_embedding  # noqa: E402

HQ, HKV, D, HIDDEN = 32, 4, 128, 2048


def timed(calls: dict, repeats: int) -> dict:
    us = {name: [] for name in calls}
    for it in range(repeats + 5):  # 5 warm-up turns
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if it >= 5:
                us[name].append((time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(v) for name, v in us.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 512])
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args(argv)
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    torch.set_num_threads(num_threads())
    rope = RotaryEmbedding(D, D, 40960, 1000000.0, True, torch.bfloat16)  # SGLang's, bf16 cache as on a CPU host
    exact = rope._compute_cos_sin_cache().float()
    norm = RMSNorm(HIDDEN, eps=1e-6).to(torch.bfloat16)
    print(f"on {cpu_model()}, kernel isa {cpu_isa()}, {num_threads()} threads; µs per call, medians of {a.repeats}")
    print("| op | tokens | SGLang forward_native µs | kt_serve µs | speed-up |")
    print("|---|---|---|---|---|")
    for T in a.tokens:
        g = torch.Generator().manual_seed(T)
        pos = torch.randint(0, 4096, (T,), generator=g)
        qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=g).bfloat16()
        q, k, _ = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        x, r = torch.randn(T, HIDDEN, generator=g).bfloat16(), torch.randn(T, HIDDEN, generator=g).bfloat16()
        rows = {
            "rotary (q and k)": {"sglang": lambda: RotaryEmbedding.forward_native(rope, pos, q, k),
                                 "kt": lambda: rotary_embedding(pos, q, k, D, exact, True, D)},
            "RMSNorm + residual": {"sglang": lambda: RMSNorm.forward_native(norm, x, r),
                                   "kt": lambda: rms_norm(x, norm.weight.data, 1e-6, r)},
        }
        with torch.no_grad():
            for op, calls in rows.items():
                m = timed(calls, a.repeats)
                print(f"| {op} | {T} | {m['sglang']:.1f} | {m['kt']:.1f} | {m['sglang'] / m['kt']:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
