import argparse
import logging
import sys

from kt_serve.train import load_config, train
from kt_serve.train.config import describe_fields


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kt_serve.train",
                                     description="LoRA SFT of a MoE model with routed experts in the kt_serve CPU kernel.")
    parser.add_argument("config", nargs="?", help="LLaMA-Factory (+ KT) training YAML")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. max_steps=10 kt_config.threads=4")
    parser.add_argument("--help-fields", action="store_true", help="list every config field with its default and meaning")
    args = parser.parse_args(argv)
    if args.help_fields:
        print(describe_fields())
        return 0
    if args.config is None:
        parser.error("the config YAML is required")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        train(cfg)
    except (ValueError, FileNotFoundError) as exc:  # config, data, format and output_dir errors: one line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
