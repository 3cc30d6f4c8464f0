"""Shared fixtures: KT SFT output directories built by hand with safetensors/json/hashlib (not by kt_serve)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

@pytest.fixture(scope="session", autouse=True)
def _tokenized_cache(tmp_path_factory):
    """kt_serve.train's tokenized-dataset cache goes to a per-session directory, never the user's ~/.cache."""
    import os

    os.environ["KT_SERVE_CACHE"] = str(tmp_path_factory.mktemp("kt_serve_cache"))
    yield


# Tiny Qwen3-MoE geometry shared with the PEFT load test: hidden 32, 4 experts, moe intermediate 16, 2 layers.
KT_DIMS = dict(layers=(0, 1), E=4, H=32, I=16, r=4)
KT_ATTENTION = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32)}  # (in, out)


def kt_random_experts(layers, E, H, I, r, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate_lora_a": (E, r, H), "gate_lora_b": (E, I, r), "up_lora_a": (E, r, H),
              "up_lora_b": (E, I, r), "down_lora_a": (E, r, I), "down_lora_b": (E, H, r)}
    return {layer: {name: torch.randn(*shape, generator=gen).to(dtype) for name, shape in shapes.items()}
            for layer in layers}


def kt_random_nonexpert(layers, r, modules=KT_ATTENTION, dtype=torch.float32, seed=1, prefix="model."):
    """Cleaned PEFT keys (no base_model.model.) of attention LoRA."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        for module, (fan_in, fan_out) in modules.items():
            base = f"{prefix}layers.{layer}.self_attn.{module}"
            out[f"{base}.lora_A.weight"] = torch.randn(r, fan_in, generator=gen).to(dtype)
            out[f"{base}.lora_B.weight"] = torch.randn(fan_out, r, generator=gen).to(dtype)
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kt_write_run(directory: Path, *, experts, nonexpert, config, fused=True, manifest=False,
                 base="Qwen/tiny-moe") -> Path:
    """What a KT SFT run writes (notes section 1), by hand."""
    directory.mkdir(parents=True)
    peft = {f"base_model.model.{key}": value for key, value in nonexpert.items()}
    if fused:
        save_file({f"layers.{layer}.experts.{name}": tensor for layer, tensors in experts.items()
                   for name, tensor in tensors.items()}, str(directory / "fused_expert_lora.safetensors"))
    else:  # transformers 4.x per-expert nn.Linear experts: expert LoRA stays inside adapter_model.safetensors
        for layer, tensors in experts.items():
            for name, tensor in tensors.items():
                proj, side = name.split("_lora_")
                for e in range(tensor.shape[0]):
                    key = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}_proj.lora_{side.upper()}.weight"
                    peft[key] = tensor[e].clone()
    if peft:
        save_file(peft, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if manifest:
        fused_path = directory / "fused_expert_lora.safetensors"
        tensors = {f"layers.{layer}.experts.{name}": {"shape": list(t.shape), "dtype": "BF16"}
                   for layer, ts in experts.items() for name, t in ts.items()}
        artifacts = {name: {"size": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
                     for name in ("adapter_config.json", "adapter_model.safetensors", "fused_expert_lora.safetensors")}
        artifacts["fused_expert_lora.safetensors"].update(tensor_count=len(tensors), tensors=dict(sorted(tensors.items())))
        assert fused_path.exists()
        payload = {"version": 1, "status": "ready", "expert_weight_format": "bf16",
                   "base": {"model_name_or_path": base},
                   "lora": {"rank": config["r"], "alpha": float(config["lora_alpha"])}, "artifacts": artifacts}
        (directory / "kt_adapter_manifest.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return directory


def kt_peft_config(r=4, alpha=16, **extra):
    """adapter_config.json as PEFT's LoraConfig writes it for a KT run (trimmed to fields that matter)."""
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
              "task_type": "CAUSAL_LM", "base_model_name_or_path": "Qwen/tiny-moe", "target_parameters": None,
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "use_rslora": False}
    config.update(extra)
    return config


@pytest.fixture
def kt_run(tmp_path):
    """A standard KT SFT output (fused experts, attention LoRA, manifest) and the tensors it holds."""
    d = KT_DIMS
    experts = kt_random_experts(d["layers"], d["E"], d["H"], d["I"], d["r"])
    nonexpert = kt_random_nonexpert(d["layers"], d["r"])
    path = kt_write_run(tmp_path / "run", experts=experts, nonexpert=nonexpert, config=kt_peft_config(),
                        manifest=True)
    return path, experts, nonexpert


@pytest.fixture
def kt_model_dir(tmp_path):
    """A local base-model dir whose config.json matches KT_DIMS (Qwen3-MoE, transformers 5.x field names)."""
    path = tmp_path / "base_model"
    path.mkdir()
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": KT_DIMS["H"],
              "num_hidden_layers": len(KT_DIMS["layers"]), "num_local_experts": KT_DIMS["E"],
              "moe_intermediate_size": KT_DIMS["I"], "mlp_only_layers": []}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def kt_helpers():
    """The builders above, for tests that need variations of a KT run."""
    from types import SimpleNamespace

    return SimpleNamespace(dims=KT_DIMS, attention=KT_ATTENTION, random_experts=kt_random_experts,
                           random_nonexpert=kt_random_nonexpert, write_run=kt_write_run, peft_config=kt_peft_config)
