"""Training configuration: a LLaMA-Factory-style YAML, validated before any work starts.

Field names follow LLaMA-Factory / HF TrainingArguments wherever the meaning is the same, so an existing
LLaMA-Factory LoRA SFT config runs after removing fields this trainer does not implement (those are rejected by
name instead of being silently ignored). Kernel settings live in the nested ``kt_config:`` block.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")


class ConfigError(ValueError):
    """A config field is unknown, mistyped or contradicts another; the message names the field."""


@dataclass
class KTConfig:
    threads: int | None = field(default=None, metadata={"help": "Worker threads of the expert kernel (default: physical cores)."})
    dense_device: str = field(
        default="auto",
        metadata={"help": "Device of the non-expert modules: auto (cuda when available), cpu or cuda. Experts stay on the CPU."},
    )

    def __post_init__(self):
        if self.dense_device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"kt_config.dense_device: expected auto, cpu or cuda, got {self.dense_device!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"kt_config.threads: expected a positive integer, got {self.threads}")


@dataclass
class TrainConfig:
    # model
    model_name_or_path: str = field(metadata={"help": "Local HF MoE checkpoint directory."})
    output_dir: str = field(metadata={"help": "Where the adapter, checkpoints and logs go."})
    dataset: str = field(metadata={"help": "Comma-separated dataset names from dataset_info.json."})
    trust_remote_code: bool = False
    # data
    dataset_dir: str = field(default="data", metadata={"help": "Directory holding dataset_info.json."})
    template: str = field(default="tokenizer", metadata={"help": "Chat template: 'tokenizer' (its chat_template) or a named one."})
    cutoff_len: int = 2048
    max_samples: int | None = None
    # LoRA
    finetuning_type: str = "lora"
    lora_rank: int = 8
    lora_alpha: float | None = field(default=None, metadata={"help": "Defaults to 2 * lora_rank (LLaMA-Factory)."})
    lora_dropout: float = 0.0
    lora_target: str = field(default="all", metadata={"help": "'all' or comma-separated module leaf names."})
    use_rslora: bool = False
    # optimisation
    learning_rate: float = 1e-4
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 42
    bf16: bool = field(default=False, metadata={"help": "Non-expert base weights and activations in bf16 (LoRA stays fp32)."})
    # output
    overwrite_output_dir: bool = False
    logging_steps: int = 10
    save_steps: int = 500
    resume_from_checkpoint: str | bool | None = field(
        default=None, metadata={"help": "A checkpoint-N directory, or true for the latest one in output_dir."}
    )
    plot_loss: bool = False
    # accepted for LLaMA-Factory compatibility; only the values this trainer implements are allowed
    stage: str = "sft"
    do_train: bool = True
    report_to: str = "none"
    kt_config: KTConfig = field(default_factory=KTConfig)

    def __post_init__(self):
        fixed = {"stage": "sft", "do_train": True, "report_to": "none", "finetuning_type": "lora", "use_rslora": False}
        for name, expected in fixed.items():
            if getattr(self, name) != expected:
                raise ConfigError(f"{name}: only {expected!r} is supported, got {getattr(self, name)!r}")
        if self.lora_alpha is None:
            self.lora_alpha = 2.0 * self.lora_rank
        positive = ("lora_rank", "cutoff_len", "per_device_train_batch_size", "gradient_accumulation_steps",
                    "logging_steps", "save_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.lora_alpha <= 0 or self.learning_rate <= 0:
            raise ConfigError("lora_alpha and learning_rate must be positive")
        if self.lora_dropout != 0.0:
            raise ConfigError(f"lora_dropout: must be 0, got {self.lora_dropout} (the kernel's routed-expert LoRA has "
                              "no dropout, and one dropout setting must hold for the whole adapter)")
        if self.lr_scheduler_type not in SCHEDULERS:
            raise ConfigError(f"lr_scheduler_type: expected one of {', '.join(SCHEDULERS)}, got {self.lr_scheduler_type!r}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio: expected 0 <= r < 1, got {self.warmup_ratio}")
        if self.warmup_ratio > 0 and self.warmup_steps > 0:
            raise ConfigError("warmup_ratio and warmup_steps are both set; give one")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ConfigError("num_train_epochs must be positive when max_steps is not set")
        if self.resume_from_checkpoint not in (None, False) and self.overwrite_output_dir:
            raise ConfigError("resume_from_checkpoint and overwrite_output_dir contradict each other; give one")
        if not self.dataset.strip():
            raise ConfigError("dataset: expected at least one dataset name")

    @property
    def dataset_names(self) -> list[str]:
        return [name.strip() for name in self.dataset.split(",") if name.strip()]

    @property
    def lora_targets(self) -> list[str]:
        return [name.strip() for name in self.lora_target.split(",") if name.strip()]

    @property
    def lora_scaling(self) -> float:
        return self.lora_alpha / self.lora_rank

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(owner: str, name: str, annotation, value):
    """Check ``value`` against a field annotation (int/float/bool/str, optionals, unions); ints pass as floats."""
    hints = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if value is None:
        if type(None) in hints:
            return None
        raise ConfigError(f"{owner}{name}: a value is required")
    for hint in hints:
        if hint is bool and isinstance(value, bool):
            return value
        if hint is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if hint is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if hint is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    names = " or ".join("null" if h is type(None) else h.__name__ for h in hints)
    raise ConfigError(f"{owner}{name}: expected {names}, got {value!r}")


def _build(cls, raw: dict, owner: str = ""):
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(owner + u for u in unknown)}; known: {', '.join(sorted(known))}")
    kwargs = {}
    for name, value in raw.items():
        if hints[name] is KTConfig:
            if not isinstance(value, dict):
                raise ConfigError(f"{owner}{name}: expected a mapping")
            kwargs[name] = _build(KTConfig, value, owner=f"{name}.")
        else:
            kwargs[name] = _coerce(owner, name, hints[name], value)
    missing = [f.name for f in known.values()
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in raw]
    if missing:
        raise ConfigError(f"missing required field(s): {', '.join(owner + m for m in missing)}")
    return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict:
    """``key=value`` command-line overrides; values are YAML scalars, ``kt_config.threads=4`` reaches the block."""
    parsed: dict = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value")
        value = yaml.safe_load(text) if text else None
        *parents, leaf = key.split(".")
        target = parsed
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return parsed


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    raw: dict = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: cannot read YAML config ({exc})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of fields at the top level")
    extra = parse_overrides(list(overrides))
    # The training length is one choice: a command-line max_steps replaces the file's num_train_epochs and vice versa.
    for given, replaced in (("max_steps", "num_train_epochs"), ("num_train_epochs", "max_steps")):
        if given in extra and replaced not in extra:
            raw.pop(replaced, None)
    raw = _merge(raw, extra)
    if "max_steps" in raw and "num_train_epochs" in raw and (raw["max_steps"] or 0) > 0:
        raise ConfigError("max_steps and num_train_epochs are both set; give one")
    return _build(TrainConfig, raw)
