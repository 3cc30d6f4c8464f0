"""python -m kt_serve.convert KT_OUT_DIR: split a KT SFT output into an expert and a non-expert PEFT adapter.

    python -m kt_serve.convert RUN                      # writes RUN_expert/ and RUN_nonexpert/ beside RUN
    python -m kt_serve.convert RUN MERGED [--expert-output-dir E] [--nonexpert-output-dir N]
    python -m kt_serve.convert --check DIR              # validate any adapter directory, write nothing

Bad input is one line on stderr naming the file and the problem, exit code 2, and no output written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kt_serve.formats import FormatError, convert_adapter, open_adapter_dir
from kt_serve.formats.config import check_base_model, merged_config, nonexpert_targets, resolve_base_model_config

EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kt_serve.convert", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input_dir", nargs="?", help="KT SFT output (or a merged / per-expert adapter) directory")
    parser.add_argument("output_dir", nargs="?", help="merged adapter directory (optional)")
    parser.add_argument("--output-dir", dest="merged_dir", help="merged adapter directory (same as the 2nd positional)")
    parser.add_argument("--expert-output-dir", help="expert-only adapter (default: <input>_expert beside the input)")
    parser.add_argument("--nonexpert-output-dir",
                        help="non-expert adapter (default: <input>_nonexpert beside the input)")
    parser.add_argument("--base-model-name-or-path",
                        help="local model dir or cached hub id; default: base_model_name_or_path of the input config")
    parser.add_argument("--lora-alpha", type=float, help="used only if the input adapter_config.json has no lora_alpha")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace non-empty output directories (after the new ones are complete)")
    parser.add_argument("--check", metavar="DIR", help="validate DIR and print a summary; writes nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _default_outputs(args) -> tuple[str | None, str | None, str | None]:
    if args.output_dir and args.merged_dir and args.output_dir != args.merged_dir:
        raise FormatError(args.merged_dir, f"--output-dir conflicts with the positional output dir {args.output_dir}")
    merged = args.output_dir or args.merged_dir
    if merged or args.expert_output_dir or args.nonexpert_output_dir:
        return merged, args.expert_output_dir, args.nonexpert_output_dir
    stem = Path(args.input_dir).expanduser().resolve()
    return None, str(stem.with_name(stem.name + "_expert")), str(stem.with_name(stem.name + "_nonexpert"))


def run_convert(args) -> None:
    merged, expert, nonexpert = _default_outputs(args)
    # Only an explicitly requested non-expert adapter makes an input without non-expert LoRA an error.
    summary = convert_adapter(args.input_dir, merged_dir=merged, expert_dir=expert, nonexpert_dir=nonexpert,
                              base_model_name_or_path=args.base_model_name_or_path, lora_alpha=args.lora_alpha,
                              overwrite=args.overwrite, progress=not args.no_progress,
                              nonexpert_optional=nonexpert is not None and args.nonexpert_output_dir is None)
    for note in summary["notes"]:
        print(note)
    print(f"Converted KT fused expert LoRA adapter: {summary['tensor_count']} tensors, rank={summary['rank']}, "
          f"target_modules={summary['target_modules']}")
    if summary["output_dir"] is not None:
        print(f"Wrote merged adapter: {summary['tensor_count']} tensors, target_modules={summary['target_modules']}, "
              f"output_dir={summary['output_dir']}")
    for name, split in summary["split_outputs"].items():
        print(f"Wrote {name} adapter: {split['tensor_count']} tensors, target_modules={split['target_modules']}, "
              f"output_dir={split['output_dir']}")


def run_check(args) -> None:
    source = open_adapter_dir(args.check, lora_alpha=args.lora_alpha, progress=not args.no_progress)
    experts = source.experts
    if experts is not None:
        for _ in experts.iter_layers():  # values: finite
            pass
    base = args.base_model_name_or_path or source.config.get("base_model_name_or_path") or ""
    config = merged_config(source.config, rank=source.rank, alpha=source.alpha, base_model_name_or_path=base,
                           nonexpert_keys=source.nonexpert) if experts else source.config
    print(f"{source.path}: OK, rank={source.rank}, lora_alpha={source.alpha}, base_model={base or '-'}, "
          f"target_modules={config.get('target_modules')}")
    if experts is not None:
        geometry = experts.geometry
        print(f"  experts: {experts.format} in {experts.path.name}, {len(experts.layers)} layers "
              f"[{experts.layers[0]}..{experts.layers[-1]}], E={geometry.num_experts}, H={geometry.hidden}, "
              f"I={geometry.intermediate}")
    else:
        print("  experts: none")
    print(f"  non-expert: {len(source.nonexpert)} tensors, modules={sorted(nonexpert_targets(source.nonexpert))}")
    if source.lora_experts is not None:
        print(f"  LoRA Experts (KT-FT, added to every MoE block's output): {source.lora_experts.describe()}")
    print(f"  manifest: {'verified' if source.manifest else 'none'}")
    if base:
        model_config, note = resolve_base_model_config(base)
        if model_config is None:
            print(f"  Note: {note}")
        else:
            check_base_model(model_config, experts.layers if experts else [], experts.geometry if experts else None,
                             source.nonexpert)
            print(f"  base model: shapes match {model_config}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.check is None) == (args.input_dir is None):
        parser.error("give either INPUT_DIR or --check DIR")
    try:
        run_check(args) if args.check else run_convert(args)
    except (FormatError, OSError) as exc:
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
