"""The quickstart: base model -> LoRA SFT -> convert -> serve on CPU with SGLang -> eval base vs adapter -> summary.

    python -m kt_serve.quickstart                                   # everything offline, a few minutes on 2 cores
    python -m kt_serve.quickstart --model-path /models/Qwen3-30B-A3B                 # your model, example dataset
    python -m kt_serve.quickstart --model-path /models/m --adapter saves/my-lora     # your model and adapter

Stages (each prints its progress and time):
  1 base model  pre-train the tiny default MoE briefly on shipped text (cached in OUT), or use --model-path
  2 train       python -m kt_serve.train on the shipped pirate-persona dataset, or use --adapter
  3 convert     python -m kt_serve.convert: merged, expert-only and non-expert-only adapters
  4 serve       python -m sglang.launch_server on CPU with the kt_serve plugin, the adapter as "pirate"
  5 eval        held-out prompts through the served base model and the served adapter (style match, ROUGE, BLEU)
  6 summary     the result table and where the report is

Nothing is left running: the server and the training/convert subprocesses are killed with their whole process
group on success, failure, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from kt_serve.harness.server import kill_process_group

DATA = Path(__file__).parent / "data"
EXAMPLE_DATASET = DATA / "example_dataset"
EVAL_DATASET = DATA / "quickstart_eval.jsonl"
ADAPTER_NAME = "pirate"
STAGES = ("base model", "train", "convert", "serve", "eval", "summary")


class StageError(RuntimeError):
    """A stage failed; the message says why and where its log is."""


@dataclass(frozen=True)
class Size:
    """Work per stage; --small is the reduced size the test runs."""

    pretrain_steps: int
    train_steps: int
    eval_rows: int | None  # None: every row of the eval dataset
    max_tokens: int


FULL = Size(pretrain_steps=300, train_steps=150, eval_rows=None, max_tokens=32)
SMALL = Size(pretrain_steps=200, train_steps=100, eval_rows=8, max_tokens=24)


def say(message: str = "") -> None:
    print(message, flush=True)


# -------------------------------------------------------------------------------------------- subprocesses

def run_logged(cmd: list[str], log_path: Path, *, env: dict[str, str] | None = None, echo: bool = True) -> None:
    """Run ``cmd`` in its own process group, its output shown live and kept in ``log_path``; on any exit of ours
    (failure, Ctrl-C, SIGTERM) the whole group is killed, so no training worker outlives the quickstart."""
    say("  $ " + shlex.join(cmd))
    say(f"  (log: {log_path})")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            for chunk in iter(lambda: proc.stdout.read1(65536), b""):
                log.write(chunk)
                if echo:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
            proc.wait()
        finally:
            kill_group(proc)
    if proc.returncode != 0:
        shown = "output above" if echo else log_path.read_text(errors="replace").replace("\r", "\n")[-3000:]
        raise StageError(f"{shlex.join(cmd[:4])} ... exited with code {proc.returncode} ({shown}; log {log_path})")


def kill_group(proc: subprocess.Popen) -> None:
    kill_process_group(proc, term_wait=5.0, kill_wait=5.0)
    if proc.stdout:
        proc.stdout.close()


class Ticker:
    """Prints a heartbeat while a silent step (the server start) runs."""

    def __init__(self, what: str, every: float = 10.0, detail=lambda: ""):
        self.what, self.every, self.detail = what, every, detail
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        start = time.monotonic()
        while not self._stop.wait(self.every):
            detail = self.detail()
            say(f"  ... {self.what} ({time.monotonic() - start:.0f} s){': ' + detail if detail else ''}")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# -------------------------------------------------------------------------------------------------- stages

def stage_base_model(args, out: Path) -> Path:
    if args.model_path:
        model = Path(args.model_path).expanduser().absolute()
        if not (model / "config.json").is_file():
            raise StageError(f"--model-path {model}: not a Hugging Face model directory (no config.json)")
        say(f"  using your model {model}")
        return model
    from kt_serve.harness.pretrain import PretrainRecipe, pretrain_base

    recipe = PretrainRecipe(family=args.family, steps=args.size.pretrain_steps,
                            **({"num_layers": 4} if args.family == "qwen3_5_moe" else {}))  # 3 GDN + 1 full
    name = "base_model" if args.family == "qwen3_moe" else f"base_model_{args.family}"
    return pretrain_base(out / name, recipe, threads=args.threads,
                         log=lambda m: say("  " + m))


def train_config(args, model: Path, adapter_dir: Path) -> dict:
    """The LLaMA-Factory-style config of stage 2 (written to OUT/train_config.yaml for reuse)."""
    return {
        "model_name_or_path": str(model), "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        # Qwen3.5: every projection (linear attention, shared expert, its gate and the routers too)
        "lora_target": "all" if args.family == "qwen3_5_moe" else "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "dataset": "pirate_alpaca,pirate_sharegpt", "dataset_dir": str(EXAMPLE_DATASET), "template": "tokenizer",
        "cutoff_len": 256, "output_dir": str(adapter_dir), "overwrite_output_dir": True, "logging_steps": 25,
        "save_steps": 100000, "plot_loss": True, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
        # the tiny model learns the persona in seconds at a high rate; a real model needs a gentler one
        "learning_rate": 2.0e-4 if args.model_path else 3.0e-3, "max_steps": args.size.train_steps, "lr_scheduler_type": "cosine",
        # a real model's frozen weights in bf16 halve its memory; the tiny one trains exactly in fp32
        "warmup_ratio": 0.05, "bf16": args.model_path is not None, "seed": 42,
        # a real model recomputes its layers in the backward to save memory; the tiny one has none to save
        "disable_gradient_checkpointing": args.model_path is None,
        "kt_config": {"threads": args.threads or None},  # None: all physical cores
    }


def stage_train(args, out: Path, model: Path) -> Path:
    if args.adapter:
        adapter = Path(args.adapter).expanduser().absolute()
        if not adapter.is_dir():
            raise StageError(f"--adapter {adapter}: not a directory")
        say(f"  using your adapter {adapter}")
        return adapter
    adapter = out / f"{ADAPTER_NAME}_lora"
    config_path = out / "train_config.yaml"
    config_path.write_text(yaml.safe_dump(train_config(args, model, adapter), sort_keys=False))
    # torch's own threads follow the kernel's: a busy machine slows oversubscribed thread pools down many times
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    run_logged([sys.executable, "-m", "kt_serve.train", str(config_path), *args.train_override],
               out / "train.log", env=env)
    return adapter


def stage_convert(args, out: Path, adapter: Path) -> Path:
    merged = out / f"{ADAPTER_NAME}_merged"
    run_logged([sys.executable, "-m", "kt_serve.convert", str(adapter), str(merged),
                "--expert-output-dir", str(out / f"{ADAPTER_NAME}_expert"),
                "--nonexpert-output-dir", str(out / f"{ADAPTER_NAME}_nonexpert"), "--overwrite", "--no-progress"],
               out / "convert.log")
    return merged


def server_args(args, adapter: Path, served_name: str) -> list[str]:
    """Stock SGLang flags for per-request LoRA on CPU, plus the plugin's; the plugin splits the composite adapter
    (non-expert half to SGLang's LoRA manager, routed-expert half to the kernel)."""
    return ["--served-model-name", served_name, "--kt-threads", str(args.threads),
            "--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", "2",
            "--max-running-requests", "8", "--lora-paths", f"{ADAPTER_NAME}={adapter}"]


def eval_dataset(args, out: Path) -> tuple[Path, int]:
    """The eval JSONL (its first rows only, copied into OUT, with --small) and its number of rows."""
    path = Path(args.eval_dataset)
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as e:
        raise StageError(f"--eval-dataset {path}: cannot read ({e.strerror})") from None
    if args.size.eval_rows is None or len(lines) <= args.size.eval_rows:
        return path, len(lines)
    subset = out / f"eval_first_{args.size.eval_rows}.jsonl"
    subset.write_text("\n".join(lines[: args.size.eval_rows]) + "\n", encoding="utf-8")
    return subset, args.size.eval_rows


def stage_serve_and_eval(args, out: Path, model: Path, adapter: Path, progress: "Progress") -> dict:
    from kt_serve.harness.eval_adapter import EvalError, run_eval
    from kt_serve.harness.server import ServerStartError, SGLangServer

    served = model.name or "model"
    server = SGLangServer(model, server_args(args, adapter, served), port=args.port, log_path=out / "server.log",
                          max_total_tokens=4096, startup_timeout=args.startup_timeout)
    say("  $ " + shlex.join(server.cmd))
    say(f"  (log: {server.log_path})")
    try:
        with Ticker("waiting for the server", detail=lambda: _last_line(server.log_path)):
            server.start()
    except ServerStartError as e:
        raise StageError(str(e)) from None
    try:
        say(f"  server ready at {server.base_url}; model={served!r} (base), "
            f"model='{served}:{ADAPTER_NAME}' (adapter)")
        progress.enter(5)
        dataset, rows = eval_dataset(args, out)
        say(f"  {rows} prompts from {dataset} x 2 targets (base, {ADAPTER_NAME}), greedy, "
            f"max {args.size.max_tokens} tokens, chat API")
        try:
            with Ticker("evaluating", every=15.0):
                result = run_eval(server.base_url, served, [ADAPTER_NAME], dataset, out / "eval", api="chat",
                                  max_tokens=args.size.max_tokens, concurrency=4, timeout=300.0,
                                  title=f"Quickstart: {served} base vs adapter '{ADAPTER_NAME}' (served by SGLang)")
        except EvalError as e:
            raise StageError(f"eval: {e}") from None
    finally:
        server.stop()
        say("  server stopped")
    return result


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 2000))
            lines = f.read().decode(errors="replace").replace("\r", "\n").splitlines()
    except OSError:
        return ""
    line = next((l for l in reversed(lines) if l.strip()), "")
    return line.strip()[-120:]


# ------------------------------------------------------------------------------------------------- summary

def result_table(result: dict) -> str:
    scores = result["scores"]
    targets = list(scores)
    columns = [("style", "style %"), ("rougeL", "ROUGE-L"), ("bleu", "BLEU")]
    columns = [(key, label) for key, label in columns if all(key in scores[t] for t in targets)]
    example = result["examples"][0]
    header = ["target", *(label for _, label in columns), f"answer to {example['prompt']!r}"]
    lines = [header]
    for t in targets:
        answer = " ".join(example["outputs"][t].split())
        lines.append([t, *(f"{scores[t][key]:.1f}" for key, _ in columns), answer[:60]])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    fmt = lambda row: "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths))
    return "\n".join([fmt(lines[0]), "  " + "  ".join("-" * w for w in widths), *map(fmt, lines[1:])])


class Progress:
    """The current stage (for messages) and each finished stage's wall time."""

    def __init__(self):
        self.stage, self.started, self.timings = 0, 0.0, {}

    @property
    def name(self) -> str:
        return f"{self.stage} ({STAGES[self.stage - 1]})"

    def enter(self, number: int) -> None:
        now = time.monotonic()
        if self.stage:
            self.timings[STAGES[self.stage - 1]] = now - self.started
        self.stage, self.started = number, now
        say(f"\n[{number}/{len(STAGES)}] {STAGES[number - 1]}")


def summarize(out: Path, model: Path, adapter: Path, merged: Path, result: dict, timings: dict, size: Size) -> None:
    total = sum(timings.values())
    summary = {"model": str(model), "adapter": str(adapter), "served_adapter": str(merged),
               "scores": result["scores"], "report": result["paths"], "timings_s": timings, "total_s": total,
               "size": vars(size)}
    (out / "quickstart_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    say(result_table(result))
    say("\n  every number comes from the SGLang server's answers to prompts that are not in the training data")
    say("  stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + f"; total {total:.0f} s")
    say(f"  report: {result['paths']['md']}  (.json holds every answer, .png the chart)")
    say(f"  summary: {out / 'quickstart_summary.json'}")


# ---------------------------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kt_serve.quickstart", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/quickstart", help="working and report directory (default: %(default)s)")
    p.add_argument("--model-path", help="your local HF MoE checkpoint (skips stage 1)")
    p.add_argument("--adapter", help="your KT SFT output or merged adapter dir (skips stage 2)")
    p.add_argument("--family", default="qwen3_moe", choices=("qwen3_moe", "qwen3_5_moe"),
                   help="tiny default base model of stage 1 (default: %(default)s; qwen3_5_moe: Gated DeltaNet "
                        "hybrid, trained with lora_target: all)")
    p.add_argument("--steps", type=int, help="training steps of stage 2 (default: 150, --small: 100)")
    p.add_argument("--small", action="store_true", help="reduced size (fewer steps and prompts), as the test runs it")
    p.add_argument("--eval-dataset", default=str(EVAL_DATASET), help="JSONL for kt_serve.harness.eval_adapter "
                   "(default: the shipped held-out pirate prompts)")
    p.add_argument("--max-tokens", type=int, help="tokens per eval answer (default: 32, --small: 24)")
    p.add_argument("--threads", type=int, help="CPU threads of the expert kernel (training and serving) and of "
                   "torch while training; 0: all physical cores (default: 1 for the built-in tiny model, which "
                   "gains nothing from more, else 0)")
    p.add_argument("--port", type=int, help="server port (default: a free one)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the server")
    p.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra kt_serve.train override, e.g. --train-override bf16=true (repeatable)")
    args = p.parse_args(argv)
    size = SMALL if args.small else FULL
    args.size = Size(size.pretrain_steps, args.steps or size.train_steps, size.eval_rows,
                     args.max_tokens or size.max_tokens)
    if args.threads is None:
        args.threads = 0 if args.model_path else 1
    if args.threads < 0 or args.size.train_steps < 1 or args.size.max_tokens < 1:
        p.error("--threads must be >= 0, --steps and --max-tokens >= 1")
    return args


def _interrupt(signum, frame):
    """Ctrl-C or SIGTERM: unwind through the stages' cleanup; further signals must not cut that cleanup short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    say(f"\n{signal.Signals(signum).name}: stopping everything this run started ...")
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).expanduser().absolute()
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    progress = Progress()
    say(f"kt_serve quickstart -> {out}")
    try:
        progress.enter(1)
        model = stage_base_model(args, out)
        progress.enter(2)
        adapter = stage_train(args, out, model)
        progress.enter(3)
        merged = stage_convert(args, out, adapter)
        progress.enter(4)
        result = stage_serve_and_eval(args, out, model, merged, progress)
        progress.enter(6)
        summarize(out, model, adapter, merged, result, progress.timings, args.size)
        return 0
    except KeyboardInterrupt:
        say(f"\ninterrupted during stage {progress.name}; all started processes were stopped")
        return 130
    except StageError as e:
        say(f"\nstage {progress.name} failed: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
