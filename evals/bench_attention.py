"""Benchmark of a CPU decode step's attention: kt_serve's decode attention (the plugin's kt_cpu backend,
kt_serve/kernel/attention.py) against SGLang's torch_native decode (what a CPU host without AMX runs otherwise: a Python
loop over requests, each a gather and an SDPA call), and against the read bandwidth of a plain streaming loop, in
one process.

    python evals/bench_attention.py [--batch 1 8] [--context 128 1024 4096] [--repeats 20]

Shape: Qwen3-30B-A3B's attention (32 q / 4 kv heads of 128), a bf16 paged KV pool with each request's slots
scattered (as after many allocations). Each (batch, context) gets as many layer caches as make twice the L3 cache,
cycled call by call, so K and V come from DRAM as in a step through all layers. Implementations are interleaved
call by call; times are medians. "% of bandwidth" = K and V bytes read / time / the measured read bandwidth.
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
from bench_kernel import cpu_model, l3_bytes, measure_bandwidth_gbs  # noqa: E402

from kt_serve.kernel.attention import decode_attention  # noqa: E402
from kt_serve.kernel.threads import cpu_isa, num_threads, set_num_threads  # noqa: E402

HQ, HKV, D = 32, 4, 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="0 = physical cores")
    args = ap.parse_args(argv)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    set_num_threads(args.threads)
    torch.set_num_threads(num_threads())
    bw = measure_bandwidth_gbs()
    print(f"kt_serve attention bench on {cpu_model()}: {num_threads()} threads, isa {cpu_isa()}, torch {torch.__version__}, "
          f"read bandwidth {bw:.1f} GB/s (fp32 sum over 1 GiB)", flush=True)
    g = torch.Generator().manual_seed(0)
    table = []
    for B in args.batch:
        for ctx in args.context:
            slots = B * ctx + 1
            kv_bytes = B * ctx * HKV * 2 * D * 2
            layers = max(2, -(-2 * l3_bytes() // kv_bytes))
            caches = [(torch.randn(slots, HKV, D, generator=g).bfloat16(),
                       torch.randn(slots, HKV, D, generator=g).bfloat16()) for _ in range(layers)]
            req_to_token = torch.randperm(slots - 1, generator=g).int().add_(1).view(B, ctx).contiguous()
            idx, lens = torch.arange(B), torch.full((B,), ctx)
            q = torch.randn(B, HQ, D, generator=g).bfloat16()
            out = torch.empty(B, HQ, D, dtype=torch.bfloat16)
            impls = {
                "SGLang torch_native": lambda i: TorchNativeAttnBackend._run_sdpa_forward_decode(
                    None, q, out, caches[i][0], caches[i][1], req_to_token, idx, lens, scaling=D ** -0.5,
                    enable_gqa=True),
                "kt_serve": lambda i: decode_attention(q, caches[i][0], caches[i][1], req_to_token, idx, lens,
                                                       D ** -0.5, out),
            }
            times = {n: [] for n in impls}
            for _ in range(args.repeats):
                for n, fn in impls.items():
                    for i in range(layers):
                        t0 = time.perf_counter()
                        fn(i)
                        times[n].append(time.perf_counter() - t0)
            med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
            base = med["SGLang torch_native"]
            for n in impls:
                table.append({"batch": B, "context": ctx, "impl": n, "ms": med[n], "speedup": base / med[n],
                              "bw_pct": 100 * kv_bytes / (med[n] / 1e3) / (bw * 1e9)})
                print(f"B={B} ctx={ctx:5d} {n:20s} {med[n]:8.3f} ms  x{base / med[n]:.2f}  "
                      f"{table[-1]['bw_pct']:5.1f}% of bandwidth", flush=True)
            del caches
    print("\n| requests | context | impl | ms per layer (median) | vs torch_native | % of read bandwidth |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['batch']} | {r['context']} | {r['impl']} | {r['ms']:.3f} | {r['speedup']:.2f}x | "
              f"{r['bw_pct']:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
