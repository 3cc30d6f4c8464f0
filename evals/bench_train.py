"""Training throughput: kt_serve.train (routed experts in the CPU kernel) vs the pure-torch reference trainer
(tests/train_reference.py: fp32 HF model, per-expert LoRA math), same model, same LoRA init, same batches,
in one process. Prints tokens/s (non-padding tokens through forward+backward+optimizer step), excluding the first
(warm-up) step.

    python evals/bench_train.py [--steps 6] [--threads N] [--shapes tiny,small,experts]
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
from kt_serve.tiny_model import build_tiny_moe  # noqa: E402
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
}


def tokens_per_s(timings):
    seconds = sum(t for t, _ in timings[1:])
    return sum(n for _, n in timings[1:]) / seconds


def bench_shape(name, root: Path, steps: int, threads: int | None):
    model_kwargs, batch_size = SHAPES[name]
    model_dir = build_tiny_moe(root / name, "qwen3_moe", **model_kwargs)
    overrides = [f"model_name_or_path={model_dir}", f"output_dir={root / ('out-' + name)}", "dataset=pirate_alpaca",
                 f"dataset_dir={DATA_DIR}", f"per_device_train_batch_size={batch_size}", f"max_steps={steps}",
                 "lora_target=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "learning_rate=1e-3",
                 "kt_config.dense_device=cpu"]
    if threads:
        overrides.append(f"kt_config.threads={threads}")
    cfg = load_config(None, overrides)
    from transformers import AutoTokenizer

    from kt_serve.kernel import set_num_threads

    if threads:
        set_num_threads(threads)
    dataset = SFTDataset.build(cfg, AutoTokenizer.from_pretrained(model_dir))
    tm = TrainModel.load(cfg)
    init = {ref.saved_name(n): p.detach().clone() for n, p in tm.named_trainable_parameters().items()}
    trainer = Trainer(cfg, tm, dataset)
    plan = list(itertools.islice(trainer.plan.steps(), steps))
    timings = []
    tm.model.train()
    for _, _, groups in plan:
        start = time.perf_counter()
        _, tokens = trainer.training_step(groups)
        trainer.optimizer_step()
        timings.append((time.perf_counter() - start, tokens))
    batches = [[dataset.collate(mb) for mb in groups] for _, _, groups in plan]
    _, _, ref_timings = ref.train(model_dir, batches, init, alpha=cfg.lora_alpha, lr=cfg.learning_rate)
    kt, pt = tokens_per_s(timings), tokens_per_s(ref_timings)
    shape = model_kwargs
    print(f"| {name} | {shape['hidden_size']} | {shape['moe_intermediate_size']} | {shape['num_experts']}/{shape['top_k']} "
          f"| {shape['num_layers']} | {timings[1][1]} | {kt:,.0f} | {pt:,.0f} | {kt / pt:.2f}x |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=None, help="kernel and torch threads (default: library defaults)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from kt_serve.kernel import cpu_isa, num_threads

    print(f"torch threads {torch.get_num_threads()}, kernel threads {num_threads()}, kernel ISA {cpu_isa()}, "
          f"{a.steps} steps (first excluded)")
    print("| shape | H | I | E/top-k | layers | tokens/step | kt_serve.train tok/s | reference tok/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for name in a.shapes.split(","):
            bench_shape(name, Path(root), a.steps, a.threads)


if __name__ == "__main__":
    main()
