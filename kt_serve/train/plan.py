"""Host memory of a ``kt_serve.train`` run, counted from the config and the checkpoint's headers (``python -m
kt_serve.plan MODEL_DIR --train CONFIG.yaml``): the model as transformers loads it (bf16, every tensor: the peak),
then what stays on the host (routed experts in the kernel's format, the non-expert modules where
``kt_config.dense_device`` puts them), the LoRA parameters with their gradients and AdamW states (fp32: 16 bytes a
value), and the activations of one micro-batch."""

from __future__ import annotations

from pathlib import Path

from kt_serve.formats.checkpoint import LAYER_TENSOR, expert_layer, tensor_entries
from kt_serve.kernel.weights import bytes_per_weight
from kt_serve.plan import GIB, SCHEDULER_BYTES, Plan, _text_config

OPTIMIZER_BYTES = 16  # fp32 value, gradient and AdamW's two moments
EXPERT_PROJ_LEAVES = ("gate_proj", "up_proj", "down_proj")


def training_plan(config_path, available: int | None = None) -> Plan:
    from kt_serve.plan import available_bytes
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


def describe(plan: Plan) -> str:
    return plan.table().replace("peak while loading (the model, plus one staged layer or the dense layers before "
                                "packing)", "peak while loading (transformers' bf16 model)") + \
        ("" if plan.fits else f"\n\ndoes not fit: {max(plan.settled, plan.loaded + plan.staged_bytes) / GIB:.1f} GiB "
                              f"of {plan.available / GIB:.1f}")
