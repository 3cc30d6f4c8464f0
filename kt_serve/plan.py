"""What serving a checkpoint will hold in host memory, counted from its safetensors headers before anything loads:
routed experts in the kernel's format, dense layers, embeddings and lm_head in theirs, the KV cache, the expert
adapters' budget, activations and SGLang's processes; against the memory this host may use (MemAvailable, and the
cgroup's limit). The server refuses at start with this table and the flags that would fit rather than be killed by
the OOM killer minutes into loading (sglang_plugin/args.py); ``python -m kt_serve.plan MODEL_DIR [serve flags]``
prints it::

    python -m kt_serve.plan /models/Qwen3-30B-A3B-FP8 --kt-expert-dtype int4 --kt-dense-dtype int8
    python -m kt_serve.plan /models/Qwen3-30B-A3B --train examples/qwen3_lora.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from kt_serve.formats.checkpoint import DTYPE_BYTES, LAYER_TENSOR, expert_layer, tensor_entries
from kt_serve.kernel.weights import WEIGHT_FORMATS, bytes_per_weight

GIB = 2**30
SCHEDULER_BYTES = int(0.75 * GIB)   # a scheduler process before its model (python, torch, SGLang), per TP rank
DETOKENIZER_BYTES = int(0.65 * GIB)  # SGLang's detokenizer process
RUNTIME_FLOOR = GIB // 2            # allocator slack, sampling, LoRA batch buffers
MIN_KV_TOKENS = 4096                # the smallest KV pool worth serving (without --max-total-tokens)
DENSE_FORMATS = ("bf16", "int8", "int4")


@dataclass
class ServeOptions:
    expert_dtype: str = "auto"
    dense_dtype: str = "bf16"
    lm_head_dtype: str = "bf16"
    group_size: int = 128
    tp_size: int = 1
    max_total_tokens: int | None = None
    chunked_prefill_size: int = 4096
    cpu_host: bool = True             # dense layers, KV and activations in host memory too (else on the accelerator)
    cpu_ops: bool = True              # --kt-cpu-ops: dense layers packed in their formats
    expert_adapter_bytes: int | None = None  # --kt-max-expert-loras as a size; None: auto (a quarter of the rest)


@dataclass
class Plan:
    rows: list = field(default_factory=list)   # (part, format, bytes)
    kv_bytes_per_token: int = 0
    staged_bytes: int = 0                      # the load's transient: one staged layer, the dense layers before packing
    loaded: int = 0                            # what the rows before the adapters and the KV cache hold (the load's)
    available: int = 0
    kv_tokens: int = 0                         # tokens the KV pool gets (asked for, or what the rest holds)
    options: ServeOptions = field(default_factory=ServeOptions)

    @property
    def settled(self) -> int:
        return sum(b for _, _, b in self.rows)

    @property
    def fits(self) -> bool:
        return self.settled <= self.available and self.loaded + self.staged_bytes <= self.available

    def table(self) -> str:
        lines = ["| part | format | GiB |", "|---|---|---|"]
        lines += [f"| {part} | {fmt} | {nbytes / GIB:.2f} |" for part, fmt, nbytes in self.rows]
        lines.append(f"| **settled total** | | **{self.settled / GIB:.2f}** |")
        lines.append(f"| peak while loading (the model, plus one staged layer or the dense layers before packing) | | "
                     f"{(self.loaded + self.staged_bytes) / GIB:.2f} |")
        lines.append(f"| **available to this server** (MemAvailable, cgroup limit) | | **{self.available / GIB:.2f}** |")
        return "\n".join(lines)


def available_bytes() -> int:
    """What this process's cgroup and the host leave: MemAvailable, capped by the cgroup (v2 or v1) limit."""
    import psutil

    avail = psutil.virtual_memory().available
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            avail = min(avail, int(limit) - usage)
    return avail


def _text_config(model_dir) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("text_config") or config, config


def kv_bytes_per_token(text: dict) -> int:
    """bf16 KV bytes per token over the layers that keep one (MLA: its compressed latent; hybrid models: the full
    attention layers only)."""
    layers = int(text["num_hidden_layers"])
    if text.get("kv_lora_rank"):
        return layers * (int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 64))) * 2
    types = text.get("layer_types")
    if types:
        layers = sum(t == "full_attention" for t in types)
    elif text.get("full_attention_interval"):
        layers = layers // int(text["full_attention_interval"])
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    return layers * 2 * int(text.get("num_key_value_heads", text["num_attention_heads"])) * head_dim * 2


def activation_bytes(text: dict, tokens: int) -> int:
    """A prefill chunk's working set: the hidden states through a layer (a dozen H-wide bf16 / fp32 buffers) and
    the routed experts' gate / up / h rows (fp32) of every (token, expert) pair."""
    H = int(text["hidden_size"])
    top_k = int(text.get("num_experts_per_tok") or 0)
    I = int(text.get("moe_intermediate_size") or 0)
    return tokens * (H * 48 + top_k * I * 12)


def serving_plan(model_dir, options: ServeOptions, available: int | None = None) -> Plan:
    text, config = _text_config(model_dir)
    layers = int(text["num_hidden_layers"])
    quant = config.get("quantization_config") or text.get("quantization_config") or {}
    block_k = int((quant.get("weight_block_size") or (128, 128))[1])
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    groups = {"experts": 0.0, "dense": 0.0, "routers and small": 0, "embeddings": 0, "lm_head": 0.0}
    staged_layer: dict[int, int] = {}
    dense_bf16 = 0
    expert_fmt = None
    n_layers_moe = set()
    for e in tensor_entries(model_dir):
        name = e.name
        if name.startswith("mtp.") or (LAYER_TENSOR.match(name) and int(LAYER_TENSOR.match(name).group(1)) >= layers):
            continue  # MTP / nextn layers: not served without speculative decoding
        if name.endswith("_scale_inv") or name.endswith(".weight_scale"):
            if expert_layer(name) is not None:
                staged_layer[expert_layer(name)] = staged_layer.get(expert_layer(name), 0) + e.nbytes
            continue  # folded into the packed weights, or dropped with the dequantized dense weights
        layer = expert_layer(name)
        if layer is not None:
            fmt = options.expert_dtype if options.expert_dtype != "auto" else ("fp8" if e.dtype.startswith("F8")
                                                                                 else "bf16")
            expert_fmt = fmt
            k = int(e.shape[-1])
            groups["experts"] += e.numel * bytes_per_weight(fmt, k, options.group_size, block_k)
            staged_layer[layer] = staged_layer.get(layer, 0) + e.nbytes
            n_layers_moe.add(layer)
            continue
        if "embed_tokens" in name:
            groups["embeddings"] += e.numel * 2
            if tied:
                groups["lm_head"] += _dense_bytes(e, options.lm_head_dtype if options.cpu_ops else "bf16", options)
            continue
        if name.startswith("lm_head"):
            groups["lm_head"] += _dense_bytes(e, options.lm_head_dtype if options.cpu_ops else "bf16", options)
            dense_bf16 += e.numel * 2
            continue
        router = name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight")
        if len(e.shape) == 2 and name.endswith(".weight") and not router and "norm" not in name:
            groups["dense"] += _dense_bytes(e, options.dense_dtype if options.cpu_ops else "bf16", options)
            dense_bf16 += e.numel * 2
        else:
            groups["routers and small"] += e.numel * (2 if e.dtype.startswith("F8") else max(2, _itemsize(e.dtype)))
    plan = Plan(options=options, available=available_bytes() if available is None else available)
    dense_fmt = options.dense_dtype if options.cpu_ops else "bf16"
    head_fmt = options.lm_head_dtype if options.cpu_ops else "bf16"
    if options.cpu_host:
        plan.rows += [(f"routed experts ({len(n_layers_moe)} MoE layers)", f"{expert_fmt}" +
                       (f" g{options.group_size}" if expert_fmt == "int4" else ""), int(groups["experts"])),
                      ("dense layers (attention, shared experts, dense MLPs)", dense_fmt, int(groups["dense"])),
                      ("routers, norms, other small tensors", "bf16 / as stored", int(groups["routers and small"])),
                      ("embeddings", "bf16", int(groups["embeddings"])),
                      ("lm_head" + (" (tied: a packed copy)" if tied else ""), head_fmt, int(groups["lm_head"]))]
    else:
        plan.rows.append((f"routed experts ({len(n_layers_moe)} MoE layers)", expert_fmt or "-", int(groups["experts"])))
    plan.rows.append(("SGLang processes (scheduler per TP rank, detokenizer)", "-",
                      SCHEDULER_BYTES * options.tp_size + DETOKENIZER_BYTES))
    reserve = RUNTIME_FLOOR + (activation_bytes(text, options.chunked_prefill_size) if options.cpu_host else 0)
    plan.rows.append((f"activations (a prefill chunk of {options.chunked_prefill_size} tokens) and runtime", "-", reserve))
    staged = max(staged_layer.values(), default=0)
    dense_transient = max(0, dense_bf16 - int(groups["dense"]) - (0 if tied else int(groups["lm_head"])))
    plan.staged_bytes = max(staged, dense_transient if options.cpu_host else 0)
    plan.loaded = plan.settled
    rest = plan.available - plan.loaded
    adapters = options.expert_adapter_bytes if options.expert_adapter_bytes is not None else max(rest, 0) // 4
    plan.rows.append(("expert adapters (--kt-max-expert-loras" + (", auto: a quarter of the rest)"
                                                                   if options.expert_adapter_bytes is None else ")"),
                      "bf16", adapters))
    rest -= adapters
    if options.cpu_host:
        plan.kv_bytes_per_token = kv_bytes_per_token(text)
        fit_tokens = max(rest, 0) // max(plan.kv_bytes_per_token, 1)
        plan.kv_tokens = min(fit_tokens, options.max_total_tokens or fit_tokens)
        tokens = options.max_total_tokens or MIN_KV_TOKENS
        plan.rows.append((f"KV cache ({tokens} tokens × {plan.kv_bytes_per_token / 1024:.1f} KiB"
                          + ("; SGLang gives it the rest" if not options.max_total_tokens else "") + ")", "bf16",
                          tokens * plan.kv_bytes_per_token))
    else:
        plan.kv_tokens = options.max_total_tokens or MIN_KV_TOKENS
    return plan


def _itemsize(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 2)


def _dense_bytes(e, fmt: str, options: ServeOptions) -> float:
    return e.numel * bytes_per_weight(fmt, int(e.shape[-1]), options.group_size)


def suggestions(model_dir, options: ServeOptions, available: int) -> list[str]:
    """Flags that would fit, smallest change first: cheaper expert / dense / lm_head formats, then a KV cap."""
    out = []
    cheaper = {"int8": ["int4"], "int4": []}.get(options.expert_dtype, ["int8", "int4"])
    for expert in cheaper:
        for dense in DENSE_FORMATS[DENSE_FORMATS.index(options.dense_dtype):]:
            if dense != "bf16" and not options.cpu_ops:
                continue
            tried = replace(options, expert_dtype=expert, dense_dtype=dense,
                            lm_head_dtype=dense if dense != "bf16" else options.lm_head_dtype)
            if serving_plan(model_dir, tried, available).fits:
                flags = f"--kt-expert-dtype {expert}"
                if dense != options.dense_dtype:
                    flags += f" --kt-dense-dtype {dense} --kt-lm-head-dtype {dense}"
                out.append(flags)
                break
        if out:
            break
    plan = serving_plan(model_dir, replace(options, max_total_tokens=None), available)
    if options.max_total_tokens and plan.kv_tokens >= MIN_KV_TOKENS:
        out.append(f"--max-total-tokens {plan.kv_tokens}")
    return out


def refusal(model_dir, options: ServeOptions, available: int | None = None) -> str | None:
    """One message (with the table) when the checkpoint will not fit this host as asked, else None."""
    plan = serving_plan(model_dir, options, available)
    if plan.fits:
        return None
    need = max(plan.settled, plan.loaded + plan.staged_bytes)
    fixes = suggestions(model_dir, options, plan.available)
    why = (f"needs {need / GIB:.1f} GiB (settled {plan.settled / GIB:.1f}, peak while loading "
           f"{(plan.loaded + plan.staged_bytes) / GIB:.1f}) of the {plan.available / GIB:.1f} GiB this host has "
           "available")
    return (f"kt_serve: {model_dir} will not fit: it {why}; "
            + (f"try {' or '.join(fixes)}" if fixes else "no kernel format fits it on this host")
            + " (python -m kt_serve.plan prints this table)\n" + plan.table())


# -- training --------------------------------------------------------------------------------------------------------
# A kt_serve.train run: the model as transformers loads it (bf16, every tensor: the peak), then what stays on the
# host (routed experts in the kernel's format, the non-expert modules where kt_config.dense_device puts them), the
# LoRA parameters with their gradients and AdamW states (fp32: 16 bytes a value), and one micro-batch's activations.
OPTIMIZER_BYTES = 16  # fp32 value, gradient and AdamW's two moments


def training_plan(config_path, available: int | None = None) -> Plan:
    from kt_serve.train.config import load_config

    cfg = load_config(config_path)
    model_dir = Path(cfg.model_name_or_path)
    text, _ = _text_config(model_dir)
    layers = int(text["num_hidden_layers"])
    dense_on_host = cfg.kt_config.dense_device == "cpu" or (cfg.kt_config.dense_device == "auto" and not _cuda())
    fmt = cfg.kt_config.kt_expert_weight_format
    r = int(cfg.lora_rank)
    targets = set(cfg.lora_targets)
    everything = "all" in targets
    loaded = experts = dense = lora_dense = lora_experts = 0
    for e in tensor_entries(model_dir):
        if e.name.startswith("mtp.") or (LAYER_TENSOR.match(e.name) and int(LAYER_TENSOR.match(e.name).group(1)) >= layers):
            continue
        if e.name.endswith("_scale_inv"):
            continue
        loaded += e.numel * 2
        if expert_layer(e.name) is not None:
            experts += e.numel * bytes_per_weight(fmt, int(e.shape[-1]), 128)
            leaf = e.name.rsplit(".", 2)[-2]
            if everything or leaf in targets:  # A [r, K] and B [N, r] of this expert's projection
                lora_experts += r * (int(e.shape[0]) + int(e.shape[1]))
            continue
        dense += e.numel * 2
        leaf = e.name.rsplit(".", 2)[-2] if e.name.endswith(".weight") else ""
        if len(e.shape) == 2 and not e.name.startswith("lm_head") and "embed" not in e.name and \
                (everything or leaf in targets):
            lora_dense += r * (int(e.shape[0]) + int(e.shape[1]))
    tokens = int(cfg.per_device_train_batch_size) * int(cfg.cutoff_len)
    H, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    top_k, I = int(text.get("num_experts_per_tok") or 0), int(text.get("moe_intermediate_size") or 0)
    checkpointed = not cfg.disable_gradient_checkpointing
    # a layer input kept per layer (checkpointing) or a layer's whole working set per layer; fp32 logits and their
    # gradient; the kernel's saved gate / up / h rows of the layer being recomputed
    per_layer = tokens * H * 2 if checkpointed else tokens * (H * 48 + top_k * I * 12)
    activations = layers * per_layer + tokens * (H * 48 + top_k * I * 12) + 2 * tokens * vocab * 4
    plan = Plan(available=available_bytes() if available is None else available)
    plan.rows = [
        (f"routed experts in the kernel ({cfg.kt_config.kt_expert_weight_format})", fmt, int(experts)),
        ("non-expert modules" + ("" if dense_on_host else " (on the GPU: not counted)"), "bf16",
         dense if dense_on_host else 0),
        (f"expert LoRA, rank {r}, with gradients and AdamW states", "fp32", lora_experts * OPTIMIZER_BYTES),
        ("non-expert LoRA" + ("" if dense_on_host else " (on the GPU: not counted)"), "fp32",
         lora_dense * OPTIMIZER_BYTES if dense_on_host else 0),
        (f"activations ({tokens} tokens a micro-batch{', checkpointed' if checkpointed else ''})", "bf16 / fp32",
         activations if dense_on_host else int(top_k * I * 12 * tokens)),
        ("python, torch, transformers", "-", SCHEDULER_BYTES),
    ]
    plan.loaded = SCHEDULER_BYTES
    plan.staged_bytes = int(loaded)  # transformers materializes the whole model in bf16 before the kernel packs
    return plan


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def describe_training(plan: Plan) -> str:
    return plan.table().replace("peak while loading (the model, plus one staged layer or the dense layers before "
                                "packing)", "peak while loading (transformers' bf16 model)") + \
        ("" if plan.fits else f"\n\ndoes not fit: {max(plan.settled, plan.loaded + plan.staged_bytes) / GIB:.1f} GiB "
                              f"of {plan.available / GIB:.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model_dir", nargs="?", help="the checkpoint to serve (with --train: the config's model)")
    ap.add_argument("--kt-expert-dtype", default="auto", choices=["auto", *WEIGHT_FORMATS])
    ap.add_argument("--kt-dense-dtype", default="bf16", choices=DENSE_FORMATS)
    ap.add_argument("--kt-lm-head-dtype", default="bf16", choices=DENSE_FORMATS)
    ap.add_argument("--kt-expert-group-size", type=int, default=128)
    ap.add_argument("--kt-cpu-ops", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--kt-max-expert-loras", default="auto")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--chunked-prefill-size", type=int, default=4096)
    ap.add_argument("--device", default="cpu", help="cpu (everything in host memory) or an accelerator (experts only)")
    ap.add_argument("--available", default=None, help="memory to plan against (e.g. 24GiB; default: this host's)")
    ap.add_argument("--train", default=None, metavar="CONFIG.yaml", help="plan a kt_serve.train run instead")
    args = ap.parse_args(argv)
    from kt_serve.sglang_plugin.config import ExpertBudget

    available = ExpertBudget.parse(args.available).nbytes if args.available else None
    if args.train:
        plan = training_plan(args.train, available)
        print(describe_training(plan))
        return 0 if plan.fits else 1
    if args.model_dir is None:
        ap.error("MODEL_DIR is required without --train")
    budget = ExpertBudget.parse(args.kt_max_expert_loras)
    options = ServeOptions(expert_dtype=args.kt_expert_dtype, dense_dtype=args.kt_dense_dtype,
                           lm_head_dtype=args.kt_lm_head_dtype, group_size=args.kt_expert_group_size,
                           tp_size=args.tp_size, max_total_tokens=args.max_total_tokens,
                           chunked_prefill_size=args.chunked_prefill_size, cpu_host=args.device == "cpu",
                           cpu_ops=args.kt_cpu_ops != "off" and args.device == "cpu",
                           expert_adapter_bytes=budget.nbytes if not budget.auto else None)
    plan = serving_plan(args.model_dir, options, available)
    print(plan.table())
    message = refusal(args.model_dir, options, plan.available)
    print("\nfits" if message is None else "\n" + message.splitlines()[0])
    return 0 if message is None else 1


if __name__ == "__main__":
    sys.exit(main())
