"""Benchmark of the MoE-LoRA kernel: forward and forward+backward against a plain torch bf16 per-expert loop and
(when installed) kt-kernel 0.7.2, measured in the same run, plus the share of the roofline reached.

    python evals/bench_kernel.py [--tokens 1 8 64 512] [--isa avx512_bf16,avx2,portable] [--formats bf16,int8,int4,fp8]
                                 [--json FILE] [--threads N]

Default shape: H=2048, I=768, E=64, top-8, r=8 (Qwen3-30B-A3B's experts). Each implementation gets at least
``--layers`` independent weight sets, and for each format as many as make the packed weights twice the L3
cache, and cycles through them call by call, as a model does; each call also takes the next of 16 routings (as
consecutive decode steps pick other experts). So weights come from memory, not from a cache that can hold them
(L3s of 100+ MiB hold several layers of a quantized format). Times are min / median over repeats;
``vs_*`` = baseline time / our time (above 1 means kt_serve is faster). The roofline is max(bytes of the experts
touched / measured memory bandwidth, FLOPs / measured GEMM peak, the faster of torch's bf16 and fp32), both measured here with torch.
Forward rows up to T=64 (decode) are timed in turn: every format of a table, two calls each (the second timed, as
a model's next layer; the first reported as ``after probe``), then a plain streaming read of the same bytes
(``stream``, torch's fp32 sum). So the speed-ups over bf16 compare calls made in the same moments, and ``% of
stream`` = its time / ours is the share of the bandwidth the machine gave then (a VM's moves by 1.5x within
minutes, which a figure from the start of the run cannot follow).
``--isa`` takes a comma list of kernel tables: each gets its own row set (the baselines are measured once), then
every table's time over the first one's per T. ``--formats`` takes a comma list of base-weight formats (bf16, int8,
int4, fp8; csrc/weights/weight_format.h): each (table, format) gets its row set, then each format's speed-up over bf16
on the same table. The torch baseline runs bf16 weights; kt-kernel runs its class for the same format (bf16
AMXBF16_SFT, int8 INT8_SFT, int4 AMXINT4_SFT or ``--kt-int4 RAWINT4_SFT``, fp8 AMXFP8_SFT; see KTKernel), and
``vs_kt`` compares same-format rows. Run it from a venv holding kt-kernel (launch/install_kt_kernel.sh:
``.venv-kt/bin/python evals/bench_kernel.py ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

from kt_serve.kernel.threads import share_cores_with_torch

share_cores_with_torch()  # as the plugin does for the server; before torch loads its OpenMP runtime

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kt_serve.formats.names import KT_TENSOR_NAMES, kt_shapes  # noqa: E402
from kt_serve.kernel.experts import LORA_FIELDS, ExpertLoRA, MoEExperts  # noqa: E402
from kt_serve.kernel.threads import cpu_isa, num_threads, set_num_threads  # noqa: E402
from kt_serve.kernel.weights import expert_bytes  # noqa: E402


ROUTINGS = 16  # inputs per T, one per call in turn
STREAM_MAX_T = 64  # forward rows up to this many tokens are timed in turn with a StreamProbe of the same bytes


def timeit(fn, repeats: int, warmup: int = 2, budget_s: float = 20.0):
    return timeit_turns([fn], repeats, warmup, budget_s)[0]


def timeit_turns(fns, repeats: int, warmup: int = 2, budget_s: float = 20.0):
    """(min, median) ms of each of fns, called in turn: what one measures the others see the machine in."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    start = time.perf_counter()
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - start > budget_s and len(times[0]) >= 3:
            break
    return [(min(t), statistics.median(t)) for t in times]


# ------------------------------------------------------------------------------------------------ machine figures


def measure_bandwidth_gbs(probe: "StreamProbe | None" = None) -> float:
    """Sustained read bandwidth: fp32 sum over a StreamProbe's 1 GiB (bf16 sums take a slow upcast path; see the
    notes)."""
    a = (probe or StreamProbe()).buf
    a.sum()
    best = min(timeit(lambda: a.sum(), 5, warmup=1))
    return a.numel() * 4 / (best / 1e3) / 1e9


def measure_gemm_peak_gflops() -> tuple[float, str]:
    """The faster of torch's bf16 and fp32 GEMM: CPUs without bf16 instructions (AVX2) run bf16 matmuls through a
    slow conversion path, while our kernel computes in fp32 there, so fp32 is the honest compute ceiling."""
    best = (0.0, "")
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(512, 2048).to(dtype), torch.randn(2048, 1536).to(dtype)
        gflops = 2 * 512 * 2048 * 1536 / (min(timeit(lambda: a @ b, 10)) / 1e3) / 1e9
        best = max(best, (gflops, str(dtype).removeprefix("torch.")))
    return best


def cpu_model() -> str:
    """This CPU's model name, as every benchmark's header names it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def l3_bytes() -> int:
    """This CPU's largest cache (sysfs; 32 MiB if unreadable)."""
    best = 0
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KMG")) * unit)
    return best or 32 * 2**20


def touched_bytes(T, E, H, I, k, r, fmt="bf16") -> int:
    """Expected bytes of the experts (base weights and LoRA) one call reads, under uniform top-k."""
    touched = E * (1 - (1 - k / E) ** T)
    return int(touched * (expert_bytes(H, I, fmt) + 3 * r * (H + I) * 2))


class StreamProbe:
    """A plain streaming read, torch's fp32 sum on the same threads, of the bytes a call reads, from a 1 GiB buffer
    walked slice by slice so they come from memory. Timed in turn with our calls (timeit_turns): the bandwidth
    a VM gets moves by 1.5x within minutes, so one figure from the start of the run would not say how close a call
    came to it."""

    def __init__(self, size_bytes: int = 2**30):
        self.buf = torch.ones(size_bytes // 4, dtype=torch.float32)
        self.pos = 0

    def read(self, nbytes: int) -> None:
        n = min(nbytes // 4, self.buf.numel())
        if self.pos + n > self.buf.numel():
            self.pos = 0
        self.buf[self.pos : self.pos + n].sum()
        self.pos += n


def roofline_ms(T, E, H, I, k, r, bw_gbs, peak_gflops, op, fmt="bf16"):
    bytes_ = touched_bytes(T, E, H, I, k, r, fmt)
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


# kt-kernel 0.7.2's SFT method for each of our formats. On a CPU without AMX the wheel loads its avx512_bf16 build,
# whose "AMX" classes run AVX512 kernels (all five here run on an AVX512-BF16 / VNNI CPU). int8 and AMXINT4_SFT scale
# per output channel; --kt-int4 RAWINT4_SFT takes kt's group-32 int4 instead (LoRA rank 8 only).
KT_METHODS = {"bf16": "AMXBF16_SFT", "int8": "INT8_SFT", "int4": "AMXINT4_SFT", "fp8": "AMXFP8_SFT"}


def fp8_blocks(W, block=128):
    """[E, N, K] -> e4m3 [E, N, K] and fp32 scales [E, N/128, K/128] (W = q · s), as an FP8 checkpoint stores them."""
    E, N, K = W.shape
    b = W.float().reshape(E, N // block, block, K // block, block)
    s = b.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448
    return (b / s[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(E, N, K), s.contiguous()


def int4_groups(W, group=32):
    """[E, N, K] -> signed symmetric int4 in bytes [E, N, K/2] (q + 8, low nibble first, compressed-tensors'
    pack-quantized order) and bf16 scales [E, N, K/group]."""
    E, N, K = W.shape
    b = W.float().reshape(E, N, K // group, group)
    s = (b.abs().amax(-1).clamp_min(1e-12) / 7).bfloat16()
    q = ((b / s.float()[..., None]).round().clamp(-8, 7) + 8).to(torch.uint8).reshape(E, N, K)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous(), s.contiguous()


class KTKernel:
    """kt-kernel 0.7.2's SFT MoE (AMXSFTMoEWrapper) running ``method`` on one weight set, when importable. How each
    method takes its base weights: AMXBF16_SFT the bf16 tensors; AMXINT4_SFT the bf16 tensors, quantized by kt at
    load; INT8_SFT only pre-quantized .kt files, written here by kt's own quantizer (the inference AMXInt8_MOE with
    save=True, what kt's convert_cpu_weights.py runs through a wrapper that needs CUDA pinned memory); AMXFP8_SFT e4m3
    with 128 × 128 block scales and RAWINT4_SFT packed group-32 int4, both quantized here (fp8_blocks, int4_groups).
    INT8 and FP8 require share_backward_bb (backward repacks the transposed weights into one buffer shared by the
    layers, which then need distinct layer ids)."""

    def __init__(self, method, layer_idx, gate, up, down, lora, alpha, T_max, threads, topk):
        from kt_kernel.sft.amx import AMXSFTMoEWrapper

        E, I, H = gate.shape
        r = lora["gate_a"].shape[1]
        experts = torch.arange(E)
        with tempfile.TemporaryDirectory() as kt_dir:  # INT8_SFT's .kt files, read into memory by load_weights
            self.w = AMXSFTMoEWrapper(
                layer_idx=layer_idx, num_experts=E, num_experts_per_tok=topk, hidden_size=H, moe_intermediate_size=I,
                num_gpu_experts=0, cpuinfer_threads=threads, threadpool_count=1, weight_path=kt_dir,
                chunked_prefill_size=T_max, lora_rank=r, lora_alpha=alpha, method=method,
            )
            self.w.share_backward_bb = method in ("INT8_SFT", "AMXFP8_SFT")  # read when the C++ object is built
            self.grads = {f"grad_{n}": torch.zeros_like(v) for n, v in lora.items()}
            kt_names = dict(zip(LORA_FIELDS, KT_TENSOR_NAMES))
            self.w.init_lora_weights(
                **{kt_names[n]: v for n, v in lora.items()}, **{f"grad_{kt_names[n]}": g for n, g in
                                                                zip(lora, self.grads.values())}
            )
            projs = {"gate": gate, "up": up, "down": down}
            if method == "INT8_SFT":
                self._write_int8_kt(kt_dir, layer_idx, gate, up, down, topk, experts)
                self.w.load_weights(experts)
            elif method == "AMXFP8_SFT":
                from kt_kernel.sft.weights import BlockFP8ExpertWeights

                q = {n: fp8_blocks(t) for n, t in projs.items()}
                self.w.load_block_fp8_weights(BlockFP8ExpertWeights(
                    **{f"{n}_proj": list(v[0]) for n, v in q.items()},
                    **{f"{n}_scale": list(v[1]) for n, v in q.items()}), experts)
            elif method == "RAWINT4_SFT":
                from kt_kernel.sft.weights import RAWINT4ExpertWeights

                q = {n: int4_groups(t) for n, t in projs.items()}
                self.w.load_rawint4_weights(RAWINT4ExpertWeights(
                    **{f"{n}_proj": v[0] for n, v in q.items()}, **{f"{n}_scale": v[1] for n, v in q.items()}), experts)
            else:
                self.w.load_weights_from_tensors(gate, up, down, experts)

    def _write_int8_kt(self, path, layer_idx, gate, up, down, topk, experts):
        from kt_kernel_ext.moe import MOEConfig, AMXInt8_MOE

        E, I, H = gate.shape
        on_gpu = torch.zeros(E, dtype=torch.bool)
        cfg = MOEConfig(E, topk, H, I, on_gpu.data_ptr())
        cfg.layer_idx, cfg.pool, cfg.max_len = layer_idx, self.w.cpu_infer.backend_, self.w._aligned_max_len()
        cfg.save, cfg.load, cfg.path = True, False, path
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
        quantizer = AMXInt8_MOE(cfg)
        self.w.cpu_infer.submit(quantizer.load_weights_task(experts.data_ptr()))
        self.w.cpu_infer.sync()

    def forward(self, x, ids, w, save=False):
        return self.w.forward(x, ids, w, save_for_backward=save)

    def fwd_bwd(self, x, ids, w, gy):
        self.w.forward(x, ids, w, save_for_backward=True)
        return self.w.backward(gy)


def load_kt(method, weights, lora, alpha, T_max, threads, topk, first_layer):
    """One KTKernel per weight set (layer ids from first_layer on), or ([], why) when kt-kernel cannot run it."""
    try:
        return [KTKernel(method, first_layer + i, *w, lora, alpha, T_max, threads, topk)
                for i, w in enumerate(weights)], None
    except Exception as exc:  # not installed, or no usable build / method for this CPU
        return [], f"{type(exc).__name__}: {exc}"


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
    ap.add_argument("--formats", default="bf16", help="base weight format(s), comma separated (bf16, int8, int4, fp8)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch bf16 baseline")
    ap.add_argument("--no-kt", action="store_true", help="skip kt-kernel even if installed")
    ap.add_argument("--kt-int4", default="AMXINT4_SFT", choices=("AMXINT4_SFT", "RAWINT4_SFT"),
                    help="kt-kernel's class for int4: per-channel AMXINT4_SFT, or group-32 RAWINT4_SFT (rank 8 only)")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    isas = [s.strip() for s in args.isa.split(",") if s.strip()]
    formats = [s.strip() for s in args.formats.split(",") if s.strip()]

    set_num_threads(args.threads)
    threads = num_threads()
    torch.set_num_threads(threads)
    E, H, I, k, r = args.experts, args.hidden, args.intermediate, args.topk, args.rank
    alpha = 2.0 * r
    torch.manual_seed(0)
    L = args.layers
    weights = [tuple((torch.randn(*s) * 0.02).bfloat16() for s in ((E, I, H), (E, I, H), (E, H, I))) for _ in range(L)]
    lora = {f: (torch.randn(*s) * 0.02).bfloat16() for f, s in zip(LORA_FIELDS, kt_shapes(E, H, I, r).values())}
    lora_obj = ExpertLoRA(**lora, alpha=alpha)

    print(f"kt_serve kernel bench on {cpu_model()}: H={H} I={I} E={E} top-{k} r={r}, {threads} threads, isa={','.join(isas)} "
          f"(auto = {cpu_isa()}), "
          f"{L} layers cycled, torch {torch.__version__}", flush=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.2f} before the run: other processes will skew these figures", flush=True)
    probe = StreamProbe()
    bw, (peak, peak_dtype) = measure_bandwidth_gbs(probe), measure_gemm_peak_gflops()
    print(f"machine: read bandwidth {bw:.1f} GB/s, torch GEMM peak {peak:.0f} GFLOP/s ({peak_dtype})", flush=True)

    grads = ExpertLoRA(*(torch.zeros(v.shape) for v in lora.values()), alpha=alpha)

    def layers_for(fmt):  # weight sets whose packed bytes are >= 2 × L3 (copies of the L sources)
        layer_bytes = E * expert_bytes(H, I, fmt)
        return max(L, -(-2 * l3_bytes() // int(layer_bytes)))

    def build_ours(isa, fmt):
        mods = []
        for i in range(layers_for(fmt)):
            gate, up, down = weights[i % L]
            m = MoEExperts(gate, up, down, max_tokens=max(args.tokens), isa=isa, weight_format=fmt)
            m.set_adapter(0, lora_obj)
            m.set_grad_buffers(0, grads)
            mods.append(m)
        return mods

    kt_methods = {**KT_METHODS, "int4": args.kt_int4}
    kt_layers = [0]  # layer ids handed out: layers sharing kt's backward buffer need distinct ones

    def build_kt(fmt):
        if args.no_kt:
            return []
        n = layers_for(fmt)
        kts, err = load_kt(kt_methods[fmt], [weights[i % L] for i in range(n)], lora, alpha, max(args.tokens), threads,
                           k, kt_layers[0])
        kt_layers[0] += n
        print(f"kt-kernel {fmt}: {kt_methods[fmt]} " + (f"({n} layers loaded)" if kts else f"not measured ({err})"),
              flush=True)
        return kts

    if args.no_kt:
        print("kt-kernel: not measured (--no-kt)", flush=True)
    cycle = {}  # name -> the last of its weight sets (or routings) used

    def next_of(name, items):
        cycle[name] = (cycle.get(name, 0) + 1) % len(items)
        return items[cycle[name]]
    tl = {n: v.clone().requires_grad_(True) for n, v in lora.items()}

    inputs = {}  # T -> ROUTINGS inputs (x, ids, w, grad_out), taken in turn
    for T in args.tokens:
        g = torch.Generator().manual_seed(T)
        inputs[T] = []
        for _ in range(ROUTINGS):
            x = torch.randn(T, H, generator=g).bfloat16()
            w, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(k, dim=-1)
            w = (w / w.sum(-1, keepdim=True)).float().contiguous()
            inputs[T].append((x, ids.contiguous(), w, torch.randn(T, H, generator=g).bfloat16()))

    def step(T):
        return next_of(f"route{T}", inputs[T])

    def ours_fwd(T, mods, fmt):
        def fn():
            x, ids, w, _ = step(T)
            next_of(f"ours:{fmt}", mods).forward_sft(x, ids, w, slots=0)
        return fn

    def stream_read(T, fmt):
        nbytes = touched_bytes(T, E, H, I, k, r, fmt)
        return lambda: probe.read(nbytes)

    # torch_ms[T, op] (bf16) and kt_ms[T, op, fmt] (kt-kernel's class for fmt): min ms, measured with the first table
    rows, torch_ms, kt_ms = [], {}, {}
    for isa in isas:
        all_ours = {fmt: build_ours(isa, fmt) for fmt in formats}  # one table's packed weights, every format, at a time
        # Decode forward rows: every format and its StreamProbe read called in turn, so the speed-ups over bf16 and
        # the shares of the stream compare calls made in the same moments. Each format's turn is two calls (other
        # weight sets, other routings: consecutive layers), then its probe. The first call follows the previous
        # probe and pays 0.07-0.14 ms for it on a 2-core VM (as after any pause of a millisecond or two, in every
        # format, workers spinning or not), which a model's layers, called one after the other, do not. The second
        # is the figure the tables and speed-ups use; the first is reported beside it ("after probe").
        decode = {}
        for T in [T for T in args.tokens if T <= STREAM_MAX_T]:
            fns = [f for fmt in formats for f in (ours_fwd(T, all_ours[fmt], fmt), ours_fwd(T, all_ours[fmt], fmt),
                                                  stream_read(T, fmt))]
            times = timeit_turns(fns, args.repeats * 2)
            for i, fmt in enumerate(formats):
                decode[fmt, T] = times[3 * i + 1], times[3 * i + 2][0], times[3 * i][0]
            del fns
        for fmt in formats:
            ours = all_ours.pop(fmt)  # freed once its rows are measured
            kts = build_kt(fmt) if isa == isas[0] else []
            # One backward per weight set before timing: its first call sizes the layer's saved state and scratch.
            x, ids, w, gy = step(min(args.tokens))
            for m in ours:
                m.forward_sft(x, ids, w, save_for_backward=True, slots=0)
                m.backward(gy)
            for T in args.tokens:
                rep = args.repeats if T <= 64 else max(3, args.repeats // 2)

                def ours_fb():
                    x, ids, w, gy = step(T)
                    m = next_of(f"ours:{fmt}", ours)
                    m.forward_sft(x, ids, w, save_for_backward=True, slots=0)
                    m.backward(gy)

                def torch_fwd():
                    x, ids, w, _ = step(T)
                    with torch.no_grad():
                        torch_loop(x, ids, w, *next_of("torch", weights), lora, alpha / r)

                def torch_fb():
                    x, ids, w, gy = step(T)
                    xs = x.clone().requires_grad_(True)
                    ws = w.clone().requires_grad_(True)
                    torch_loop(xs, ids, ws, *next_of("torch", weights), tl, alpha / r).backward(gy)

                def kt_fwd():
                    x, ids, w, _ = step(T)
                    next_of(f"kt:{fmt}", kts).forward(x, ids, w)

                def kt_fb():
                    x, ids, w, gy = step(T)
                    next_of(f"kt:{fmt}", kts).fwd_bwd(x, ids, w, gy)

                for op, fn_ours, fn_torch, fn_kt in (
                    ("fwd", ours_fwd(T, ours, fmt), torch_fwd, kt_fwd if kts else None),
                    ("fwd_bwd", ours_fb, torch_fb, kt_fb if kts else None),
                ):
                    if op == "fwd" and (fmt, T) in decode:
                        (o_min, o_med), s_min, first_min = decode[fmt, T]
                    else:
                        (o_min, o_med), s_min, first_min = timeit(fn_ours, rep), None, None
                    if (T, op) not in torch_ms:
                        torch_ms[T, op] = None if args.no_torch else timeit(fn_torch, rep)[0]
                    if fn_kt is not None and (T, op, fmt) not in kt_ms:
                        kt_ms[T, op, fmt] = timeit(fn_kt, rep)[0]
                    t_min, k_min = torch_ms[T, op], kt_ms.get((T, op, fmt))
                    roof = roofline_ms(T, E, H, I, k, r, bw, peak, op, fmt)
                    row = {
                        "isa": ours[0].isa, "format": fmt, "T": T, "op": op, "ms": round(o_min, 3), "ms_median": round(o_med, 3),
                        "torch_ms": None if t_min is None else round(t_min, 3),
                        "kt_method": None if k_min is None else kt_methods[fmt],
                        "kt_ms": None if k_min is None else round(k_min, 3),
                        "vs_torch": None if t_min is None else round(t_min / o_min, 3),
                        "vs_kt": None if k_min is None else round(k_min / o_min, 3),
                        "roofline_ms": round(roof, 3), "roofline_pct": round(100 * roof / o_min, 1),
                        "stream_ms": None if s_min is None else round(s_min, 3),
                        "stream_pct": None if s_min is None else round(100 * s_min / o_min, 1),
                        "after_probe_ms": None if first_min is None else round(first_min, 3),
                        "tok_per_s": round(T / (o_min / 1e3), 1),
                    }
                    rows.append(row)
                    print(f"{row['isa']:11s} {fmt:4s} T={T:4d} {op:8s} ours {o_min:8.2f} / {o_med:8.2f} ms | torch bf16 "
                          + (f"{t_min:8.2f} ms (x{row['vs_torch']:.2f})" if t_min is not None else "     n/a")
                          + " | kt-kernel "
                          + (f"{k_min:8.2f} ms (x{row['vs_kt']:.2f})" if k_min is not None else "     n/a")
                          + f" | roofline {roof:7.2f} ms = {row['roofline_pct']:.0f}%"
                          + ("" if s_min is None else f" | stream {s_min:7.2f} ms = {row['stream_pct']:.0f}%")
                          + ("" if first_min is None else f" | after probe {first_min:7.2f} ms"), flush=True)
            del ours, kts

    def fmt(v, suffix=""):
        return "n/a" if v is None else f"{v:.2f}{suffix}"

    print()
    print("| isa | format | T | op | ours ms (min/median) | torch bf16 ms | vs torch | kt-kernel ms | vs kt "
          "| roofline ms | % roofline | stream ms | % of stream | ms after probe |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r_ in rows:
        print(f"| {r_['isa']} | {r_['format']} | {r_['T']} | {r_['op']} | {r_['ms']:.2f} / {r_['ms_median']:.2f} | "
              f"{fmt(r_['torch_ms'])} | {fmt(r_['vs_torch'], 'x')} | {fmt(r_['kt_ms'])} | {fmt(r_['vs_kt'], 'x')} | "
              f"{r_['roofline_ms']:.2f} | {r_['roofline_pct']:.0f}% | {fmt(r_['stream_ms'])} | "
              + ("n/a" if r_["stream_pct"] is None else f"{r_['stream_pct']:.0f}%") + f" | {fmt(r_['after_probe_ms'])} |")
    names = list(dict.fromkeys(r_["isa"] for r_ in rows))
    ms = {(r_["isa"], r_["format"], r_["T"], r_["op"]): r_["ms"] for r_ in rows}
    if len(names) > 1:  # each table's time over the first one's, per format (above 1: slower than the first)
        print()
        print("| format | T | op | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
        print("|---|---|---|" + "---|" * (len(names) - 1))
        for fmt in formats:
            for T in args.tokens:
                for op in ("fwd", "fwd_bwd"):
                    print(f"| {fmt} | {T} | {op} | "
                          + " | ".join(f"{ms[n, fmt, T, op] / ms[names[0], fmt, T, op]:.2f}x" for n in names[1:]) + " |")
    quantized = [f for f in formats if f != "bf16"]
    if "bf16" in formats and quantized:  # each format's speed-up over bf16 on the same table (above 1: faster)
        print()
        print("| isa | T | op | " + " | ".join(f"{f} speed-up over bf16" for f in quantized) + " |")
        print("|---|---|---|" + "---|" * len(quantized))
        after = {(r_["isa"], r_["format"], r_["T"]): r_["after_probe_ms"] for r_ in rows
                 if r_["after_probe_ms"] is not None}
        for n in names:
            for T in args.tokens:
                for op in ("fwd", "fwd_bwd"):
                    print(f"| {n} | {T} | {op} | "
                          + " | ".join(f"{ms[n, 'bf16', T, op] / ms[n, f, T, op]:.2f}x" for f in quantized) + " |")
                if all((n, f, T) in after for f in formats):  # the same, each call the first after the probe
                    print(f"| {n} | {T} | fwd after probe | "
                          + " | ".join(f"{after[n, 'bf16', T] / after[n, f, T]:.2f}x" for f in quantized) + " |")
    if args.json:
        keys = ("isa", "format", "T", "op", "ms", "vs_torch", "kt_method", "vs_kt", "roofline_pct", "stream_pct",
                "after_probe_ms")
        with open(args.json, "w") as f:
            json.dump([{k_: r_[k_] for k_ in keys} for r_ in rows], f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
