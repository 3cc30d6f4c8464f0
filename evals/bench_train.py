"""Training throughput: kt_serve.train (routed experts in the CPU kernel) vs the pure-torch reference trainer
(tests/train_reference.py: fp32 HF model, per-expert LoRA math), same model, same LoRA init, same batches,
in one process. Prints tokens/s (non-padding tokens through forward+backward+optimizer step), excluding the first
(warm-up) step.

    python evals/bench_train.py [--steps 6] [--threads N] [--shapes tiny,small,experts[,a3b]] [--dense-devices cpu,cuda]

``--dense-devices`` times kt_serve.train once per device of the non-expert modules (the experts stay in the CPU
kernel), each against the same reference run.

``--memory`` instead measures gradient checkpointing at a long cutoff_len: peak RSS and tokens/s of the same
training steps without checkpointing, with it (experts recomputed), and with ``kt_cpu_activation: retain``, each
in a fresh process (peak RSS only grows within one).

    python evals/bench_train.py --memory [--cutoff-len 4096] [--layers 8] [--steps 3]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import train_reference as ref  # noqa: E402

import kt_serve  # noqa: E402
from kt_serve.harness.tiny_model import build_tiny_moe  # noqa: E402
from kt_serve.train import load_config  # noqa: E402
from kt_serve.train.data import SFTDataset  # noqa: E402
from kt_serve.train.model import TrainModel  # noqa: E402
from kt_serve.train.trainer import Trainer  # noqa: E402

DATA_DIR = Path(kt_serve.__file__).parent / "data" / "example_dataset"
# name: (build_tiny_moe kwargs, per-device batch size). "experts" makes the routed experts dominate the FLOPs.
SHAPES = {
    "tiny": (dict(hidden_size=128, moe_intermediate_size=64, num_experts=8, top_k=2, num_layers=2), 8),
    "small": (dict(hidden_size=256, moe_intermediate_size=256, num_experts=16, top_k=4, num_layers=2), 8),
    "experts": (dict(hidden_size=512, moe_intermediate_size=1024, num_experts=32, top_k=8, num_layers=1), 8),
    # Qwen3-30B-A3B's layer shapes, 2 layers (opt-in: 2.4 GB of bf16 experts, 4.8 GB more for the fp32 reference)
    "a3b": (dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, top_k=8, num_layers=2,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=128), 8),
}
DEFAULT_SHAPES = "tiny,small,experts"


def tokens_per_s(timings):
    seconds = sum(t for t, _ in timings[1:])
    return sum(n for _, n in timings[1:]) / seconds


def time_kt_steps(cfg, dataset, steps: int):
    """(timings, plan, initial LoRA) of ``steps`` optimizer steps of kt_serve.train under ``cfg``."""
    tm = TrainModel.load(cfg)
    init = {ref.saved_name(n): p.detach().to("cpu", copy=True) for n, p in tm.named_trainable_parameters().items()}
    trainer = Trainer(cfg, tm, dataset)
    plan = list(itertools.islice(trainer.plan.steps(), steps))
    timings = []
    tm.model.train()
    for _, _, groups in plan:
        start = time.perf_counter()
        _, tokens = trainer.training_step(groups)
        trainer.optimizer_step()
        if tm.device.type == "cuda":
            torch.cuda.synchronize()
        timings.append((time.perf_counter() - start, tokens))
    return timings, plan, init


def bench_shape(name, root: Path, steps: int, threads: int | None, devices: list[str]):
    model_kwargs, batch_size = SHAPES[name]
    model_dir = build_tiny_moe(root / name, "qwen3_moe", **model_kwargs)
    overrides = [f"model_name_or_path={model_dir}", f"output_dir={root / ('out-' + name)}", "dataset=pirate_alpaca",
                 f"dataset_dir={DATA_DIR}", f"per_device_train_batch_size={batch_size}", f"max_steps={steps}",
                 "lora_target=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "learning_rate=1e-3",
                 "disable_gradient_checkpointing=true"]  # the reference keeps all activations too
    if threads:
        overrides.append(f"kt_config.threads={threads}")
    from transformers import AutoTokenizer

    from kt_serve.kernel.threads import set_num_threads

    if threads:
        set_num_threads(threads)
    kt = {}
    for device in devices:
        cfg = load_config(None, [*overrides, f"kt_config.dense_device={device}"])
        dataset = SFTDataset.build(cfg, AutoTokenizer.from_pretrained(model_dir))
        timings, plan, init = time_kt_steps(cfg, dataset, steps)
        kt[device] = tokens_per_s(timings)
    batches = [[dataset.collate(mb) for mb in groups] for _, _, groups in plan]
    _, _, ref_timings = ref.train(model_dir, batches, init, alpha=cfg.lora_alpha, lr=cfg.learning_rate)
    pt = tokens_per_s(ref_timings)
    shape = model_kwargs
    cells = " | ".join(f"{kt[d]:,.0f} | {kt[d] / pt:.2f}x" for d in devices)
    print(f"| {name} | {shape['hidden_size']} | {shape['moe_intermediate_size']} | {shape['num_experts']}/{shape['top_k']} "
          f"| {shape['num_layers']} | {timings[1][1]} | {pt:,.0f} | {cells} |", flush=True)


# Checkpointing modes of --memory: config overrides of each.
MEMORY_MODES = {"off": ["disable_gradient_checkpointing=true"],
                "recompute": ["disable_gradient_checkpointing=false"],
                "retain": ["disable_gradient_checkpointing=false", "kt_cpu_activation=retain"]}
MEMORY_SHAPE = dict(hidden_size=512, moe_intermediate_size=512, num_experts=16, top_k=4)


def long_dataset(directory: Path, words: int) -> Path:
    """Two alpaca examples with responses of ``words`` words (cut at cutoff_len: a long-context SFT set)."""
    import json
    import random

    rng = random.Random(0)
    vocab = "the sea ship captain gold treasure wind sail island parrot map crew storm harbour rum deck".split()
    records = [{"instruction": "Tell me a long sea story.", "input": "",
                "output": " ".join(rng.choice(vocab) for _ in range(words))} for _ in range(2)]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "long.json").write_text(json.dumps(records))
    (directory / "dataset_info.json").write_text(json.dumps({"long": {"file_name": "long.json"}}))
    return directory


def memory_child(mode: str, root: Path, cutoff_len: int, steps: int) -> None:
    """One checkpointing mode in this process: prints a JSON line with peak RSS and tokens/s."""
    import json
    import resource

    from transformers import AutoTokenizer

    model_dir = root / "model"
    overrides = [f"model_name_or_path={model_dir}", f"output_dir={root / ('out-' + mode)}", "dataset=long",
                 f"dataset_dir={root / 'data'}", f"cutoff_len={cutoff_len}", f"max_steps={steps}",
                 "lora_target=all", "kt_config.dense_device=cpu", *MEMORY_MODES[mode]]
    cfg = load_config(None, overrides)
    dataset = SFTDataset.build(cfg, AutoTokenizer.from_pretrained(model_dir))
    trainer = Trainer(cfg, TrainModel.load(cfg), dataset)
    trainer.tm.model.train()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    timings = []
    for _, _, groups in itertools.islice(trainer.plan.steps(), steps):
        start = time.perf_counter()
        _, tokens = trainer.training_step(groups)
        trainer.optimizer_step()
        timings.append((time.perf_counter() - start, tokens))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mode": mode, "peak_rss_mib": peak / 1024, "before_steps_mib": rss_before / 1024,
                      "tokens_per_step": timings[0][1], "tok_s": tokens_per_s(timings)}), flush=True)


def bench_memory(cutoff_len: int, steps: int, layers: int) -> None:
    import json
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shape = {**MEMORY_SHAPE, "num_layers": layers}
        build_tiny_moe(root / "model", "qwen3_moe", **shape)
        long_dataset(root / "data", cutoff_len)
        print(f"qwen3_moe H={shape['hidden_size']} I={shape['moe_intermediate_size']} E={shape['num_experts']} "
              f"top-{shape['top_k']} layers={shape['num_layers']}, cutoff_len={cutoff_len}, batch 1, lora_target=all, "
              f"{steps} steps (first excluded from tok/s)")
        print("| gradient checkpointing | tokens/step | peak RSS MiB | RSS before training MiB | training's share MiB "
              "| tok/s | share vs off | tok/s vs off |")
        print("|---|---|---|---|---|---|---|---|")
        rows = {}
        for mode in MEMORY_MODES:
            out = subprocess.run([sys.executable, __file__, "--memory-child", mode, "--root", str(root),
                                  "--cutoff-len", str(cutoff_len), "--steps", str(steps)],
                                 capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"--memory-child {mode} failed:\n{out.stderr[-3000:]}")
            out = out.stdout
            rows[mode] = row = json.loads(out.strip().splitlines()[-1])
            off = rows["off"]
            share = {m: r["peak_rss_mib"] - r["before_steps_mib"] for m, r in rows.items()}
            print(f"| {mode} | {row['tokens_per_step']} | {row['peak_rss_mib']:,.0f} | {row['before_steps_mib']:,.0f} "
                  f"| {share[mode]:,.0f} | {row['tok_s']:,.0f} | {share[mode] / share['off']:.2f}x "
                  f"| {row['tok_s'] / off['tok_s']:.2f}x |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=None, help="kernel and torch threads (default: library defaults)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--dense-devices", default="cpu", help="comma list of kt_config.dense_device values to time")
    p.add_argument("--memory", action="store_true", help="peak RSS with and without gradient checkpointing")
    p.add_argument("--cutoff-len", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the --memory model")
    p.add_argument("--memory-child", choices=list(MEMORY_MODES), help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from kt_serve.kernel.threads import cpu_isa, num_threads

    if a.memory_child:
        memory_child(a.memory_child, a.root, a.cutoff_len, a.steps)
        return
    print(f"torch threads {torch.get_num_threads()}, kernel threads {num_threads()}, kernel ISA {cpu_isa()}, "
          f"{a.steps} steps (first excluded)")
    if a.memory:
        bench_memory(a.cutoff_len, a.steps, a.layers)
        return
    devices = a.dense_devices.split(",")
    if "cuda" in devices:
        print(f"GPU for the non-expert modules: {torch.cuda.get_device_name()}")
    kt_cols = "".join(f" kt_serve.train, dense on {d}, tok/s | speed-up |" for d in devices)
    print(f"| shape | H | I | E/top-k | layers | tokens/step | reference tok/s |{kt_cols}")
    print("|---" * (7 + 2 * len(devices)) + "|")
    with tempfile.TemporaryDirectory() as root:
        for name in a.shapes.split(","):
            bench_shape(name, Path(root), a.steps, a.threads, devices)


if __name__ == "__main__":
    main()
