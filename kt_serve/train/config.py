"""Training configuration: a LLaMA-Factory (+ KTransformers) training YAML, validated before any work starts.

Field names and meanings follow LLaMA-Factory / HF TrainingArguments and KT's ``kt_config`` block, so the YAMLs
people already have run unchanged. Every field either does what it does there, or — where it has no counterpart
in a single-process trainer whose experts live in our kernel — is accepted and named in one log line saying why
it has no effect (``NO_EFFECT`` metadata, reported by :meth:`TrainConfig.no_effect_notes`). A field whose meaning
cannot be honoured is refused naming it; an unknown field (a typo) is refused naming the closest known one.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kt_serve.kernel.weights import WEIGHT_FORMATS

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
SAVE_STRATEGIES = ("steps", "epoch", "no")
CPU_ACTIVATION = ("retain", "recompute")
NO_EFFECT = "no_effect"  # field metadata: why the field, when given, changes nothing here
# KT's kt_backend names -> (the kernel ISA table they ask for, the expert weight format they imply or None).
KT_BACKENDS = {"auto": ("auto", None), "amxbf16": ("amx_bf16", None), "amx_bf16": ("amx_bf16", None),
               "avx512": ("avx512_bf16", None), "avx512bf16": ("avx512_bf16", None),
               "avx512_bf16": ("avx512_bf16", None), "avx2": ("avx2", None), "portable": ("portable", None),
               "amxint8": ("auto", "int8"), "avx512int8": ("auto", "int8"), "int8": ("auto", "int8"),
               "amxint4": ("auto", "int4"), "int4": ("auto", "int4"), "fp8": ("auto", "fp8"), "amxfp8": ("auto", "fp8")}


class ConfigError(ValueError):
    """A config field is unknown, mistyped or contradicts another; the message names the field."""


def _note(reason: str, default=None):
    return field(default=default, metadata={NO_EFFECT: reason})


@dataclass
class KTConfig:
    threads: int | None = field(default=None, metadata={"help": "Worker threads of the expert kernel (default: physical cores)."})
    dense_device: str = field(
        default="auto",
        metadata={"help": "Device of the non-expert modules: auto (cuda when available), cpu or cuda. Experts stay on the CPU."},
    )
    # KTransformers' names (the cookbook's kt_config block)
    kt_num_threads: int | None = field(default=None, metadata={"help": "KT's name for `threads`."})
    kt_backend: str = field(default="auto", metadata={
        "help": "auto, AMXBF16, AVX512 or AVX2 (the kernel's ISA table); AMXINT8 / AMXINT4 / FP8 also set the format."})
    kt_expert_weight_format: str | None = field(default=None, metadata={
        "help": "Frozen routed experts in the kernel: bf16 (default), fp8, int8 or int4. A bf16 checkpoint is quantized "
                "at load; an FP8 checkpoint's experts are packed from its e4m3 weights and block scales."})
    kt_model_max_length: int | None = field(
        default=None, metadata={"help": "Tokens per sequence the kernel must take (default cutoff_len); > cutoff_len."})
    kt_tp_enabled: bool | None = _note("one kernel thread pool spans this process's cores; there is no tensor-parallel "
                                       "split of the experts between NUMA pools")
    kt_threadpool_count: int | None = _note("the kernel runs one thread pool (its size is kt_num_threads)")
    kt_max_cache_depth: int | None = _note("each MoE layer keeps exactly the forward state its next backward needs "
                                           "(one micro-batch at a time), so there is no cache depth to choose")
    kt_weight_lifecycle: str | None = _note("the kernel packs the experts once at load and keeps them for the whole "
                                            "run (KT's persistent)")
    kt_share_backward_bb: bool | None = _note("the kernel always shares its backward scratch between layers (one set "
                                              "per thread), as KT does with true")

    def __post_init__(self):
        if self.dense_device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"kt_config.dense_device: expected auto, cpu or cuda, got {self.dense_device!r}")
        for name in ("threads", "kt_num_threads", "kt_model_max_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"kt_config.{name}: expected a positive integer, got {getattr(self, name)}")
        if self.kt_num_threads is not None:
            if self.threads is not None and self.threads != self.kt_num_threads:
                raise ConfigError(f"kt_config.threads ({self.threads}) and kt_config.kt_num_threads "
                                  f"({self.kt_num_threads}) contradict each other; give one")
            self.threads = self.kt_num_threads
        if self.kt_backend.lower() not in KT_BACKENDS:
            raise ConfigError(f"kt_config.kt_backend: {self.kt_backend!r} is not available here; expected auto, AMXBF16, "
                              "AVX512, AVX2, AMXINT8, AMXINT4 or FP8")
        if self.kt_weight_lifecycle not in (None, "persistent"):
            raise ConfigError(f"kt_config.kt_weight_lifecycle: {self.kt_weight_lifecycle!r}: only persistent (the "
                              "packed experts stay resident for the run)")
        implied = KT_BACKENDS[self.kt_backend.lower()][1]
        fmt = (self.kt_expert_weight_format or implied or "bf16").lower()
        if fmt not in WEIGHT_FORMATS:
            raise ConfigError(f"kt_config.kt_expert_weight_format: {self.kt_expert_weight_format!r} is not supported; "
                              f"expected one of {', '.join(WEIGHT_FORMATS)}")
        if implied and fmt != implied:
            raise ConfigError(f"kt_config.kt_backend {self.kt_backend} holds {implied} experts but "
                              f"kt_expert_weight_format is {self.kt_expert_weight_format}; give one of them")
        self.kt_expert_weight_format = fmt

    @property
    def isa(self) -> str:
        return KT_BACKENDS[self.kt_backend.lower()][0]


@dataclass
class TrainConfig:
    # model
    model_name_or_path: str = field(metadata={"help": "Local HF MoE checkpoint directory."})
    output_dir: str = field(metadata={"help": "Where the adapter, checkpoints and logs go."})
    dataset: str = field(metadata={"help": "Comma-separated dataset names from dataset_info.json."})
    trust_remote_code: bool = False
    disable_gradient_checkpointing: bool = field(
        default=False, metadata={"help": "LLaMA-Factory: false (the default) checkpoints every decoder layer."})
    # data
    dataset_dir: str = field(default="data", metadata={"help": "Directory holding dataset_info.json."})
    template: str = field(default="tokenizer", metadata={"help": "Chat template: 'tokenizer' (its chat_template) or a LLaMA-Factory name."})
    enable_thinking: bool = field(default=True, metadata={"help": "Reasoning templates (qwen3...): LLaMA-Factory's switch."})
    cutoff_len: int = 2048
    max_samples: int | None = None
    packing: bool = field(default=False, metadata={"help": "Pack examples into cutoff_len rows, each attending only to itself."})
    neat_packing: bool = field(default=False, metadata={"help": "LLaMA-Factory's name for packing without cross-attention."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Re-tokenize instead of reusing the tokenized-dataset cache."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes that tokenize the dataset."})
    dataloader_num_workers: int = field(default=0, metadata={"help": "Processes that prepare batches ahead of the step."})
    # LoRA
    finetuning_type: str = "lora"
    lora_rank: int = 8
    lora_alpha: float | None = field(default=None, metadata={"help": "Defaults to 2 * lora_rank (LLaMA-Factory)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on every LoRA input, routed experts included."})
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
    ddp_timeout: int | None = _note("one process: there is no distributed process group to time out")
    # output
    overwrite_output_dir: bool = False
    logging_steps: int = 10
    save_strategy: str = field(default="steps", metadata={"help": "steps (every save_steps), epoch or no.",
                                                          "yaml_bool": {False: "no"}})  # YAML 1.1 reads `no` as false
    save_steps: int = 500
    save_total_limit: int | None = field(default=None, metadata={"help": "Keep only the newest N checkpoint-* dirs."})
    save_only_model: bool = field(default=False, metadata={"help": "Checkpoints without optimizer/scheduler/RNG state (not resumable)."})
    resume_from_checkpoint: str | bool | None = field(
        default=None, metadata={"help": "A checkpoint-N directory, or true for the latest one in output_dir."}
    )
    plot_loss: bool = False
    # accepted for LLaMA-Factory compatibility; only the values this trainer implements are allowed
    stage: str = "sft"
    do_train: bool = True
    report_to: str = "none"
    # KTransformers
    use_kt: bool | None = _note("kt_serve always trains the routed experts in its CPU kernel")
    kt_cpu_activation: str | None = field(
        default=None, metadata={"help": "retain: keep the kernel's expert activations through checkpoint recompute."})
    kt_optimize_rule: str | None = _note("kt_serve places modules itself: routed experts in the CPU kernel, everything "
                                         "else on kt_config.dense_device")
    cpu_infer: int | None = field(default=None, metadata={"help": "KT's older name for kt_config.kt_num_threads."})
    chunk_size: int | None = _note("the kernel takes each micro-batch's tokens in one call (its capacity follows "
                                   "cutoff_len / kt_config.kt_model_max_length)")
    kt_weight_path: str | None = field(default=None, metadata={
        "help": "The packed-weight cache the server writes (--kt-weight-cache DIR): layers it holds in "
                "kt_expert_weight_format are read from it, the others packed and written there. KT's converted "
                "INT8/INT4 expert files are not read."})
    kt_non_expert_weight_path: str | None = field(default=None, metadata={"help": "Refused, as kt_weight_path."})
    kt_use_lora_experts: bool = field(default=False, metadata={
        "help": "KT-FT LoRA Experts: N dense SwiGLU MLPs per MoE layer added to its output, trained with the LoRA."})
    kt_lora_expert_num: int = field(default=2, metadata={"help": "N LoRA Experts per MoE layer (0 means 2)."})
    kt_lora_expert_intermediate_size: int = field(default=1024, metadata={
        "help": "Intermediate size of each LoRA Expert (0 means 1024)."})
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
        for name in ("save_total_limit", "preprocessing_num_workers", "max_samples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.dataloader_num_workers < 0:
            raise ConfigError(f"dataloader_num_workers: expected 0 or more, got {self.dataloader_num_workers}")
        if self.lora_alpha <= 0 or self.learning_rate <= 0:
            raise ConfigError("lora_alpha and learning_rate must be positive")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout: expected 0 <= p < 1, got {self.lora_dropout}")
        if self.lr_scheduler_type not in SCHEDULERS:
            raise ConfigError(f"lr_scheduler_type: expected one of {', '.join(SCHEDULERS)}, got {self.lr_scheduler_type!r}")
        if self.save_strategy not in SAVE_STRATEGIES:
            raise ConfigError(f"save_strategy: expected one of {', '.join(SAVE_STRATEGIES)}, got {self.save_strategy!r}")
        if self.kt_cpu_activation is not None and self.kt_cpu_activation not in CPU_ACTIVATION:
            raise ConfigError(f"kt_cpu_activation: expected one of {', '.join(CPU_ACTIVATION)}, got {self.kt_cpu_activation!r}")
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
        if self.use_kt is False:
            raise ConfigError("use_kt: false asks for training without KTransformers' CPU experts; kt_serve always "
                              "trains the routed experts in its kernel (use plain LLaMA-Factory for that)")
        if self.kt_non_expert_weight_path is not None:
            raise ConfigError("kt_non_expert_weight_path: KT's converted non-expert files are not read; kt_serve "
                              "loads the non-expert weights of the checkpoint at model_name_or_path: drop it")
        if self.kt_weight_path is not None:
            path = Path(self.kt_weight_path).expanduser()
            self.kt_weight_path = str(path)
            if path.exists() and (not path.is_dir() or any(path.glob("*.safetensors"))):
                raise ConfigError(f"kt_weight_path: {path} holds KT's converted expert files, which kt_serve does not "
                                  "read; give the packed-weight cache directory the server uses (--kt-weight-cache "
                                  "DIR: created if absent), or drop the field and keep kt_expert_weight_format")
        for name, default in (("kt_lora_expert_num", 2), ("kt_lora_expert_intermediate_size", 1024)):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: expected 0 (the default, {default}) or a positive integer, "
                                  f"got {getattr(self, name)}")
            if getattr(self, name) == 0:  # KT's reading of 0
                setattr(self, name, default)
        if self.cpu_infer is not None:
            if self.kt_config.threads is not None and self.kt_config.threads != self.cpu_infer:
                raise ConfigError(f"cpu_infer ({self.cpu_infer}) and kt_config threads ({self.kt_config.threads}) "
                                  "contradict each other; give one")
            if self.cpu_infer < 1:
                raise ConfigError(f"cpu_infer: expected a positive integer, got {self.cpu_infer}")
            self.kt_config.threads = self.cpu_infer
        max_len = self.kt_config.kt_model_max_length
        if max_len is not None and max_len <= self.cutoff_len:
            raise ConfigError(f"kt_config.kt_model_max_length ({max_len}) must be greater than cutoff_len "
                              f"({self.cutoff_len})")

    @property
    def dataset_names(self) -> list[str]:
        return [name.strip() for name in self.dataset.split(",") if name.strip()]

    @property
    def lora_targets(self) -> list[str]:
        return [name.strip() for name in self.lora_target.split(",") if name.strip()]

    @property
    def lora_scaling(self) -> float:
        return self.lora_alpha / self.lora_rank

    @property
    def gradient_checkpointing(self) -> bool:
        return not self.disable_gradient_checkpointing

    @property
    def use_packing(self) -> bool:
        return self.packing or self.neat_packing

    @property
    def kernel_max_tokens(self) -> int:
        """Tokens one kernel call must take: a micro-batch of rows of at most cutoff_len (or kt_model_max_length)."""
        return (self.kt_config.kt_model_max_length or self.cutoff_len) * self.per_device_train_batch_size

    def no_effect_notes(self) -> list[str]:
        """One line per given field that changes nothing here, saying why (logged at the start of training)."""
        notes = [f"{owner}{f.name}: {f.metadata[NO_EFFECT]}"
                 for owner, obj in (("", self), ("kt_config.", self.kt_config))
                 for f in dataclasses.fields(obj) if NO_EFFECT in f.metadata and getattr(obj, f.name) is not None]
        if self.kt_cpu_activation == "retain" and not self.gradient_checkpointing:
            notes.append("kt_cpu_activation: retain only matters under gradient checkpointing, which "
                         "disable_gradient_checkpointing: true turns off (every activation is kept anyway)")
        if self.packing and not self.neat_packing:
            notes.append("packing: rows are packed without attention between their examples (LLaMA-Factory's "
                         "neat_packing), so a packed step computes exactly what the unpacked examples would")
        return notes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(owner: str, name: str, annotation, value, metadata=None):
    """Check ``value`` against a field annotation (int/float/bool/str, optionals, unions); ints pass as floats."""
    hints = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if isinstance(value, bool) and value in (metadata or {}).get("yaml_bool", {}):
        return metadata["yaml_bool"][value]
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
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hints.append(owner + name + (f" (did you mean {owner}{close[0]}?)" if close else ""))
        raise ConfigError(f"unknown field(s) {', '.join(hints)}; see `python -m kt_serve.train --help-fields`")
    kwargs = {}
    for name, value in raw.items():
        if hints[name] is KTConfig:
            if not isinstance(value, dict):
                raise ConfigError(f"{owner}{name}: expected a mapping")
            kwargs[name] = _build(KTConfig, value, owner=f"{name}.")
        else:
            kwargs[name] = _coerce(owner, name, hints[name], value, known[name].metadata)
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


def describe_fields() -> str:
    """Every field, its default and its meaning (``--help-fields``)."""
    lines = []
    for owner, cls in (("", TrainConfig), ("kt_config.", KTConfig)):
        for f in dataclasses.fields(cls):
            if f.type == "KTConfig" or f.type is KTConfig:
                continue
            default = "required" if f.default is dataclasses.MISSING else repr(f.default)
            meaning = f.metadata.get("help") or (f"accepted, no effect: {f.metadata[NO_EFFECT]}"
                                                 if NO_EFFECT in f.metadata else "")
            lines.append(f"{owner}{f.name} = {default}" + (f"  # {meaning}" if meaning else ""))
    return "\n".join(lines)
