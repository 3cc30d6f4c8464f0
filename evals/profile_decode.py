"""Where a CPU decode step goes: py-spy samples an SGLang server's scheduler (stock SGLang + the kt_serve
plugin) while N greedy streams decode, and the samples are grouped by the part of the step they are in; or, with
--timers, wall clocks inside the server say the same without a sampler.

    python evals/profile_decode.py [--preset qwen3-30b-a3b|small|qwen3_5-moe] [--streams 1 8] [--seconds 15]
                                   [--timers | --call-times]
                                   [--server-args ...]   # e.g. --server-args --kt-expert-lora-path DIR

``--call-times`` also times the kernel's calls inside the server (evals/call_timer/sitecustomize.py on its
PYTHONPATH: a wall clock around each kernel call, by kind and shape) and prints their share of the same seconds:
py-spy's sampling leaves part of a C++ call to its Python callers, the clock does not.

``--timers`` runs no py-spy: on a machine with few cores the sampler takes a core the kernel's threads would use
(on 2 cores it made each routed-experts call 25% slower), so its shares describe a slower step. Instead torch's
global module hooks time every module call of the server (its own Python and torch ops, less the modules and kernel
calls inside it) beside the kernel calls, and the table gives each part's milliseconds a step: kernel calls,
each module class's own time, and the time outside every module (the scheduler loop), adding up to the step.
The hooks themselves cost a few µs a module call.

Needs py-spy (``pip install py-spy``; benchmarks only) unless --timers. The model is bench_serving.py's preset,
built once under --out. Shares are of the scheduler's samples after prefill; "other in the forward pass" is Python
and per-op dispatch in the model's forward outside the named parts, "scheduler loop" everything outside the forward
pass (building the batch, processing results, sending them to the detokenizer).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import PRESETS, build_preset_model, stream_prompt  # noqa: E402

from kt_serve.harness.server import SGLangServer  # noqa: E402

PY_SPY = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
# Part of the step -> frame names (py-spy's function names) whose inclusive samples it takes, first match wins.
PARTS = [
    ("routed experts (kt kernel)", ("MoEExperts.forward_sft", "MoEExperts.forward_routed")),  # routed: router fused
    ("routed experts (SGLang)", ("moe_forward_native", "fused_experts")),
    ("lm_head", ("LogitsProcessor._compute_lm_head", "compute_lm_head")),  # the latter: the plugin's dense path
    ("dense linears (q/k/v/o, gate, shared)", ("UnquantizedLinearMethod.apply", "linear_apply")),
    ("attention", ("KTCPUAttnBackend.forward_decode", "TorchNativeAttnBackend.forward_decode",
                   "TorchNativeAttnBackend.forward_extend")),
    # Qwen3.5's Gated DeltaNet layers: kt_serve's CPU ops (sglang_plugin/models/qwen35_gdn.py, qwen35.py)
    ("GDN ops (conv, delta rule, gating, gated norm, qkvz split)",
     ("causal_conv1d_update_cpu", "causal_conv1d_fwd_cpu", "causal_conv1d_fn_cpu",
      "fused_sigmoid_gating_delta_rule_update_cpu", "chunk_gated_delta_rule_cpu", "fused_gdn_gating_cpu",
      "rms_norm_gated", "fused_qkvzba_split_reshape_cat_contiguous_cpu")),
    ("norms", ("rms_norm_forward_native", "RMSNorm.forward_native", "apply_qk_norm")),
    ("rotary", ("rotary_forward_native", "apply_rotary_emb", "RotaryEmbedding.forward_native")),
    ("router top-k", ("select_experts",)),
    ("KV cache write", ("_set_kv_buffer_impl",)),
    ("sampling", ("Sampler.forward",)),
]


FORWARD = "ModelRunner.forward"
OTHER, SCHEDULER = "other in the forward pass", "scheduler loop (outside the forward pass)"


def part_of(frames: list[str]) -> str:
    """frames: py-spy's "function (file:line)" entries, outermost first; matched on the function's whole
    qualified name or its tail after a dot (a class defined in a function: "f.<locals>.Cls.method")."""
    functions = {frame.split(" (", 1)[0] for frame in frames}

    def called(name):
        return name in functions or any(f.endswith("." + name) for f in functions)

    for part, names in PARTS:
        if any(map(called, names)):
            return part
    return OTHER if called(FORWARD) else SCHEDULER


def tally(lines: list[str]) -> collections.Counter:
    """py-spy raw lines ("frame;frame;... count") -> samples per part of the step."""
    counts = collections.Counter()
    for line in lines:
        stack, _, n = line.rpartition(" ")
        counts[part_of(stack.split(";"))] += int(n)
    return counts


CALL_TIMER = Path(__file__).resolve().parent / "call_timer"


def read_timers(prefix: Path) -> tuple[float, dict]:
    """(time written, {"calls" | "modules" | "outermost": {name: [count, seconds]}, "intervals": {outermost module
    class: [[start to next start, kernel seconds in it], ...]}}) summed over the server processes that timed anything
    (evals/call_timer/sitecustomize.py)."""
    import json

    stamp = 0.0
    totals = {kind: collections.defaultdict(lambda: [0, 0.0]) for kind in ("calls", "modules", "outermost")}
    totals["intervals"] = {}
    for path in prefix.parent.glob(prefix.name + ".*.json"):
        data = json.loads(path.read_text())
        stamp = max(stamp, data["time"])
        totals["intervals"].update(data.get("intervals", {}))
        for kind in ("calls", "modules", "outermost"):
            for name, (n, t) in data.get(kind, {}).items():
                totals[kind][name][0] += n
                totals[kind][name][1] += t
    return stamp, totals


def window(before: tuple[float, dict], after: tuple[float, dict]) -> tuple[float, dict]:
    """Seconds between two read_timers and what was timed in them: {kind: {name: (count, seconds)}}; the intervals
    are the last read's."""
    (t0, a), (t1, b) = before, after
    diff = {"intervals": b["intervals"]}
    for kind in ("calls", "modules", "outermost"):
        table = b[kind]
        rows = {name: (n - a[kind].get(name, [0, 0.0])[0], t - a[kind].get(name, [0, 0.0])[1])
                for name, (n, t) in table.items()}
        diff[kind] = {name: v for name, v in rows.items() if v[0]}
    return t1 - t0, diff


def step_rows(seconds: float, timed: dict) -> tuple[int, list]:
    """Decode steps in the window (calls of the outermost module that took longest: the model) and where a
    step's wall time went: [(part, calls per step, ms per step)], largest first, adding up to the step."""
    outer = timed["outermost"]
    if not outer:
        return 0, []
    model = max(outer, key=lambda name: outer[name][1])
    steps = outer[model][0]
    per = lambda n, t: (n / steps, 1e3 * t / steps)  # noqa: E731
    rows = [(f"kernel: {name}", *per(n, t)) for name, (n, t) in timed["calls"].items()]
    rows += [(f"module: {name} (own Python and torch ops)", *per(n, t)) for name, (n, t) in timed["modules"].items()]
    inside = sum(t for _, t in outer.values())
    rows.append(("outside every module (scheduler loop, batch building, ModelRunner)", None,
                 1e3 * (seconds - inside) / steps))
    return steps, sorted(rows, key=lambda r: -r[2])


def fixed_cost(timed: dict) -> tuple | None:
    """Medians over the model's last steps (start of one forward to the start of the next, so the gaps between
    requests and the prefills drop out as outliers): (step ms, kernel ms in it, the rest ms, its p10, its p90)."""
    import statistics

    outer, intervals = timed["outermost"], timed["intervals"]
    if not outer:
        return None
    model = max(outer, key=lambda name: outer[name][1])
    steps = intervals.get(model, [])
    if len(steps) < 10:
        return None
    rest = sorted(1e3 * (wall - kernel) for wall, kernel in steps)
    return (1e3 * statistics.median(w for w, _ in steps), 1e3 * statistics.median(k for _, k in steps),
            statistics.median(rest), rest[len(rest) // 10], rest[9 * len(rest) // 10])


def profile(model: str, streams: int, seconds: int, server_args: list[str], log: Path, call_times: Path | None = None,
            py_spy: bool = True, idle: bool = False) -> tuple[collections.Counter, list, tuple]:
    """One server, ``streams`` greedy streams decoding for ``seconds``: py-spy's samples per part of the step (when
    ``py_spy``); with ``call_times`` (a file prefix) the timed kernel calls of the same window [(call, calls per
    second, µs per call, share of the wall time)], and without py-spy also the step's parts from the module timers
    (step_rows: steps, rows)."""
    import os

    import psutil

    env = None
    if call_times:
        for stale in call_times.parent.glob(call_times.name + ".*.json"):  # an earlier run's server processes
            stale.unlink()
        env = {"KT_SERVE_CALL_TIMES": str(call_times), "KT_SERVE_MODULE_TIMES": "0" if py_spy else "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(CALL_TIMER), os.environ.get("PYTHONPATH")]))}
    with SGLangServer(model, ["--max-running-requests", str(max(streams, 1)), *server_args], max_total_tokens=8192,
                      log_path=log, env=env) as server:
        body = lambda i: {"model": model, "prompt": stream_prompt(i), "max_tokens": 256,  # noqa: E731
                          "temperature": 0, "ignore_eos": True}
        server.post("/v1/completions", {**body(0), "max_tokens": 4}, timeout=600)  # warm-up
        scheduler = max(psutil.Process(server.proc.pid).children(recursive=True), key=lambda p: p.memory_info().rss)
        stop = threading.Event()

        def traffic():
            with concurrent.futures.ThreadPoolExecutor(streams) as pool:
                while not stop.is_set():
                    list(pool.map(lambda i: server.post("/v1/completions", body(i), timeout=600), range(streams)))

        thread = threading.Thread(target=traffic)
        thread.start()
        time.sleep(3)  # past the prompts' prefill
        before = read_timers(call_times) if call_times else None
        lines = []
        if py_spy:
            with tempfile.NamedTemporaryFile(suffix=".txt") as raw:
                subprocess.run([PY_SPY, "record", "--pid", str(scheduler.pid), "--duration", str(seconds), "--rate",
                                "200", "--format", "raw", "--output", raw.name, "--nonblocking", *(["--idle"] if idle else [])], check=True,
                               capture_output=True)
                lines = Path(raw.name).read_text().splitlines()
            (log.parent / f"{log.stem}.pyspy.txt").write_text("\n".join(lines))  # py-spy's raw stacks
        else:
            time.sleep(seconds)
        timed, steps, fixed = [], (0, []), None
        if call_times:
            time.sleep(1)  # the timer writes twice a second
            wall, diff = window(before, read_timers(call_times))
            for call, (n, t) in sorted(diff["calls"].items(), key=lambda kv: -kv[1][1]):
                timed.append((call, n / wall, 1e6 * t / n, t / wall))
            if not py_spy:
                steps, fixed = step_rows(wall, diff), fixed_cost(diff)
        stop.set()
        thread.join()
    return tally(lines), timed, steps, fixed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="qwen3-30b-a3b")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--out", default=None, help="where the model is built (reused when present)")
    ap.add_argument("--call-times", action="store_true", help="also time the kernel's calls inside the server")
    ap.add_argument("--timers", action="store_true",
                    help="no py-spy: the step's parts from wall clocks around every module and kernel call")
    ap.add_argument("--idle", action="store_true",
                    help="py-spy also samples the scheduler while it waits (a futex, a socket, a sleep)")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    a = ap.parse_args(argv)
    if PY_SPY is None and not a.timers:
        raise SystemExit("py-spy is not installed: pip install py-spy (a benchmark-only tool), or use --timers")
    p = PRESETS[a.preset]
    out = Path(a.out or tempfile.mkdtemp(prefix="kt_profile_"))
    model = out / "model"
    if not (model / "config.json").is_file():
        build_preset_model(model, p)
    results = {s: profile(str(model), s, a.seconds, a.server_args, out / f"server_{s}.log",
                          out / f"calls_{s}" if a.call_times or a.timers else None, py_spy=not a.timers, idle=a.idle)
               for s in a.streams}
    print(f"\npreset {a.preset}; server args {' '.join(a.server_args) or '(none)'}; "
          f"{'module and kernel timers' if a.timers else 'py-spy'}, {a.seconds} s per row")
    if a.timers:
        for s, (_, _, (steps, rows), fixed) in results.items():
            if not steps:
                print(f"\n{s} stream{'s' * (s > 1)}: no decode step timed (see {out / f'server_{s}.log'})")
                continue
            step = sum(ms for _, _, ms in rows)
            print(f"\n{s} stream{'s' * (s > 1)}: {steps} steps, {step:.2f} ms a step ({1e3 / step * s:.1f} tok/s "
                  "while timed)")
            print("| part of the step | calls a step | ms a step | share |\n|---|---|---|---|")
            for part, n, ms in rows:
                if ms >= 0.005 * step:
                    print(f"| {part} | {'' if n is None else f'{n:.2f}'} | {ms:.3f} | {100 * ms / step:.1f}% |")
            print(f"| (parts under 0.5% each) | | {sum(ms for _, _, ms in rows if ms < 0.005 * step):.3f} | |")
            if fixed:
                print("median step (one forward's start to the next): {:.2f} ms, kernel calls {:.2f} ms, everything "
                      "else (the fixed cost: scheduler, batch building, model Python, logits, sampling) {:.2f} ms "
                      "(p10 {:.2f}, p90 {:.2f})".format(*fixed))
        return
    shares = {s: r[0] for s, r in results.items()}
    print("| part of the decode step | " + " | ".join(f"{s} stream{'s' * (s > 1)}" for s in a.streams) + " |")
    print("|---|" + "---|" * len(a.streams))
    for part in [name for name, _ in PARTS] + [OTHER, SCHEDULER]:
        cells = [f"{100 * shares[s][part] / max(sum(shares[s].values()), 1):.1f}%" for s in a.streams]
        if any(c != "0.0%" for c in cells):
            print(f"| {part} | " + " | ".join(cells) + " |")
    for s, (_, timed, _, _) in results.items():
        if a.call_times:
            print(f"\nkernel calls timed in the server, {s} stream{'s' * (s > 1)} (the py-spy window)")
            print("| call (input rows) | calls/s | µs per call | share of wall time |\n|---|---|---|---|")
            for call, rate, us, share in timed:
                print(f"| {call} | {rate:,.0f} | {us:,.0f} | {100 * share:.1f}% |")


if __name__ == "__main__":
    main()
