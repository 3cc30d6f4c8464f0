"""Serving benchmark: decode tok/s and peak server RSS, kt_serve plugin vs SGLang's own CPU MoE path, one run.

    python evals/bench_serving.py [--out DIR] [--preset small|qwen3-30b-a3b|qwen3_5-moe|qwen3_5-35b-a3b] [--family F] [--layers N] [--tokens 64] [--streams 1 8] [--llama-server PATH]
                                  [--hidden H --moe-intermediate I --experts E --top-k K --vocab V]

Presets (single flags override them):
  small          hidden 1024, moe_intermediate 512, 64 experts top-8, 8 layers, 4 heads: Python and per-op
                 overhead weigh as much as weights (the overhead-sensitive row set)
  qwen3_5-moe    the small shape as a Qwen3.5-MoE (3 Gated DeltaNet linear-attention layers to 1 full-attention
                 layer, shared expert); its rows add "kt moe off" (the plugin's CPU GDN ops, SGLang's MoE) and drop
                 "sglang" (stock SGLang cannot import Qwen3.5 on a CPU host)
  qwen3_5-35b-a3b  Qwen3.5-35B-A3B's layer shapes (3 Gated DeltaNet layers of 16 key / 32 value heads of 128, one
                 gated-attention layer of 16 q / 2 kv heads of 256, 256 experts top-8 of 512, shared expert 512) with a
                 16k vocabulary; one server at a time
  qwen3-30b-a3b  Qwen3-30B-A3B's exact layer shapes (hidden 2048, 32 q / 4 kv heads of 128, 128 experts top-8,
                 moe_intermediate 768) with 4 layers and a 16k vocabulary, so lm_head keeps about its share of the
                 bytes per token of the 48-layer model and weight streaming dominates as in the real one. Its
                 servers (about 5 GiB each) run one at a time (--sequential) to fit a 24 GiB machine.

Rows (one server each, same random model; all started first, then measured in turns: every stream count, row
after row, --repeats times, the median run kept, so a slow drift of the machine hits every row alike; with
--sequential each row's server runs alone, measured --repeats times, then stopped):
  sglang        SGLang without our plugin (SGLANG_PLUGINS excludes it): its per-expert torch loop
  kt base       routed experts in the kt_serve kernel, no adapter (on a CPU host the dense layers and lm_head too)
  kt cpu ops off  "kt base" with --kt-cpu-ops off: dense layers, lm_head, RMSNorm and attention as SGLang runs them
  kt torch attn "kt base" with --attention-backend torch_native: SGLang's attention instead of the plugin's kt_cpu
  kt spin off   "kt base" with KT_SERVE_IDLE_SPIN_US=0: kernel workers sleep as soon as a call ends (each call wakes them)
  kt expert     ... with --kt-expert-lora-path (every request gets the expert LoRA)
  kt mixed      ... --enable-lora with two composite adapters; requests cycle base / :a / :b
  kt adapter    ... every request with composite adapter :a
  kt adapter+le ... :a with KT-FT LoRA Experts added (N 2, intermediate 1024, KT's defaults)
  kt int8 / kt int4 / kt fp8   "kt base" with --kt-expert-dtype int8 / int4 / fp8 (experts quantized at load)
  kt int8 dense int8 / kt int4 dense int8 / kt int4 dense int4   ... and --kt-dense-dtype (attention too)
  kt int4 dense int8|int4 head int8|int4   ... and --kt-lm-head-dtype
  <kt row> @baseline   with --baseline-python PYTHON: the same row served from another install (a venv holding the
                previous commit, say), so a change's before and after are measured in one run
  llama.cpp q8_0 / q4_0   "llama.cpp base" on the GGUF quantized by llama.cpp's llama-quantize (its default mix:
                output at Q6_K); the peers of "kt int8 dense int8" and "kt int4 dense int4" (and its "head int8")
  llama.cpp base / expert / mixed   llama-server (-t = the kernel's threads, -np = the most streams) on the same
                weights as a BF16 GGUF and the same adapters as GGUF LoRAs (llama.cpp's own converters; the
                composite ones through kt_serve.convert's merged PEFT adapter), chosen per request by the ``lora``
                field, the same prompts as token ids (evals/llamacpp.py; --llama-server or built from the
                llama-cpp-python sdist; the rows are skipped, with one line saying why, when it cannot be had)
Decode tok/s = completion tokens / wall time of N concurrent greedy streams (ignore_eos, no prompt cache); ratios
are against the "kt base", "sglang" and llama.cpp rows of the same run (kt base/expert/mixed against llama.cpp
base/expert/mixed). Prefill tok/s: one 512-token prompt, one output token, median of three prompts per turn. Latency: p50/p90/p99 of request latency and of per-token time
(request latency / completion tokens). Peak RSS sums every process of the server's session; "RSS after load" is
the same sum once the server is ready, before any request (the weights as served, no bf16 copy left behind).
Writes OUT/bench_serving.{json,md,png} (kt_serve/harness/report.py) besides printing the table.

Before the servers, the MoE layer alone at the model's shape, in this process: SGLang's own CPU MoE path
(``moe_forward_native``, what the CPU engine runs without AMX sgl_kernel ops) vs the kt_serve kernel, base and
with an expert LoRA, at the decode batch sizes of the stream counts (``--moe-only`` runs just this part). As in
decode, each call reads another layer's weights from DRAM (see moe_layer_bench).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import statistics

from kt_serve.kernel.threads import TORCH_OMP_SPIN, share_cores_with_torch

# What the plugin does for its servers, here for the in-process MoE-layer part (before torch loads its OpenMP
# runtime); the SGLang-only server gets the environment as the user left it.
USER_ENV = {TORCH_OMP_SPIN[0]: os.environ.get(TORCH_OMP_SPIN[0])}
share_cores_with_torch()

from kt_serve.kernel.threads import cpu_isa, num_threads  # noqa: E402
from kt_serve.harness.server import SGLangServer  # noqa: E402
from kt_serve.harness.tiny_model import FAMILIES, build_tiny_moe  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kt_serve.harness.reference import write_expert_peft_adapter, write_kt_adapter  # noqa: E402
from evals.bench_kernel import cpu_model  # noqa: E402
from evals.llamacpp import LlamaCpp, LlamaCppUnavailable, LlamaServer  # noqa: E402
from kt_serve.harness.report import markdown_table, write_report  # noqa: E402

LLAMA_ROWS = ("llama.cpp base", "llama.cpp expert", "llama.cpp mixed")
LLAMA_QUANT_ROWS = {"llama.cpp q8_0": "Q8_0", "llama.cpp q4_0": "Q4_0"}  # the BF16 GGUF through llama-quantize
BASELINE = " @baseline"  # suffix of a kt row served from --baseline-python
LLAMA_PEER = {"kt base": "llama.cpp base", "kt expert": "llama.cpp expert", "kt mixed": "llama.cpp mixed",
              "kt int8 dense int8": "llama.cpp q8_0", "kt int4 dense int4": "llama.cpp q4_0",
              "kt int4 dense int4 head int8": "llama.cpp q4_0"}  # Q4_0 keeps its output tensor at Q6_K


class PeakRSS:
    """Samples the summed RSS of a process session (the server tree) until stopped."""

    def __init__(self, sid: int, period: float = 0.2):
        self.sid, self.period, self.peak = sid, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        total = 0
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getsid(p.pid) == self.sid:
                    total += p.memory_info().rss
            except (psutil.Error, ProcessLookupError, PermissionError):
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            self._stop.wait(self.period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def stream_prompt(i: int, length: int = 32, vocab: int = 1000) -> list[int]:
    """Stream i's prompt. Each stream gets its own: identical greedy streams would route every token of a decode
    batch to the same experts and hide the MoE cost of a real batch."""
    return [3 + (i * 7919 + j * 104729) % (vocab - 3) for j in range(length)]


def decode_run(server, requests: list[dict], streams: int, tokens: int, rounds: int = 2) -> dict:
    """`rounds` waves of `streams` concurrent greedy requests; tok/s over the waves and latency percentiles.
    Stream i's request adds requests[i % len(requests)] to the body: the adapter it asks for (SGLang's ``model``,
    llama.cpp's ``lora``)."""
    body = lambda i: {"prompt": stream_prompt(i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True,  # noqa: E731
                      "cache_prompt": False, **requests[i % len(requests)]}

    def one(i):
        t0 = time.perf_counter()
        status, r = server.post("/v1/completions", body(i), timeout=600)
        if status != 200:
            raise RuntimeError(f"request {requests[i % len(requests)]} failed: HTTP {status} {r}")
        return r["usage"]["completion_tokens"], time.perf_counter() - t0

    one(0)  # warm-up
    results = []
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        for _ in range(rounds):
            results += list(pool.map(one, range(streams)))
    wall = time.perf_counter() - start
    lat = [t for _, t in results]
    per_tok = [t / max(n, 1) * 1e3 for n, t in results]
    return {"tok_s": sum(n for n, _ in results) / wall,
            "lat_p50_s": percentile(lat, 50), "lat_p90_s": percentile(lat, 90), "lat_p99_s": percentile(lat, 99),
            "ms_per_tok_p50": statistics.median(per_tok), "ms_per_tok_p99": percentile(per_tok, 99)}


def greedy_tokens(server, requests: list[dict], tokens: int = 16) -> list[list[int]]:
    """The greedy token ids for stream i's prompt for each of the row's requests: what another server on the same
    weights and adapters should also answer, up to bf16 near-ties (a check that the llama.cpp rows run the same
    model). llama.cpp's OpenAI endpoint does not return ids; its own /completion does."""
    ids = []
    for i, extra in enumerate(requests):
        body = {"prompt": stream_prompt(i), "temperature": 0, "ignore_eos": True, "cache_prompt": False, **extra}
        if isinstance(server, LlamaServer):
            status, r = server.post("/completion", {**body, "n_predict": tokens, "return_tokens": True}, timeout=600)
            got = r.get("tokens")
        else:
            status, r = server.post("/v1/completions", {**body, "max_tokens": tokens, "return_token_ids": True},
                                    timeout=600)
            got = r["choices"][0].get("token_ids") if status == 200 else None
        if status != 200 or got is None:
            raise RuntimeError(f"greedy request {extra} failed: HTTP {status} {str(r)[:300]}")
        ids.append(list(got))
    return ids


_PREFILL_PROMPTS = itertools.count()


def prefill_run(server, requests: list[dict], length: int = 512, runs: int = 3) -> float:
    """Prompt tok/s of one `length`-token request (first adapter of the row, one output token), median of `runs`.
    Every prompt is new: it starts with token 1, which no decode prompt does, then two tokens that number it, so
    no server finds any of it in its prefix cache."""
    rates = []
    for _ in range(runs):
        n = next(_PREFILL_PROMPTS)
        prompt = [1, 3 + n // 997, 3 + n % 997] + [3 + (n * 104729 + j * 7907) % 997 for j in range(length - 3)]
        t0 = time.perf_counter()
        status, r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                    "cache_prompt": False, **requests[0]}, timeout=600)
        if status != 200:
            raise RuntimeError(f"prefill request failed: HTTP {status} {r}")
        rates.append(length / (time.perf_counter() - t0))
    return statistics.median(rates)


def moe_layer_bench(a, rounds: int = 5) -> list[dict]:
    """ms per MoE-layer call as in a decode step: SGLang's moe_forward_native vs MoEExperts, same weights.

    As in a model, every call goes to another layer's weights (a.layers of them, together far larger than the
    L3 cache) with fresh routing, so weights come from DRAM; the implementations take turns call by call, so
    both see the same memory traffic. Medians over rounds × layers calls.
    """
    import torch
    from types import SimpleNamespace

    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from kt_serve.kernel.experts import ExpertLoRA, MoEExperts
    from kt_serve.kernel.threads import num_threads

    E, H, I, k, r, L = a.experts, a.hidden, a.moe_intermediate, a.top_k, 8, a.layers
    torch.set_num_threads(num_threads())
    g = torch.Generator().manual_seed(0)
    cfg = MoeRunnerConfig(num_experts=E, top_k=k, activation="silu")
    shapes = [(E, r, H), (E, I, r), (E, r, H), (E, I, r), (E, r, I), (E, H, r)]
    layers = []
    for _ in range(L):
        w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.02).bfloat16()
        w2 = (torch.randn(E, H, I, generator=g) * 0.02).bfloat16()
        ours = MoEExperts(gate_up_proj=w13, down_proj=w2)
        ours.set_adapter(0, ExpertLoRA(*((torch.randn(*s, generator=g) * 0.02).bfloat16() for s in shapes), alpha=16.0))
        layers.append((SimpleNamespace(num_experts=E, w13_weight=w13, w2_weight=w2), ours))
    expert_mb = 3 * H * I * 2 / 1e6
    rows = []
    for T in a.streams:
        ms = {"sglang": [], "kt": [], "kt_lora": []}
        touched = []
        for it in range(rounds + 1):  # round 0 warms up
            for layer in range(L):
                x = torch.randn(T, H, generator=g).bfloat16()
                w, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(k, -1)
                w, ids = w.float().contiguous(), ids.to(torch.int32).contiguous()
                topk = StandardTopKOutput(w, ids, None)
                calls = {  # kt with LoRA on the layer half a model away, so it finds no weights left in cache
                    "sglang": lambda: moe_forward_native(layers[layer][0], x, topk, cfg),
                    "kt": lambda: layers[layer][1].forward_sft(x, ids, w),
                    "kt_lora": lambda: layers[(layer + L // 2) % L][1].forward_sft(x, ids, w, slots=0),
                }
                for name, fn in calls.items():
                    with torch.no_grad():
                        t0 = time.perf_counter()
                        fn()
                        dt = (time.perf_counter() - t0) * 1e3
                    if it:
                        ms[name].append(dt)
                touched.append(len(set(ids.flatten().tolist())) * expert_mb)
        med = {n: statistics.median(v) for n, v in ms.items()}
        mb = statistics.mean(touched)
        rows.append({"T": T, "weights_mb": round(mb, 1), "sglang_ms": round(med["sglang"], 3), "kt_ms": round(med["kt"], 3),
                     "kt_lora_ms": round(med["kt_lora"], 3), "kt_vs_sglang": round(med["sglang"] / med["kt"], 2),
                     "kt_lora_vs_sglang": round(med["sglang"] / med["kt_lora"], 2),
                     "kt_gb_s": round(mb / med["kt"], 1), "sglang_gb_s": round(mb / med["sglang"], 1)})
    print(f"\nMoE layer alone, decode-like (H={H}, I={I}, E={E}, top-{k}, {L} layers' weights in turn; expert LoRA "
          f"r={r}; {num_threads()} threads; medians of {rounds * L} calls):")
    print("| T | expert weights read MB | SGLang moe_forward_native ms | kt_serve ms | kt_serve + expert LoRA ms | "
          "speed-up | speed-up with LoRA | kt_serve GB/s | SGLang GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r_ in rows:
        print(f"| {r_['T']} | {r_['weights_mb']} | {r_['sglang_ms']} | {r_['kt_ms']} | {r_['kt_lora_ms']} | "
              f"{r_['kt_vs_sglang']}x | {r_['kt_lora_vs_sglang']}x | {r_['kt_gb_s']} | {r_['sglang_gb_s']} |", flush=True)
    return rows


def llama_cpp_models(out: Path, model: str, expert: Path, comp_a: Path, comp_b: Path, llama_server: str | None):
    """(llama.cpp, BF16 GGUF of the model, GGUF LoRAs [expert, a, b]) by llama.cpp's own converters; the KT SFT
    outputs a and b go through kt_serve.convert's merged PEFT adapter first. None, after one line saying why,
    when llama.cpp cannot be had or cannot read the model."""
    from kt_serve.formats import convert_adapter

    try:
        llama = LlamaCpp.locate(llama_server)
        gguf = llama.convert_model(Path(model), out / "model-bf16.gguf")
        adapters = []
        for name, adapter in (("expert", expert), ("a", comp_a), ("b", comp_b)):
            peft = adapter
            if name != "expert":
                peft = out / f"{name}_merged"
                if not peft.is_dir():
                    convert_adapter(adapter, merged_dir=peft)
            adapters.append(llama.convert_adapter(peft, Path(model), out / f"lora-{name}.gguf"))
    except LlamaCppUnavailable as e:
        print(f"llama.cpp rows skipped: {e}", flush=True)
        return None
    return llama, gguf, adapters


# name: model shape (attention as (q heads, kv heads, head dim); None: the tiny model's 4 / 2 of hidden/4; config:
# further transformers config fields), and whether its servers must run one at a time.
PRESETS = {
    "small": dict(hidden=1024, moe_intermediate=512, experts=64, top_k=8, layers=8, vocab=1024, heads=None,
                  sequential=False, family="qwen3_moe"),
    "qwen3-30b-a3b": dict(hidden=2048, moe_intermediate=768, experts=128, top_k=8, layers=4, vocab=16384,
                          heads=(32, 4, 128), sequential=True, family="qwen3_moe"),
    # Qwen3.5-MoE, medium: 6 Gated DeltaNet + 2 gated full-attention layers (3:1), shared expert, MoE everywhere.
    "qwen3_5-moe": dict(hidden=1024, moe_intermediate=512, experts=64, top_k=8, layers=8, vocab=1024, heads=None,
                        sequential=False, family="qwen3_5_moe"),
    # Qwen3.5-35B-A3B's layer shapes: 3 Gated DeltaNet (16 key / 32 value heads of 128) + 1 gated attention layer
    # (16 q / 2 kv heads of 256), 256 experts top-8 of 512, a shared expert of 512; a 16k vocabulary
    "qwen3_5-35b-a3b": dict(hidden=2048, moe_intermediate=512, experts=256, top_k=8, layers=4, vocab=16384,
                            heads=(16, 2, 256), sequential=True, family="qwen3_5_moe",
                            config=dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                        linear_value_head_dim=128, shared_expert_intermediate_size=512)),
}


def build_preset_model(path: Path, p: dict) -> str:
    """The random model of a preset's shape (``p``: a PRESETS entry, single fields possibly overridden)."""
    config = dict(p.get("config") or {})
    if p.get("heads") is not None:
        config.update(num_attention_heads=p["heads"][0], num_key_value_heads=p["heads"][1], head_dim=p["heads"][2])
    return str(build_tiny_moe(path, p["family"], hidden_size=p["hidden"], moe_intermediate_size=p["moe_intermediate"],
                              num_experts=p["experts"], top_k=p["top_k"], num_layers=p["layers"], vocab_size=p["vocab"],
                              **config))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--preset", choices=list(PRESETS), default="small")
    for flag in ("hidden", "moe-intermediate", "experts", "top-k", "layers", "vocab"):
        ap.add_argument(f"--{flag}", type=int, default=None, help="default: the preset's")
    ap.add_argument("--family", choices=FAMILIES, default=None,
                    help="model family at the preset's shape (default: the preset's; qwen3_5_moe = preset qwen3_5-moe)")
    ap.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=None,
                    help="one server at a time (default: the preset's)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3, help="turns of every row at every stream count (median kept)")
    ap.add_argument("--rows", nargs="+", default=None,
                    help="default: sglang, kt base, kt expert, kt mixed (qwen3_5-moe: kt moe off for sglang), "
                         "llama.cpp base, llama.cpp expert, llama.cpp mixed")
    ap.add_argument("--llama-server", default=None,
                    help="llama-server binary for the llama.cpp rows (default: on PATH, else built; see evals/llamacpp.py)")
    ap.add_argument("--moe-only", action="store_true", help="only the in-process MoE-layer comparison")
    ap.add_argument("--baseline-python", default=None, metavar="PYTHON",
                    help="also serve every kt row from this interpreter's install (e.g. a venv of the previous "
                         "commit), as a row of the same name + ' @baseline', measured in turns with the others")
    a = ap.parse_args(argv)
    preset = PRESETS[a.preset]
    for key, value in preset.items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    qwen35 = a.family == "qwen3_5_moe"
    if a.rows is None:
        a.rows = ["kt moe off" if qwen35 else "sglang", "kt base", "kt expert", "kt mixed", *LLAMA_ROWS]
    if a.baseline_python:
        a.rows = [r for name in a.rows for r in ([name, name + BASELINE] if name.startswith("kt ") else [name])]
    out = Path(a.out or tempfile.mkdtemp(prefix="kt_bench_"))
    # in a child process: its weights (about 10 GB at the qwen3-30b-a3b shapes) are then given back before the
    # servers start (this process kept about that much resident through the run when it ran them itself)
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        moe_rows = pool.submit(moe_layer_bench, a).result()
    if a.moe_only:
        return
    model = build_preset_model(out / "model", vars(a))
    if qwen35:
        from qwen35_adapters import write_qwen35_adapter

        expert = write_qwen35_adapter(out / "expert", model, seed=1, rank=8, alpha=16.0, nonexpert=False)
        comp_a = write_qwen35_adapter(out / "a", model, seed=2, rank=8, alpha=16.0)
        comp_b = write_qwen35_adapter(out / "b", model, seed=3, rank=8, alpha=16.0)
    else:
        expert = write_expert_peft_adapter(out / "expert", model, seed=1, rank=8, alpha=16.0)
        comp_a = write_kt_adapter(out / "a", model, seed=2, rank=8, alpha=16.0)
        comp_b = write_kt_adapter(out / "b", model, seed=3, rank=8, alpha=16.0)
    comp_le = None  # "a" with KT-FT LoRA Experts at KT's default size
    if "kt adapter+le" in a.rows and not qwen35:
        comp_le = write_kt_adapter(out / "a_le", model, seed=2, rank=8, alpha=16.0, lora_experts=2,
                                   lora_expert_size=1024)
    llama_rows = [name for name in a.rows if name in LLAMA_ROWS or name in LLAMA_QUANT_ROWS]
    if llama_rows:
        llama = llama_cpp_models(out, model, expert, comp_a, comp_b, a.llama_server)
        if llama is None:
            a.rows = [name for name in a.rows if name not in llama_rows]
    lora = ["--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", "4"]
    rows = {
        "sglang": ([], {"SGLANG_PLUGINS": "none", **USER_ENV}, [model]),
        "kt base": ([], {}, [model]),
        "kt moe off": (["--kt-moe", "off"], {}, [model]),
        "kt cpu ops off": (["--kt-cpu-ops", "off"], {}, [model]),
        "kt torch attn": (["--attention-backend", "torch_native"], {}, [model]),
        "kt spin off": ([], {"KT_SERVE_IDLE_SPIN_US": "0"}, [model]),
        "kt expert": (["--kt-expert-lora-path", str(expert)], {}, [model]),
        "kt mixed": (lora + ["--lora-paths", f"a={comp_a}", f"b={comp_b}"], {}, [model, f"{model}:a", f"{model}:b"]),
        "kt adapter": (lora + ["--lora-paths", f"a={comp_a}"], {}, [f"{model}:a"]),
        "kt adapter+le": (lora + ["--lora-paths", f"a={comp_le}"], {}, [f"{model}:a"]),
        **{f"kt {fmt}": (["--kt-expert-dtype", fmt], {}, [model]) for fmt in ("int8", "int4", "fp8")},
        **{f"kt {fmt} dense {dense}": (["--kt-expert-dtype", fmt, "--kt-dense-dtype", dense], {}, [model])
           for fmt, dense in (("int8", "int8"), ("int4", "int8"), ("int4", "int4"))},
        **{f"kt int4 dense {dense} head {head}": (["--kt-expert-dtype", "int4", "--kt-dense-dtype", dense,
                                                   "--kt-lm-head-dtype", head], {}, [model])
           for dense in ("int8", "int4") for head in ("int8", "int4")},
    }
    rows.update({name + BASELINE: rows[name] for name in list(rows) if name.startswith("kt ")})
    requests = {name: [{"model": m} for m in models] for name, (_, _, models) in rows.items()}
    # llama.cpp: adapters 0 (expert), 1 (a), 2 (b) loaded at scale 0; a request's lora field turns its own on
    on = lambda i: {"lora": [{"id": i, "scale": 1.0}]}  # noqa: E731
    requests.update({"llama.cpp base": [{}], "llama.cpp expert": [on(0)], "llama.cpp mixed": [{}, on(1), on(2)],
                     **{name: [{}] for name in LLAMA_QUANT_ROWS}})

    def start(stack, name):
        log = out / f"{name.replace(' ', '_')}.log"
        if name in LLAMA_QUANT_ROWS:
            binary, gguf, _ = llama
            quantized = binary.quantize(gguf, LLAMA_QUANT_ROWS[name], out / f"model-{LLAMA_QUANT_ROWS[name]}.gguf")
            return stack.enter_context(LlamaServer(binary, quantized, [], threads=num_threads(),
                                                   parallel=max(a.streams), ctx_per_slot=1024, log_path=log))
        if name in LLAMA_ROWS:
            binary, gguf, adapters = llama
            return stack.enter_context(LlamaServer(binary, gguf, adapters if name != "llama.cpp base" else [],
                                                   threads=num_threads(),
                                                   parallel=max(a.streams), ctx_per_slot=1024, log_path=log))
        args, env, _ = rows[name]
        # the KV pool is capped by max_total_tokens; a high static fraction only keeps SGLang's memory check
        # from refusing a second large server side by side (it counts the first one's RAM)
        baseline = name.endswith(BASELINE)
        return stack.enter_context(SGLangServer(
            model, args + ["--max-running-requests", str(max(a.streams)), "--sleep-on-idle",
                           "--mem-fraction-static", "0.95"], env=env, max_total_tokens=8192, log_path=log,
            # a baseline server starts outside the checkout, which `python -m` would put first on its sys.path
            python=a.baseline_python if baseline else sys.executable, cwd=out if baseline else None))

    def measure(names: list[str]) -> dict:
        """The servers of ``names`` up together (idle ones sleep, --sleep-on-idle), measured in turns."""
        measured = {}
        loaded_rss = {}
        with contextlib.ExitStack() as stack:
            servers = {}
            for name in names:
                server = start(stack, name)
                servers[name] = (server, PeakRSS(server.proc.pid))
                loaded_rss[name] = servers[name][1].now()
                greedy[name] = greedy_tokens(server, requests[name])
            runs = {name: {s: [] for s in a.streams} for name in servers}
            prefill = {name: [] for name in servers}
            for _ in range(a.repeats):  # rows take turns, so a slow drift of the machine hits every row alike
                for s in a.streams:
                    for name, (server, _) in servers.items():
                        runs[name][s].append(decode_run(server, requests[name], s, a.tokens))
                for name, (server, _) in servers.items():
                    prefill[name].append(prefill_run(server, requests[name]))
            for name, (_, rss) in servers.items():
                median = {s: sorted(v, key=lambda r: r["tok_s"])[len(v) // 2] for s, v in runs[name].items()}
                measured[name] = (median, statistics.median(prefill[name]), rss.stop(), loaded_rss[name])
                print(f"{name}: " + ", ".join(f"{s} streams {r['tok_s']:.1f} tok/s" for s, r in median.items()) +
                      f", prefill {measured[name][1]:.0f} tok/s, RSS after load {loaded_rss[name] / 2**30:.2f} GiB, "
                      f"peak {measured[name][2] / 2**30:.2f} GiB", flush=True)
        return measured

    results, greedy = {}, {}
    for group in ([[name] for name in a.rows] if a.sequential else [a.rows]):
        results.update(measure(group))

    rows = []
    base = results.get("kt base", (None,))[0]
    sgl = results.get("sglang", (None,))[0]
    for name, (runs, prefill, rss, loaded) in results.items():
        peer = results.get(LLAMA_PEER.get(name), (None, None))
        for s, r in runs.items():
            rows.append({"row": name, "streams": s, "tok_s": round(r["tok_s"], 1),
                         "vs_kt_base": round(r["tok_s"] / base[s]["tok_s"], 3) if base else None,
                         "vs_sglang": round(r["tok_s"] / sgl[s]["tok_s"], 3) if sgl else None,
                         "vs_llama_cpp": round(r["tok_s"] / peer[0][s]["tok_s"], 3) if peer[0] else None,
                         "prefill_tok_s": round(prefill), "prefill_vs_llama_cpp":
                             round(prefill / peer[1], 3) if peer[1] else None,
                         "lat_p50_s": round(r["lat_p50_s"], 3), "lat_p99_s": round(r["lat_p99_s"], 3),
                         "ms_per_tok_p50": round(r["ms_per_tok_p50"], 2), "ms_per_tok_p99": round(r["ms_per_tok_p99"], 2),
                         "rss_after_load_gib": round(loaded / 2**30, 2), "peak_rss_gib": round(rss / 2**30, 2)})
    heads = "4 q / 2 kv heads" if a.heads is None else f"{a.heads[0]} q / {a.heads[1]} kv heads of {a.heads[2]}"
    desc = (f"preset {a.preset} ({a.family}): hidden {a.hidden}, {heads}, moe_intermediate {a.moe_intermediate}, {a.experts} experts "
            f"top-{a.top_k}, {a.layers} layers, vocab {a.vocab}; {a.tokens} tokens per stream; {cpu_model()}, "
            f"{os.cpu_count()} CPUs, kernel isa {cpu_isa()}; "
            f"servers {'one at a time' if a.sequential else 'side by side, measured in turns'}")
    print("\n" + desc + "\n" + markdown_table(rows))
    paths = write_report(out, "bench_serving", rows, title="kt_serve serving benchmark", chart=("streams", "tok_s", "row"),
                         meta={"config": desc, "moe_layer": moe_rows})
    for kt, peer in LLAMA_PEER.items():
        if kt in greedy and peer in greedy:
            same = [next((j for j, (x, y) in enumerate(zip(ours, theirs)) if x != y), len(ours))
                    for ours, theirs in zip(greedy[kt], greedy[peer])]
            print(f"{peer} vs {kt}: greedy tokens in common before the first difference, per adapter (of 16): "
                  f"{', '.join(map(str, same))} (bf16 paths part at routing near-ties, sooner with adapters)")
    print(f"report: {paths['md']}")


if __name__ == "__main__":
    main()
