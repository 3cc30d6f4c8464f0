"""kt_serve.convert on Qwen3.5-MoE KT SFT output: hybrid layers (GDN linear attention + gated full attention) and a
shared expert; the base model's layer_types and linear_* dims are checked against the adapter."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kt_serve.formats import FormatError, write_kt_sft_output
from kt_serve.formats.export import convert_adapter
from kt_serve.harness.tiny_model import build_tiny_moe
from qwen35_adapters import qwen35_adapter, text_config, write_qwen35_adapter


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("qwen35") / "model", "qwen3_5_moe")


def test_qwen35_adapter_converts_with_every_tensor(model, tmp_path):
    src = write_qwen35_adapter(tmp_path / "sft", model, seed=1)
    peft, kt = qwen35_adapter(model, seed=1)
    summary = convert_adapter(src, merged_dir=tmp_path / "merged", expert_dir=tmp_path / "expert",
                              nonexpert_dir=tmp_path / "nonexpert")
    assert any("Checked shapes" in n for n in summary["notes"])
    nonexpert = load_file(tmp_path / "nonexpert" / "adapter_model.safetensors")
    assert len(nonexpert) == len(peft)
    for key, value in peft.items():  # the ConditionalGeneration model's names (the reference's cleanup), unchanged
        assert torch.equal(nonexpert[key], value), key
    experts = load_file(tmp_path / "expert" / "adapter_model.safetensors")
    E = text_config(model)["num_experts"]
    assert len(experts) == len(kt) * E * 6


def test_linear_attention_lora_on_a_full_attention_layer_is_refused(model, tmp_path):
    peft, kt = qwen35_adapter(model, seed=2)
    moved = {k.replace("layers.0.linear_attn", "layers.3.linear_attn"): v for k, v in peft.items()}
    src = write_kt_sft_output(tmp_path / "sft", nonexpert=moved, experts=kt,
                              adapter_config={"r": 4, "lora_alpha": 8.0}, base_model_name_or_path=str(model))
    with pytest.raises(FormatError, match=r"layer 3 is full_attention in the base model but the adapter has "
                                          r"linear_attn LoRA"):
        convert_adapter(src, nonexpert_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gdn_shapes_of_another_model_are_refused(model, tmp_path):
    peft, kt = qwen35_adapter(model, seed=3)
    key = "model.language_model.layers.1.linear_attn.in_proj_qkv.lora_B.weight"
    peft[key] = peft[key][:-8]
    src = write_kt_sft_output(tmp_path / "sft", nonexpert=peft, experts=kt,
                              adapter_config={"r": 4, "lora_alpha": 8.0}, base_model_name_or_path=str(model))
    c = text_config(model)
    want = 2 * c["linear_key_head_dim"] * c["linear_num_key_heads"] + c["linear_value_head_dim"] * c["linear_num_value_heads"]
    with pytest.raises(FormatError, match=rf"{key} has {want - 8} rows; the base model's in_proj_qkv has {want}"):
        convert_adapter(src, merged_dir=tmp_path / "out")
