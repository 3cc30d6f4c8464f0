"""Self-check of a GPU host: does this machine serve expert LoRA right through stock SGLang + the kt_serve plugin?

    python -m kt_serve.check                        # on the GPU host: tiny DeepSeek-V2 and Qwen3-MoE, ~3-5 minutes
    python -m kt_serve.check --device cpu --emulate # the same through the accelerator path's code, on a CPU
    launch/check_gpu.sh WHEEL_DIR                   # a GPU machine without SGLang or network: install, then check

For each family it builds a tiny random model (DeepSeek-V2 with routed_scaling_factor 2.0: the case SGLang leaves to
the MoE method on CUDA) and a composite adapter (attention, shared expert, router and routed-expert LoRA), starts
``python -m sglang.launch_server`` twice — a plain launch (the plugin decides the CUDA graphs) and one with graphs
off by flag — and compares, per request (base and adapter, alone and mixed in one batch), the greedy tokens and
their logprobs with an fp32 transformers reference with the LoRA merged in plain torch (harness/reference.py), up
to the reference's first routing near-tie. It prints one table with 1-stream decode tok/s beside it, and exits 1 if
any request is off by more than TOL nats.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import time
from pathlib import Path

import torch

from kt_serve.harness.reference import HFReference, compared_positions, model_dims, pick_prompts, write_kt_adapter
from kt_serve.harness.report import markdown_table
from kt_serve.harness.server import SGLangServer
from kt_serve.harness.tiny_model import SERVING_OVERRIDES, build_tiny_moe

TOL = 0.02          # nats, bf16 serving against the fp32 reference (the serving tests' tolerance)
TIE_MARGIN = 3e-3   # routing near-ties end the comparison (a bf16 server may pick the other expert there)
PROMPT_LEN, CHECKED_TOKENS, SPEED_TOKENS = 6, 6, 64
FAMILIES = ("deepseek_v2", "qwen3_moe")
LORA_ARGS = ["--enable-lora", "--max-loras-per-batch", "2", "--max-running-requests", "4", "--max-lora-rank", "8"]
GRAPHS_OFF = ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
ADAPTER = "composite"


def decode_tok_s(server: SGLangServer, model: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    ids, _ = server.greedy(model, prompt, SPEED_TOKENS, ignore_eos=True, timeout=300)
    return len(ids) / (time.perf_counter() - start)


def graphs_of(server: SGLangServer, flags: list[str], device: str) -> str:
    if device == "cpu":
        return "none (CPU device)"
    if "CUDA graphs turned off" in server.log_path.read_text(errors="replace"):
        return "off (kt_serve: plain launch)"
    return "off (flags)" if flags else "SGLang's default"


def check_family(family: str, workdir: Path, device: str, env: dict) -> list[dict]:
    model = build_tiny_moe(workdir / family, family, **SERVING_OVERRIDES.get(family, {}))
    adapter = write_kt_adapter(workdir / f"{family}_adapter", model, seed=1, rank=4, gates=True,
                               shared_expert=bool(model_dims(model)["shared_expert"]))
    ref = HFReference(model)
    prompts = pick_prompts(ref, [[], [adapter]], n=2, length=PROMPT_LEN, tie_margin=TIE_MARGIN)
    jobs = [(name, i) for i in range(len(prompts)) for name in (None, ADAPTER)]
    served = {None: str(model), ADAPTER: f"{model}:{ADAPTER}"}  # the request's model field
    rows = []
    modes = [("plain launch", [])] + ([("graphs off", GRAPHS_OFF)] if device != "cpu" else [])  # no graphs on CPU
    for mode, flags in modes:
        args = LORA_ARGS + ["--lora-paths", f"{ADAPTER}={adapter}", *flags]
        if device == "cpu":
            args += ["--lora-backend", "torch_native"]
        with SGLangServer(model, args, device=device, env=env, startup_timeout=600) as server:

            def run(job):
                name, i = job
                return server.greedy(served[name], prompts[i], CHECKED_TOKENS, ignore_eos=True, timeout=300)

            alone = {job: run(job) for job in jobs}
            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
                mixed = dict(zip(jobs, pool.map(run, jobs)))
            speed = {name: decode_tok_s(server, served[name], prompts[0]) for name in served}
            graphs = graphs_of(server, flags, device)
        for name in served:
            dirs = [] if name is None else [adapter]
            compared, diffs, same = 0, [], True
            for job in [j for j in jobs if j[0] == name]:
                for ids, logprobs in (alone[job], mixed[job]):
                    keep, want, _ = compared_positions(ref, prompts[job[1]], ids, dirs, TIE_MARGIN)
                    diffs += [abs(logprobs[i] - want[i]) for i in keep]
                    compared += len(keep)
                same = same and alone[job][0] == mixed[job][0]
            worst = max(diffs, default=float("nan"))
            rows.append({"family": family, "launch": mode, "CUDA graphs": graphs,
                         "request": name or "base", "tokens compared": compared,
                         "max Δ logprob (nats)": worst, "mixed batch = alone": "yes" if same else "NO",
                         "ok": "yes" if compared and worst < TOL and same else "NO",
                         "decode tok/s (1 stream)": speed[name]})
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kt_serve.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="SGLang's --device (default cuda)")
    p.add_argument("--emulate", action="store_true",
                   help="run the accelerator host's code on CPU tensors (KT_SERVE_EMULATE_ACCELERATOR=1; with "
                        "--device cpu)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    p.add_argument("--out", default=None, help="work directory (default: a temporary one, removed afterwards)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = {"KT_SERVE_EMULATE_ACCELERATOR": "1" if args.emulate else None}
    if args.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"--families: {', '.join(unknown)} not among {', '.join(FAMILIES)}")
    with tempfile.TemporaryDirectory(prefix="kt_serve_check_") as tmp:
        workdir = Path(args.out or tmp)
        rows = [row for family in families for row in check_family(family, workdir, args.device, env)]
    print(markdown_table(rows))
    failed = [r for r in rows if r["ok"] != "yes"]
    print(f"\nkt_serve.check: {len(rows) - len(failed)}/{len(rows)} rows within {TOL} nats of the fp32 reference"
          + ("" if not failed else " — FAILED"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
