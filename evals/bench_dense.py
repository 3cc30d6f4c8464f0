"""Benchmark of the dense layers of a CPU decode step: kt_serve's PackedLinear (the plugin's --kt-cpu-ops)
against torch's ``F.linear`` (what SGLang's CPU engine runs without AMX), and against the read bandwidth a plain
streaming loop reaches on this machine, in one process.

    python evals/bench_dense.py [--rows 1 8 512] [--formats bf16,int8,int4] [--repeats 30]

Shapes: Qwen3-30B-A3B's dense layers (hidden 2048, 32 q / 4 kv heads of 128): qkv_proj 2048 -> 5120, o_proj
4096 -> 2048, and an lm_head 2048 -> 16384 (the vocabulary of evals/bench_serving.py's preset). Each layer gets as
many weight copies as make twice the L3 cache, cycled call by call, so weights come from DRAM as in a step through
all layers. Implementations are interleaved call by call (a drift of the machine hits both alike); times are
medians. "% of bandwidth" = bytes of the packed weights / time / the measured read bandwidth.
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
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernel import cpu_model, l3_bytes, measure_bandwidth_gbs  # noqa: E402

from kt_serve.kernel.linear import PackedLinear  # noqa: E402
from kt_serve.kernel.threads import cpu_isa, num_threads, set_num_threads  # noqa: E402

SHAPES = {"qkv_proj": (5120, 2048), "o_proj": (2048, 4096), "lm_head": (16384, 2048)}  # (out, in)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    ap.add_argument("--formats", default="bf16")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="0 = physical cores")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    set_num_threads(args.threads)
    torch.set_num_threads(num_threads())
    bw = measure_bandwidth_gbs()
    print(f"kt_serve dense bench on {cpu_model()}: {num_threads()} threads, isa {cpu_isa()}, torch {torch.__version__}, "
          f"read bandwidth {bw:.1f} GB/s (fp32 sum over 1 GiB)", flush=True)
    g = torch.Generator().manual_seed(0)
    table = []
    for name, (N, K) in SHAPES.items():
        copies = max(2, -(-2 * l3_bytes() // (N * K * 2)))
        weights = [(torch.randn(N, K, generator=g) * 0.02).bfloat16() for _ in range(copies)]
        ours = {f: [PackedLinear(w, weight_format=f) for w in weights] for f in formats}
        for M in args.rows:
            x = torch.randn(M, K, generator=g).bfloat16()
            impls = {"torch": lambda i: F.linear(x, weights[i])}
            impls.update({f: (lambda i, f=f: ours[f][i](x)) for f in formats})
            times = {n: [] for n in impls}
            reps = args.repeats if M <= 64 else max(3, args.repeats // 10)
            for _ in range(reps):
                for n, fn in impls.items():
                    for i in range(copies):
                        t0 = time.perf_counter()
                        fn(i)
                        times[n].append(time.perf_counter() - t0)
            med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
            for n in impls:
                nbytes = N * K * 2 if n == "torch" else ours[n][0].weight_bytes
                table.append({"layer": name, "shape": f"{K}->{N}", "rows": M, "impl": n if n == "torch" else f"kt {n}",
                              "ms": med[n], "vs_torch": med["torch"] / med[n],
                              "bw_pct": 100 * nbytes / (med[n] / 1e3) / (bw * 1e9)})
                print(f"{name:8s} M={M:4d} {table[-1]['impl']:8s} {med[n]:8.3f} ms  x{table[-1]['vs_torch']:.2f} vs torch"
                      f"  {table[-1]['bw_pct']:5.1f}% of bandwidth", flush=True)
        del weights, ours
    print("\n| layer | shape | rows | impl | ms (median) | vs torch | % of read bandwidth |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['layer']} | {r['shape']} | {r['rows']} | {r['impl']} | {r['ms']:.3f} | {r['vs_torch']:.2f}x | "
              f"{r['bw_pct']:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
