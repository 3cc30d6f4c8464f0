"""Speed of kt_serve's torch stand-ins for the Qwen3.5 / Gated DeltaNet CPU ops (kt_serve/sglang_plugin/models/qwen35_gdn.py,
qwen35.py), called through torch.ops.sgl_kernel as SGLang 0.5.23 calls them.

    python evals/bench_gdn.py [--batches 1 8] [--prefill 512] [--threads N] [--json FILE]

Shapes of Qwen3.5-35B-A3B: GDN layers with 16 key / 32 value heads of 128 (conv dim 8192, kernel 4, fp32 state
[32, 128, 128] per request), full-attention layers with 16 query / 2 KV heads of 256 and an output gate. Decode rows
time one layer's op for a batch of requests whose state slots are scattered in the pool (``slots``) or a contiguous
run (``run``, always so for one request); prefill rows one 512-token sequence and four of 128. Times are
min / median milliseconds over repeats; ``x30`` is the median times the model's 30 GDN layers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from kt_serve.kernel.threads import share_cores_with_torch

share_cores_with_torch()  # as the plugin does for the server; before torch loads its OpenMP runtime

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernel import cpu_model  # noqa: E402
from kt_serve import _kernel  # noqa: E402
from kt_serve.sglang_plugin.models import qwen35_gdn  # noqa: E402
from kt_serve.sglang_plugin.hooks import FLA_GATED_RMS_NORM  # noqa: E402
from kt_serve.sglang_plugin.models.qwen35 import install_qwen35_cpu_ops, rms_norm_gated_forward_hook  # noqa: E402

HK, HV, D, WIDTH = 16, 32, 128, 4
CONV_DIM = 2 * HK * D + HV * D
ATTN_HEADS, ATTN_KV, ATTN_D = 16, 2, 256
GDN_LAYERS = 30
BF = torch.bfloat16


def gated_norm(weight):
    """SGLang's fla RMSNorm module as Qwen3.5 builds it (norm before a SiLU gate), run through the plugin's hook."""
    import importlib

    module = importlib.import_module(FLA_GATED_RMS_NORM.rsplit(".", 1)[0]).RMSNorm(
        D, eps=1e-6, group_size=None, norm_before_gate=True, dtype=BF)
    with torch.no_grad():
        module.weight.copy_(weight)
    return lambda x, z: rms_norm_gated_forward_hook(None, module, x, z)


def timeit(fn, budget_s=0.6, min_reps=5, max_reps=200):
    fn()
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), statistics.median(times)


def decode_cases(batch: int, ops):
    g = torch.Generator().manual_seed(batch)
    rnd = lambda *shape, dtype=BF: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    slots = 4 * batch + 4
    conv_pool = rnd(slots, CONV_DIM, WIDTH - 1)
    ssm_pool = rnd(slots, HV, D, D, dtype=torch.float32) * 0.1
    weight, bias = rnd(CONV_DIM, WIDTH), None
    x = rnd(batch, CONV_DIM)
    q, k, v = rnd(1, batch, HK, D), rnd(1, batch, HK, D), rnd(1, batch, HV, D)
    a, b, A_log, dt_bias = rnd(batch, HV), rnd(batch, HV), torch.rand(HV, generator=g), rnd(HV)
    scattered = torch.arange(batch, dtype=torch.int32) * 3 + 1  # slots 1, 4, 7, ...
    run = torch.arange(batch, dtype=torch.int32) + 2
    cu = torch.arange(batch + 1, dtype=torch.int32)
    qkvz, ba = rnd(batch, 2 * HK * D + 2 * HV * D), rnd(batch, 2 * HV)
    core, z, norm_w = rnd(batch * HV, D), rnd(batch, HV, D), rnd(D)
    norm = gated_norm(norm_w)
    qkv = rnd(batch, (2 * ATTN_HEADS + 2 * ATTN_KV) * ATTN_D)
    q_gate, k_att, _ = qkv.split([2 * ATTN_HEADS * ATTN_D, ATTN_KV * ATTN_D, ATTN_KV * ATTN_D], dim=-1)
    attn_out, gate = rnd(batch, ATTN_HEADS * ATTN_D), rnd(batch, ATTN_HEADS * ATTN_D) + 6  # in place, repeated

    def delta(indices):
        return lambda: ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log, dt_bias, q, k, v, a, b, ssm_pool, indices, cu, True, 1.0, 20.0)

    for name, shape, fn in [
        ("causal_conv1d_update_cpu", f"[{batch}, {CONV_DIM}], K={WIDTH}, slots",
         lambda: ops.causal_conv1d_update_cpu(x, conv_pool, weight, bias, True, None, scattered, -1, False)),
        ("fused_sigmoid_gating_delta_rule_update_cpu", f"Hk {HK} / Hv {HV} x {D}, slots", delta(scattered)),
        ("fused_sigmoid_gating_delta_rule_update_cpu", f"Hk {HK} / Hv {HV} x {D}, run", delta(run)),
        ("fused_gdn_gating_cpu", f"[{batch}, {HV}]", lambda: ops.fused_gdn_gating_cpu(A_log, a, b, dt_bias)),
        ("fused_qkvzba_split_reshape_cat_contiguous_cpu", f"[{batch}, {qkvz.shape[1]}]",
         lambda: ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, HK, HV, D, D)),
        ("RMSNormGated (hook)", f"[{batch * HV}, {D}]", lambda: norm(core, z)),
        ("fused_qk_gemma_rmsnorm_with_gate_cpu", f"{ATTN_HEADS}/{ATTN_KV} heads x {ATTN_D}",
         lambda: ops.fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k_att, norm_w.repeat(2), norm_w.repeat(2), 1e-6,
                                                          ATTN_D, ATTN_HEADS)),
        ("fused_sigmoid_mul_cpu", f"[{batch}, {ATTN_HEADS * ATTN_D}]",
         lambda: ops.fused_sigmoid_mul_cpu(attn_out, gate)),
    ]:
        yield "decode", batch, name, shape, fn


def on_torch(fn):
    """fn with qwen35_gdn's torch formulas instead of csrc/ops/gdn.cpp."""
    qwen35_gdn.USE_KERNEL = False
    try:
        return fn()
    finally:
        qwen35_gdn.USE_KERNEL = True


def prefill_cases(tokens: int, ops):
    g = torch.Generator().manual_seed(tokens)
    rnd = lambda *shape, dtype=BF: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    for n_seq in (1, 4):
        slots = n_seq + 2
        conv_pool, ssm_pool = rnd(slots, CONV_DIM, WIDTH - 1), torch.zeros(slots, HV, D, D)
        x = rnd(tokens, CONV_DIM)
        weight = rnd(CONV_DIM, WIDTH)
        qsl = torch.linspace(0, tokens, n_seq + 1).to(torch.int32)
        idx = torch.arange(n_seq, dtype=torch.int32) + 1
        has_init = torch.zeros(n_seq, dtype=torch.bool)
        q, k, v = rnd(1, tokens, HK, D), rnd(1, tokens, HK, D), rnd(1, tokens, HV, D)
        gate_g, beta = -torch.rand(1, tokens, HV, generator=g) * 0.1, torch.rand(1, tokens, HV, generator=g).to(BF)
        a, b, A_log, dt_bias = rnd(tokens, HV), rnd(tokens, HV), torch.rand(HV, generator=g), rnd(HV)
        core, z, norm_w = rnd(tokens * HV, D), rnd(tokens, HV, D), rnd(D)
        norm = gated_norm(norm_w)
        label = f"{n_seq} x {tokens // n_seq} tokens"
        conv = lambda: ops.causal_conv1d_fwd_cpu(x.t(), weight, None, conv_pool, qsl, idx, has_init, True,  # noqa: E731
                                                 -1, False)
        yield ("prefill", tokens, "causal_conv1d_fwd_cpu", f"{label}, dim {CONV_DIM}", conv)
        yield ("prefill", tokens, "causal_conv1d_fwd_cpu (torch reference)", f"{label}, dim {CONV_DIM}",
               lambda: on_torch(conv))
        delta_rule = lambda: ops.chunk_gated_delta_rule_cpu(q, k, v, gate_g, beta, ssm_pool, True, qsl,  # noqa: E731
                                                            False, True, idx)
        yield ("prefill", tokens, "chunk_gated_delta_rule_cpu", f"{label}, Hk {HK} / Hv {HV} x {D}", delta_rule)
        yield ("prefill", tokens, "chunk_gated_delta_rule_cpu (torch chunked reference)",
               f"{label}, Hk {HK} / Hv {HV} x {D}", lambda: on_torch(delta_rule))
        if n_seq == 1:
            yield ("prefill", tokens, "fused_gdn_gating_cpu", f"[{tokens}, {HV}]",
                   lambda: ops.fused_gdn_gating_cpu(A_log, a, b, dt_bias))
            yield ("prefill", tokens, "RMSNormGated (hook)", f"[{tokens * HV}, {D}]",
                   lambda: norm(core, z))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    install_qwen35_cpu_ops()
    ops = torch.ops.sgl_kernel
    rows = []
    with torch.inference_mode():
        cases = [c for batch in args.batches for c in decode_cases(batch, ops)] + list(prefill_cases(args.prefill, ops))
        for phase, size, name, shape, fn in cases:
            lo, med = timeit(fn)
            rows.append(dict(phase=phase, size=size, op=name, shape=shape, min_ms=lo, median_ms=med))
            print(f"  {phase} {size} {name} {shape}: {med:.3f} ms", file=sys.stderr)
    print(f"CPU: {cpu_model()}, kernel ISA {_kernel.cpu_isa()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print("| phase | batch / tokens | op | shape | min ms | median ms | x30 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        x30 = f"{r['median_ms'] * GDN_LAYERS:.2f}" if "delta_rule" in r["op"] or "conv1d" in r["op"] else ""
        print(f"| {r['phase']} | {r['size']} | {r['op']} | {r['shape']} | {r['min_ms']:.3f} | {r['median_ms']:.3f} "
              f"| {x30} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_model(), threads=torch.get_num_threads(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
