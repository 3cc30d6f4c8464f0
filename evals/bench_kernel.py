"""Benchmark of the MoE-LoRA kernel: forward and forward+backward against a plain torch bf16 per-expert loop and
(when installed) kt-kernel 0.7.2, measured in the same run, plus the share of the roofline reached.

    python evals/bench_kernel.py [--tokens 1 8 64 512] [--isa avx512_bf16,avx2,portable] [--json FILE] [--threads N]

Default shape: H=2048, I=768, E=64, top-8, r=8 (Qwen3-30B-A3B's experts). Each implementation gets ``--layers``
independent weight sets and cycles through them call by call, as a model does, so the weights are not served
from a cache larger than one layer (this machine's L3 can hold most of one). Times are min / median over repeats;
``vs_*`` = baseline time / our time (above 1 means kt_serve is faster). The roofline is max(bytes of the experts
touched / measured memory bandwidth, FLOPs / measured bf16 GEMM peak), both measured here with torch.
``--isa`` takes a comma list of kernel tables: each gets its own row set (the baselines are measured once), then
every table's time over the first one's per T.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from kt_serve.cpu_threads import share_cores_with_torch

share_cores_with_torch()  # as the plugin does for the server; before torch loads its OpenMP runtime

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kt_serve.kernel import ExpertLoRA, MoEExperts, cpu_isa, num_threads, set_num_threads  # noqa: E402


def timeit(fn, repeats: int, warmup: int = 2, budget_s: float = 20.0):
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    return min(times), statistics.median(times)


# ------------------------------------------------------------------------------------------------ machine figures


def measure_bandwidth_gbs() -> float:
    """Sustained read bandwidth: fp32 sum over 1 GiB (bf16 sums take a slow upcast path; see the notes)."""
    a = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    a.sum()
    best = min(timeit(lambda: a.sum(), 5, warmup=1))
    return a.numel() * 4 / (best / 1e3) / 1e9


def measure_bf16_peak_gflops() -> float:
    a = torch.randn(512, 2048).bfloat16()
    b = torch.randn(2048, 1536).bfloat16()
    best = min(timeit(lambda: a @ b, 10))
    return 2 * 512 * 2048 * 1536 / (best / 1e3) / 1e9


def roofline_ms(T, E, H, I, k, r, bw_gbs, peak_gflops, op):
    touched = E * (1 - (1 - k / E) ** T)  # expected distinct experts under uniform top-k
    bytes_ = touched * (3 * H * I + 3 * r * (H + I)) * 2
    flops = 2 * T * k * 3 * H * I
    one = max(bytes_ / bw_gbs / 1e9, flops / peak_gflops / 1e9) * 1e3
    # backward with frozen base weights re-reads the touched weights and does ~2× the base FLOPs of forward
    return one if op == "fwd" else one + max(bytes_ / bw_gbs / 1e9, 2 * flops / peak_gflops / 1e9) * 1e3


# ------------------------------------------------------------------------------------------------ baselines


def torch_loop(x, ids, w, gate, up, down, lora, scale):
    """Plain torch bf16 per-expert loop (argsort grouping, base + LoRA matmuls, index_add combine)."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=gate.shape[0]).tolist()
    tok = order // k
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        t = tok[start : start + n]
        start += n
        xe = x[t]
        g = xe @ gate[e].T + scale * (xe @ lora["gate_a"][e].T) @ lora["gate_b"][e].T
        u = xe @ up[e].T + scale * (xe @ lora["up_a"][e].T) @ lora["up_b"][e].T
        h = F.silu(g) * u
        y = h @ down[e].T + scale * (h @ lora["down_a"][e].T) @ lora["down_b"][e].T
        out.index_add_(0, t, (y.float() * w.reshape(-1)[sel, None]))
    return out.to(x.dtype)


class KTKernel:
    """kt-kernel 0.7.2's SFT MoE (AMXSFTMoEWrapper), when importable."""

    def __init__(self, gate, up, down, lora, alpha, T_max, threads, topk):
        from kt_kernel.sft.amx import AMXSFTMoEWrapper

        E, I, H = gate.shape
        r = lora["gate_a"].shape[1]
        self.w = AMXSFTMoEWrapper(
            layer_idx=0, num_experts=E, num_experts_per_tok=topk, hidden_size=H, moe_intermediate_size=I,
            num_gpu_experts=0, cpuinfer_threads=threads, threadpool_count=1, weight_path=None,
            chunked_prefill_size=T_max, lora_rank=r, lora_alpha=alpha, method="AMXBF16_SFT",
        )
        self.grads = {f"grad_{n}": torch.zeros_like(v) for n, v in lora.items()}
        kt_names = {"gate_a": "gate_lora_a", "gate_b": "gate_lora_b", "up_a": "up_lora_a", "up_b": "up_lora_b",
                    "down_a": "down_lora_a", "down_b": "down_lora_b"}
        self.w.init_lora_weights(
            **{kt_names[n]: v for n, v in lora.items()}, **{f"grad_{kt_names[n]}": g for n, g in
                                                            zip(lora, self.grads.values())}
        )
        self.w.load_weights_from_tensors(gate, up, down, torch.arange(E))

    def forward(self, x, ids, w, save=False):
        return self.w.forward(x, ids, w, save_for_backward=save)

    def fwd_bwd(self, x, ids, w, gy):
        self.w.forward(x, ids, w, save_for_backward=True)
        return self.w.backward(gy)


def load_kt(gate, up, down, lora, alpha, T_max, threads, topk):
    try:
        return KTKernel(gate, up, down, lora, alpha, T_max, threads, topk), None
    except Exception as exc:  # not installed, or no usable build for this CPU
        return None, f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="0 = physical cores")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--layers", type=int, default=3, help="independent weight sets cycled call by call")
    ap.add_argument("--isa", default="auto",
                    help="kernel table(s), comma separated (auto, portable, avx2, avx512_bf16, amx_bf16)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch bf16 baseline")
    ap.add_argument("--no-kt", action="store_true", help="skip kt-kernel even if installed")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    isas = [s.strip() for s in args.isa.split(",") if s.strip()]

    set_num_threads(args.threads)
    threads = num_threads()
    torch.set_num_threads(threads)
    E, H, I, k, r = args.experts, args.hidden, args.intermediate, args.topk, args.rank
    alpha = 2.0 * r
    torch.manual_seed(0)
    L = args.layers
    weights = [tuple((torch.randn(*s) * 0.02).bfloat16() for s in ((E, I, H), (E, I, H), (E, H, I))) for _ in range(L)]
    lora = {
        "gate_a": (torch.randn(E, r, H) * 0.02).bfloat16(), "gate_b": (torch.randn(E, I, r) * 0.02).bfloat16(),
        "up_a": (torch.randn(E, r, H) * 0.02).bfloat16(), "up_b": (torch.randn(E, I, r) * 0.02).bfloat16(),
        "down_a": (torch.randn(E, r, I) * 0.02).bfloat16(), "down_b": (torch.randn(E, H, r) * 0.02).bfloat16(),
    }
    lora_obj = ExpertLoRA(**lora, alpha=alpha)

    print(f"kt_serve kernel bench: H={H} I={I} E={E} top-{k} r={r}, {threads} threads, isa={','.join(isas)} "
          f"(auto = {cpu_isa()}), "
          f"{L} layers cycled, torch {torch.__version__}", flush=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.2f} before the run: other processes will skew these figures", flush=True)
    bw, peak = measure_bandwidth_gbs(), measure_bf16_peak_gflops()
    print(f"machine: read bandwidth {bw:.1f} GB/s, torch bf16 GEMM {peak:.0f} GFLOP/s", flush=True)

    grads = ExpertLoRA(*(torch.zeros(v.shape) for v in lora.values()), alpha=alpha)

    def build_ours(isa):
        mods = []
        for gate, up, down in weights:
            m = MoEExperts(gate, up, down, max_tokens=max(args.tokens), isa=isa)
            m.set_adapter(0, lora_obj)
            m.set_grad_buffers(0, grads)
            mods.append(m)
        return mods

    kts, kt_err = [], "skipped (--no-kt)"
    if not args.no_kt:
        for gate, up, down in weights:
            kt, kt_err = load_kt(gate, up, down, lora, alpha, max(args.tokens), threads, k)
            if kt is None:
                kts = []
                break
            kts.append(kt)
    if not kts:
        print(f"kt-kernel: not measured ({kt_err})", flush=True)
    cycle = {"ours": 0, "torch": 0, "kt": 0}

    def next_layer(name):
        cycle[name] = (cycle[name] + 1) % L
        return cycle[name]
    tl = {n: v.clone().requires_grad_(True) for n, v in lora.items()}

    inputs = {}
    for T in args.tokens:
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, H, generator=g).bfloat16()
        logits = torch.randn(T, E, generator=g)
        w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).float().contiguous()
        inputs[T] = (x, ids.contiguous(), w, torch.randn(T, H, generator=g).bfloat16())

    rows, baselines = [], {}  # baselines[(T, op)] = (torch min ms, kt min ms), measured with the first table
    for isa in isas:
        ours = build_ours(isa)  # one table's packed weights at a time
        for T in args.tokens:
            x, ids, w, gy = inputs[T]
            rep = args.repeats if T <= 64 else max(3, args.repeats // 2)

            def ours_fwd():
                ours[next_layer("ours")].forward_sft(x, ids, w, slots=0)

            def ours_fb():
                m = ours[next_layer("ours")]
                m.forward_sft(x, ids, w, save_for_backward=True, slots=0)
                m.backward(gy)

            def torch_fwd():
                with torch.no_grad():
                    torch_loop(x, ids, w, *weights[next_layer("torch")], lora, alpha / r)

            def torch_fb():
                xs = x.clone().requires_grad_(True)
                ws = w.clone().requires_grad_(True)
                torch_loop(xs, ids, ws, *weights[next_layer("torch")], tl, alpha / r).backward(gy)

            def kt_fwd():
                kts[next_layer("kt")].forward(x, ids, w)

            def kt_fb():
                kts[next_layer("kt")].fwd_bwd(x, ids, w, gy)

            for op, fn_ours, fn_torch, fn_kt in (
                ("fwd", ours_fwd, torch_fwd, kt_fwd if kts else None),
                ("fwd_bwd", ours_fb, torch_fb, kt_fb if kts else None),
            ):
                o_min, o_med = timeit(fn_ours, rep)
                if (T, op) not in baselines:
                    t_min = None if args.no_torch else timeit(fn_torch, rep)[0]
                    k_min = None if fn_kt is None else timeit(fn_kt, rep)[0]
                    baselines[T, op] = (t_min, k_min)
                t_min, k_min = baselines[T, op]
                roof = roofline_ms(T, E, H, I, k, r, bw, peak, op)
                row = {
                    "isa": ours[0].isa, "T": T, "op": op, "ms": round(o_min, 3), "ms_median": round(o_med, 3),
                    "torch_ms": None if t_min is None else round(t_min, 3),
                    "kt_ms": None if k_min is None else round(k_min, 3),
                    "vs_torch": None if t_min is None else round(t_min / o_min, 3),
                    "vs_kt": None if k_min is None else round(k_min / o_min, 3),
                    "roofline_ms": round(roof, 3), "roofline_pct": round(100 * roof / o_min, 1),
                    "tok_per_s": round(T / (o_min / 1e3), 1),
                }
                rows.append(row)
                print(f"{row['isa']:11s} T={T:4d} {op:8s} ours {o_min:8.2f} / {o_med:8.2f} ms | torch bf16 "
                      + (f"{t_min:8.2f} ms (x{row['vs_torch']:.2f})" if t_min is not None else "     n/a")
                      + " | kt-kernel "
                      + (f"{k_min:8.2f} ms (x{row['vs_kt']:.2f})" if k_min is not None else "     n/a")
                      + f" | roofline {roof:7.2f} ms = {row['roofline_pct']:.0f}%", flush=True)
        del ours

    def fmt(v, suffix=""):
        return "n/a" if v is None else f"{v:.2f}{suffix}"

    print()
    print("| isa | T | op | ours ms (min/median) | torch bf16 ms | vs torch | kt-kernel ms | vs kt | roofline ms "
          "| % roofline |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r_ in rows:
        print(f"| {r_['isa']} | {r_['T']} | {r_['op']} | {r_['ms']:.2f} / {r_['ms_median']:.2f} | "
              f"{fmt(r_['torch_ms'])} | {fmt(r_['vs_torch'], 'x')} | {fmt(r_['kt_ms'])} | {fmt(r_['vs_kt'], 'x')} | "
              f"{r_['roofline_ms']:.2f} | {r_['roofline_pct']:.0f}% |")
    names = list(dict.fromkeys(r_["isa"] for r_ in rows))
    if len(names) > 1:  # each table's time over the first one's (above 1: slower than the first)
        ms = {(r_["isa"], r_["T"], r_["op"]): r_["ms"] for r_ in rows}
        print()
        print("| T | op | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
        print("|---|---|" + "---|" * (len(names) - 1))
        for T in args.tokens:
            for op in ("fwd", "fwd_bwd"):
                print(f"| {T} | {op} | " + " | ".join(f"{ms[n, T, op] / ms[names[0], T, op]:.2f}x" for n in names[1:])
                      + " |")
    if args.json:
        keys = ("isa", "T", "op", "ms", "vs_torch", "vs_kt", "roofline_pct")
        with open(args.json, "w") as f:
            json.dump([{k_: r_[k_] for k_ in keys} for r_ in rows], f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
