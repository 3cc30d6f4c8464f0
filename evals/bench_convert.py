"""Benchmark: convert a Qwen3-30B-A3B-sized KT SFT output (48 layers, 128 experts, H=2048, I=768, r=8, BF16).

    python evals/bench_convert.py [--workdir DIR] [--keep]

Generates the KT output (fused expert LoRA streamed layer by layer, attention LoRA, manifest) in a temp dir,
then runs `python -m kt_serve.convert RUN` (expert + non-expert adapters beside it) in a child process and
reports wall time, throughput and the child's peak RSS, against baselines run here: `cp` of the fused file
(the I/O floor) and a child that only imports the converter (interpreter + torch RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kt_serve.formats import FUSED_EXPERT_LORA_FILE, SafetensorsWriter, fused_key, save_tensors  # noqa: E402
from kt_serve.formats.manifest import build_manifest  # noqa: E402
from kt_serve.formats.names import kt_shapes  # noqa: E402

LAYERS, E, H, I, R = 48, 128, 2048, 768, 8
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
SHAPES = kt_shapes(E, H, I, R)
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def generate(run: Path) -> None:
    run.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    layout = {fused_key(layer, name): (torch.bfloat16, shape) for layer in range(LAYERS) for name, shape in SHAPES.items()}
    writer = SafetensorsWriter(run / FUSED_EXPERT_LORA_FILE, layout)  # KT writes no metadata
    for layer in range(LAYERS):
        for name, shape in SHAPES.items():
            writer.write(fused_key(layer, name), (torch.randn(*shape, generator=gen) * 0.01).bfloat16())
    writer.close()
    attention = {"q_proj": (H, HEADS * HEAD_DIM), "k_proj": (H, KV_HEADS * HEAD_DIM),
                 "v_proj": (H, KV_HEADS * HEAD_DIM), "o_proj": (HEADS * HEAD_DIM, H)}
    nonexpert = {}
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in attention.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            nonexpert[f"{key}.lora_A.weight"] = torch.randn(R, fan_in, generator=gen).bfloat16()
            nonexpert[f"{key}.lora_B.weight"] = torch.zeros(fan_out, R, dtype=torch.bfloat16)
    save_tensors(run / "adapter_model.safetensors", nonexpert, {"format": "pt"})
    config = {"peft_type": "LORA", "r": R, "lora_alpha": 2 * R, "lora_dropout": 0.0, "bias": "none",
              "task_type": "CAUSAL_LM", "base_model_name_or_path": "Qwen/Qwen3-30B-A3B",
              "target_modules": list(attention)}
    (run / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    manifest = build_manifest(run, ["adapter_config.json", "adapter_model.safetensors", FUSED_EXPERT_LORA_FILE],
                              base_model_name_or_path=config["base_model_name_or_path"], rank=R, alpha=2 * R,
                              fused_layout={k: v for k, v in layout.items()})
    (run / "kt_adapter_manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def run_child(argv: list[str]) -> tuple[float, float, int, str]:
    """(wall s, peak RSS MiB, exit code, output) of one child process, via wait4's per-child rusage."""
    start = time.perf_counter()
    child = subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = child.stdout.read().decode()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - start, usage.ru_maxrss / 1024, child.returncode, output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="where to generate (default: a temp dir, removed afterwards)")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kt_bench_convert."))
    run = work / "run"
    try:
        start = time.perf_counter()
        generate(run)
        fused_bytes = (run / FUSED_EXPERT_LORA_FILE).stat().st_size
        total_in = sum(p.stat().st_size for p in run.iterdir())
        layer_bytes = sum(torch.Size(shape).numel() * 2 for shape in SHAPES.values())
        print(f"generated {run} in {time.perf_counter() - start:.1f} s: fused {fused_bytes / 2**20:.0f} MiB, "
              f"all inputs {total_in / 2**20:.0f} MiB, one layer's expert tensors {layer_bytes / 2**20:.1f} MiB")

        copy_s, _, _, _ = run_child(["cp", str(run / FUSED_EXPERT_LORA_FILE), str(work / "copy.safetensors")])
        sync_start = time.perf_counter()
        os.sync()
        copy_s += time.perf_counter() - sync_start
        (work / "copy.safetensors").unlink()
        import_s, import_rss, _, _ = run_child([sys.executable, "-c", "import kt_serve.convert"])
        convert_s, convert_rss, code, output = run_child(
            [sys.executable, "-m", "kt_serve.convert", str(run), "--no-progress"])
        print(output.rstrip())
        if code != 0:
            print(f"conversion failed with exit code {code}")
            return 1
        out_bytes = sum(p.stat().st_size for d in ("run_expert", "run_nonexpert") for p in (work / d).iterdir())
        check_s, check_rss, code, _ = run_child([sys.executable, "-m", "kt_serve.convert", "--check",
                                                 str(work / "run_expert"), "--no-progress"])

        print()
        print("| step | wall s | GB/s (in) | peak RSS MiB | RSS above import MiB |")
        print("|---|---:|---:|---:|---:|")
        print(f"| baseline: cp fused file + sync | {copy_s:.2f} | {fused_bytes / copy_s / 1e9:.2f} | - | - |")
        print(f"| baseline: python -c 'import kt_serve.convert' | {import_s:.2f} | - | {import_rss:.0f} | 0 |")
        print(f"| convert RUN (manifest sha256 + expert + non-expert, fsync) | {convert_s:.2f} | "
              f"{total_in / convert_s / 1e9:.2f} | {convert_rss:.0f} | {convert_rss - import_rss:.0f} |")
        print(f"| --check RUN_expert (per-expert keys, 36864 tensors) | {check_s:.2f} | "
              f"{out_bytes / check_s / 1e9:.2f} | {check_rss:.0f} | {check_rss - import_rss:.0f} |")
        print()
        print(f"convert / cp time: {convert_s / copy_s:.1f}x;  convert RSS above import: "
              f"{(convert_rss - import_rss) * 2**20 / layer_bytes:.1f}x one layer, "
              f"{(convert_rss - import_rss) * 2**20 / fused_bytes:.2f}x the fused file; "
              f"outputs {out_bytes / 2**20:.0f} MiB")
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
