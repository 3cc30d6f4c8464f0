"""Serving many expert adapters from a pool smaller than they are: 16 composite adapters over 4 resident slots vs
all 16 resident, the same Zipf-skewed traffic, one run.

    python evals/bench_adapter_pool.py [--out DIR] [--preset qwen3-30b-a3b|small] [--adapters 16] [--resident 4]
                                       [--streams 1 8] [--requests 24] [--tokens 32] [--repeats 2]

Two servers on the same random model (bench_serving.py's presets; default qwen3-30b-a3b: its exact layer shapes,
4 layers) and the same composite adapters (attention + expert LoRA, rank 8), side by side, measured in turns
(``--sleep-on-idle``; the median of ``--repeats`` turns kept):

  pool R of N    ``--kt-max-expert-loras R``: N registered, R resident, the least recently used evicted
  all N resident ``--kt-max-expert-loras N``

Both with ``--max-loras-per-batch R``. Per stream count: ``--requests`` streaming greedy requests from that many
client threads, the adapter of each drawn from a Zipf law (s = 1, the same sequence for both rows), ``--tokens``
tokens each: decode tok/s (completion tokens / wall time), p50 / p99 time to first token. Then the cold adapter:
at idle, the first request to an adapter that is not resident (its expert half loaded before the prefill) vs the
next one to it, median over 4 adapters. Prints the tables and writes OUT/bench_adapter_pool.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from evals.bench_serving import PRESETS, build_preset_model, percentile, stream_prompt  # noqa: E402  (puts tests/ on sys.path)
from evals.bench_kernel import cpu_model  # noqa: E402
from kt_serve.harness.reference import write_kt_adapter  # noqa: E402
from kt_serve.harness.report import markdown_table, write_report  # noqa: E402
from kt_serve.harness.server import SGLangServer  # noqa: E402
from kt_serve.kernel.threads import cpu_isa  # noqa: E402


def streamed(server, model: str, prompt: list[int], tokens: int) -> tuple[float, int, float]:
    """(time to first token s, completion tokens, total s) of one streaming greedy request."""
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=600, max_retries=0)
    t0 = time.perf_counter()
    first, count = None, 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:  # a random model's token may print as "": the first chunk with a choice is the first token
        if chunk.choices and first is None:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    if first is None or count != tokens:
        raise RuntimeError(f"{model}: {count} tokens streamed, {tokens} asked")
    return first, count, time.perf_counter() - t0


def zipf_names(names: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return rng.choices(names, [1.0 / (k + 1) for k in range(len(names))], k=n)


def traffic(server, model: str, picks: list[str], streams: int, tokens: int) -> dict:
    def one(i):
        return streamed(server, f"{model}:{picks[i]}", stream_prompt(i), tokens)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(one, range(len(picks))))
    wall = time.perf_counter() - start
    ttft = [r[0] for r in results]
    return {"tok_s": sum(r[1] for r in results) / wall, "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99)}


def resident_names(server) -> set[str]:
    state = server.get("/get_server_info")["internal_states"][0]["kt_expert_adapters"]
    return {a["name"] for a in state["adapters"] if a["resident"]}


def cold_adapter(server, model: str, names: list[str], tokens: int, count: int = 4) -> tuple[float, float, int]:
    """(median TTFT of a first request to a non-resident adapter, of the next request to it, loads seen)."""
    cold, warm = [], []
    for name in names:
        if len(cold) == count:
            break
        if name in resident_names(server):
            continue
        cold.append(streamed(server, f"{model}:{name}", stream_prompt(1000 + len(cold)), tokens)[0])
        warm.append(streamed(server, f"{model}:{name}", stream_prompt(2000 + len(cold)), tokens)[0])
    return statistics.median(cold), statistics.median(warm), len(cold)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--preset", choices=["qwen3-30b-a3b", "small"], default="qwen3-30b-a3b")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--resident", type=int, default=4)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=24, help="requests per stream count and turn")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    p = PRESETS[a.preset]
    out = Path(a.out or tempfile.mkdtemp(prefix="kt_bench_pool_"))
    model = build_preset_model(out / "model", p)
    names = [f"a{i}" for i in range(a.adapters)]
    paths = {name: write_kt_adapter(out / name, model, seed=10 + i, rank=8, alpha=16.0) for i, name in enumerate(names)}
    common = ["--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", str(a.resident),
              "--max-running-requests", str(max(a.streams)), "--sleep-on-idle", "--mem-fraction-static", "0.95",
              "--lora-paths", *(f"{n}={paths[n]}" for n in names)]
    rows = {f"pool {a.resident} of {a.adapters}": ["--kt-max-expert-loras", str(a.resident)],
            f"all {a.adapters} resident": ["--kt-max-expert-loras", str(a.adapters)]}
    results = {name: {s: [] for s in a.streams} for name in rows}
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(SGLangServer(model, common + args, max_total_tokens=8192,
                                                          log_path=out / f"{name.replace(' ', '_')}.log"))
                   for name, args in rows.items()}
        for turn in range(a.repeats):
            for s in a.streams:
                picks = zipf_names(names, a.requests, seed=1000 * turn + s)
                for name, server in servers.items():
                    results[name][s].append(traffic(server, model, picks, s, a.tokens))
        time.sleep(2)
        cold = {name: cold_adapter(server, model, names[::-1], a.tokens) if name.startswith("pool") else None
                for name, server in servers.items()}
        state = {name: server.get("/get_server_info")["internal_states"][0]["kt_expert_adapters"]
                 for name, server in servers.items()}

    table = []
    baseline = f"all {a.adapters} resident"
    for name in rows:
        for s in a.streams:
            r = sorted(results[name][s], key=lambda x: x["tok_s"])[len(results[name][s]) // 2]
            base = sorted(results[baseline][s], key=lambda x: x["tok_s"])[len(results[baseline][s]) // 2]
            table.append({"row": name, "streams": s, "tok_s": round(r["tok_s"], 1),
                          "vs_all_resident": round(r["tok_s"] / base["tok_s"], 3),
                          "ttft_p50_s": round(r["ttft_p50_s"], 3), "ttft_p99_s": round(r["ttft_p99_s"], 3),
                          "loads": state[name]["loads"], "evictions": state[name]["evictions"],
                          "resident_mib": round(state[name]["resident_bytes"] / 2**20, 1)})
    desc = (f"preset {a.preset}: hidden {p['hidden']}, moe_intermediate {p['moe_intermediate']}, {p['experts']} experts "
            f"top-{p['top_k']}, {p['layers']} layers; {a.adapters} composite adapters (rank 8, attention + experts), "
            f"Zipf s=1 over them; {a.requests} requests x {a.tokens} tokens per stream count and turn, median of "
            f"{a.repeats} turns; {cpu_model()}, {os.cpu_count()} CPUs, kernel isa {cpu_isa()}")
    print("\n" + desc + "\n" + markdown_table(table))
    for name, value in cold.items():
        if value is not None:
            c, w, n = value
            print(f"\n{name}: cold adapter (first request, its expert half loaded first) TTFT {c:.3f} s vs "
                  f"{w:.3f} s for the next request to it (median of {n}); +{c - w:.3f} s")
    paths_out = write_report(out, "bench_adapter_pool", table, title="kt_serve adapter pool benchmark",
                             meta={"config": desc, "cold_adapter": cold})
    print(f"report: {paths_out['md']}")


if __name__ == "__main__":
    main()
