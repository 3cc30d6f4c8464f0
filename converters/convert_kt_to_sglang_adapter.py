#!/usr/bin/env python3
"""Drop-in for kt-kernel's scripts/convert_kt_to_sglang_adapter.py (same CLI and Python API), over kt_serve.formats.

    convert_kt_to_sglang_adapter.py INPUT_DIR OUTPUT_DIR --base-model-name-or-path BASE
        [--lora-alpha A] [--overwrite] [--expert-output-dir E] [--nonexpert-output-dir N]

Beyond the reference it also reads per-expert expert LoRA inside adapter_model.safetensors, verifies the KT
manifest, checks every layer's six tensors and A/B inner dims, and writes all outputs atomically.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

try:
    from kt_serve.formats import FormatError, convert_adapter
except ImportError:  # run from a checkout without `pip install`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kt_serve.formats import FormatError, convert_adapter

REFERENCE_SUMMARY_KEYS = ("input_dir", "output_dir", "tensor_count", "rank", "target_modules", "lora_alpha",
                          "split_outputs")


def convert_kt_to_sglang_adapter(
    input_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    base_model_name_or_path: str,
    lora_alpha: float | None = None,
    overwrite: bool = False,
    expert_output_dir: str | os.PathLike | None = None,
    nonexpert_output_dir: str | os.PathLike | None = None,
) -> dict:
    summary = convert_adapter(input_dir, merged_dir=output_dir, expert_dir=expert_output_dir,
                              nonexpert_dir=nonexpert_output_dir, base_model_name_or_path=base_model_name_or_path,
                              lora_alpha=lora_alpha, overwrite=overwrite)
    return {key: summary[key] for key in REFERENCE_SUMMARY_KEYS}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Convert KT fused expert LoRA weights to an SGLang adapter directory.")
    parser.add_argument("input_dir", help="Directory containing fused_expert_lora.safetensors.")
    parser.add_argument("output_dir", help="Destination adapter directory.")
    parser.add_argument("--base-model-name-or-path", required=True,
                        help="Base model path/name to write into adapter_config.json.")
    parser.add_argument("--lora-alpha", type=float, default=None,
                        help="LoRA alpha to use when input adapter_config.json is absent.")
    parser.add_argument("--overwrite", action="store_true",
                        help="Remove and recreate output_dir if it already contains files.")
    parser.add_argument("--expert-output-dir", default=None,
                        help="Optional destination for a split expert-only adapter directory.")
    parser.add_argument("--nonexpert-output-dir", default=None,
                        help="Optional destination for a split non-expert-only adapter directory.")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        summary = convert_kt_to_sglang_adapter(
            args.input_dir, args.output_dir, base_model_name_or_path=args.base_model_name_or_path,
            lora_alpha=args.lora_alpha, overwrite=args.overwrite, expert_output_dir=args.expert_output_dir,
            nonexpert_output_dir=args.nonexpert_output_dir)
    except (FormatError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"Converted KT fused expert LoRA adapter: {summary['tensor_count']} tensors, rank={summary['rank']}, "
          f"target_modules={summary['target_modules']}")
    for name, split in summary["split_outputs"].items():
        print(f"Wrote {name} adapter: {split['tensor_count']} tensors, target_modules={split['target_modules']}, "
              f"output_dir={split['output_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
