"""Would running SGLang's scheduler Python beside the kernel pay on this host? A bandwidth-bound kernel call (the
routed experts of one token, Qwen3-30B-A3B shapes: 8 of 128 experts, 75 MB a call, two layers' weights in turn so
nothing stays in cache) timed alone and beside a thread running pure Python, in turns.

    python evals/bench_contention.py [--switch-interval 0.005 0.0001 0.00002] [--calls 200] [--turns 3]

Python's switch interval sets how long a thread holding the GIL keeps it before another thread that wants it gets it:
the call releases the GIL inside the kernel but needs it back to return, so at the default 5 ms the measured call
also waits for the other thread's turn to end; a scheduler thread beside a kernel thread would shorten it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernel import cpu_model  # noqa: E402
from kt_serve import _kernel  # noqa: E402
from kt_serve.kernel.experts import MoEExperts  # noqa: E402

E, H, I, TOP_K = 128, 2048, 768, 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch-interval", type=float, nargs="+", default=[0.005, 0.0001, 0.00002])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--turns", type=int, default=3)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    layers = [MoEExperts((torch.randn(E, I, H) * 0.02).bfloat16(), (torch.randn(E, I, H) * 0.02).bfloat16(),
                         (torch.randn(E, H, I) * 0.02).bfloat16(), max_tokens=16, max_slots=1) for _ in range(2)]
    x = torch.randn(1, H).bfloat16()
    routes = [torch.randperm(E)[:TOP_K].view(1, TOP_K) for _ in range(64)]
    weights = torch.full((1, TOP_K), 1.0 / TOP_K)

    def median_call() -> float:
        times = []
        for i in range(a.calls):
            t0 = time.perf_counter()
            layers[i % 2].forward_sft(x, routes[i % len(routes)], weights)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    stop = threading.Event()

    def python_work():  # GIL-holding Python, as the scheduler's
        table = {}
        while not stop.is_set():
            for j in range(1000):
                table[j] = j * 2

    print(f"CPU: {cpu_model()}; kernel isa {_kernel.cpu_isa()}; {os.cpu_count()} cores; routed experts of one token, "
          f"{TOP_K} of {E} experts (H {H}, I {I}, bf16); medians of {a.calls} calls\n")
    print("| switch interval s | turn | alone ms | beside a Python thread ms | ratio |\n|---|---|---|---|---|")
    for interval in a.switch_interval:
        sys.setswitchinterval(interval)
        for turn in range(a.turns):
            alone = median_call()
            stop.clear()
            worker = threading.Thread(target=python_work)
            worker.start()
            beside = median_call()
            stop.set()
            worker.join()
            print(f"| {interval:g} | {turn} | {1e3 * alone:.2f} | {1e3 * beside:.2f} | {beside / alone:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
