"""Random Qwen3.5-MoE adapters written as KT SFT output, in the names KT training on the official
(ForConditionalGeneration) checkpoint gives them: for the serving tests and evals/bench_serving.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kt_serve.formats import write_kt_sft_output
from kt_serve.harness.reference import EXPERT_SHAPES


def text_config(model_dir):
    return json.loads((Path(model_dir) / "config.json").read_text())["text_config"]


def qwen35_adapter(model_dir, *, seed, rank=4, experts=True, nonexpert=True, lora_experts=0, scale=0.1):
    """(non-expert PEFT tensors, KT expert tensors {layer: {name: tensor}}): LoRA on the full attention (q_proj with
    its gate half, k, v, o), on the linear attention (in_proj_qkv, in_proj_z, out_proj) and on the shared expert;
    random, large enough to move the logprobs. lora_experts: N KT-FT LoRA Experts (I 16) per layer, under KT's
    fixed ``model.layers.{L}`` prefix (not the checkpoint's model.language_model)."""
    c = text_config(model_dir)
    H, heads, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    kd = c["linear_key_head_dim"] * c["linear_num_key_heads"]
    vd = c["linear_value_head_dim"] * c["linear_num_value_heads"]
    S, E, I = c["shared_expert_intermediate_size"], c["num_experts"], c["moe_intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    full = {"self_attn.q_proj": (H, 2 * heads * hd), "self_attn.k_proj": (H, kv * hd),
            "self_attn.v_proj": (H, kv * hd), "self_attn.o_proj": (heads * hd, H)}
    linear = {"linear_attn.in_proj_qkv": (H, 2 * kd + vd), "linear_attn.in_proj_z": (H, vd),
              "linear_attn.out_proj": (vd, H)}
    shared = {"mlp.shared_expert.gate_proj": (H, S), "mlp.shared_expert.up_proj": (H, S),
              "mlp.shared_expert.down_proj": (S, H)}
    peft, kt = {}, {}
    for layer, kind in enumerate(c["layer_types"]):
        modules = {**(full if kind == "full_attention" else linear), **shared} if nonexpert else {}
        for module, (fan_in, fan_out) in modules.items():
            base = f"model.language_model.layers.{layer}.{module}"
            peft[f"{base}.lora_A.weight"] = rnd(rank, fan_in)
            peft[f"{base}.lora_B.weight"] = rnd(fan_out, rank)
        if experts:
            kt[layer] = {name: rnd(*shape(E, H, I, rank)) for name, shape in EXPERT_SHAPES.items()}
        for j in range(lora_experts):
            for proj, shape in (("gate", (16, H)), ("up", (16, H)), ("down", (H, 16))):
                peft[f"model.layers.{layer}.mlp.lora_experts.{j}.le_{proj}.weight"] = rnd(*shape)
    return peft, kt


def write_qwen35_adapter(out_dir, model_dir, *, seed, rank=4, alpha=8.0, experts=True, nonexpert=True,
                         lora_experts=0) -> Path:
    peft, kt = qwen35_adapter(model_dir, seed=seed, rank=rank, experts=experts, nonexpert=nonexpert,
                              lora_experts=lora_experts)
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[1] for k in peft} |
                     ({"gate_proj", "up_proj", "down_proj"} if kt else set()))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "lora_dropout": 0.0,
              "bias": "none", "task_type": "CAUSAL_LM"}
    return write_kt_sft_output(out_dir, nonexpert=peft, experts=kt, adapter_config=config,
                               base_model_name_or_path=str(model_dir), overwrite=True)
