"""Benchmark of the small ops of a CPU decode step that the plugin runs in one C++ pass (--kt-cpu-ops): rotary
embedding (kt_serve/kernel/rotary.py) and RMSNorm (kt_serve/kernel/norm.py) against SGLang's own ``forward_native`` (what its CPU
engine runs without AMX), in one process, at Qwen3-30B-A3B's shapes (32 q / 4 kv heads of 128, hidden 2048).

    python evals/bench_cpu_ops.py [--tokens 1 8 512] [--repeats 200] [--cold]

Implementations take turns call by call (a drift of the machine hits both alike); times are medians in µs.
``--cold``: each call right after a 64 MB streaming read, as in a decode step, where every such op follows a
layer's weight stream that has evicted the interpreter's and torch's working set from the caches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from kt_serve.kernel.threads import share_cores_with_torch

share_cores_with_torch()

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernel import cpu_model  # noqa: E402

from kt_serve.kernel.threads import cpu_isa, num_threads  # noqa: E402
from kt_serve.kernel.norm import rms_norm  # noqa: E402
from kt_serve.kernel.rotary import qk_norm_rope, rotary_embedding  # noqa: E402

HQ, HKV, D, HIDDEN = 32, 4, 128, 2048


def timed(calls: dict, repeats: int, before=None) -> dict:
    us = {name: [] for name in calls}
    for it in range(repeats + 5):  # 5 warm-up turns
        for name, fn in calls.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            if it >= 5:
                us[name].append((time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(v) for name, v in us.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 512])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--cold", action="store_true", help="each call after a 64 MB streaming read")
    a = ap.parse_args(argv)
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    torch.set_num_threads(num_threads())
    rope = RotaryEmbedding(D, D, 40960, 1000000.0, True, torch.bfloat16)  # SGLang's, bf16 cache as on a CPU host
    exact = rope._compute_cos_sin_cache().float()
    norm = RMSNorm(HIDDEN, eps=1e-6).to(torch.bfloat16)
    q_norm, k_norm = RMSNorm(D, eps=1e-6).to(torch.bfloat16), RMSNorm(D, eps=1e-6).to(torch.bfloat16)
    stream = torch.ones(64 * 2**20)  # 256 MB, read a quarter at a time
    turn = [0]

    def read_64mb():
        turn[0] += 1
        stream[(turn[0] % 4) * 2**24:(turn[0] % 4 + 1) * 2**24].sum()

    def sglang_qk(qkv, pos):  # Qwen3MoeAttention.apply_qk_norm_rope's CPU path without sgl-kernel
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        q = RMSNorm.forward_native(q_norm, q.reshape(-1, D)).view(q.shape)
        k = RMSNorm.forward_native(k_norm, k.reshape(-1, D)).view(k.shape)
        q, k = RotaryEmbedding.forward_native(rope, pos, q, k)
        return q, k, v

    print(f"on {cpu_model()}, kernel isa {cpu_isa()}, {num_threads()} threads; µs per call, medians of {a.repeats}"
          + ("; each call after a 64 MB streaming read" if a.cold else ""))
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
            "q / k norm + rotary": {"sglang": lambda: sglang_qk(qkv, pos),
                                    "kt": lambda: qk_norm_rope(qkv, pos, HQ, HKV, D, q_norm.weight.data,
                                                               k_norm.weight.data, 1e-6, 1e-6, exact, True, D)},
        }
        with torch.no_grad():
            for op, calls in rows.items():
                m = timed(calls, a.repeats, read_64mb if a.cold else None)
                print(f"| {op} | {T} | {m['sglang']:.1f} | {m['kt']:.1f} | {m['sglang'] / m['kt']:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
