"""kt_serve.formats against independent references: safetensors.save_file, hand-built KT dirs, PEFT itself."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kt_serve import formats
from kt_serve.formats import FormatError


def test_streamed_writer_is_byte_identical_to_save_file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.10.mlp.experts.3.up_proj.lora_B.weight": torch.randn(7, 3, generator=gen).bfloat16(),
        "model.layers.2.self_attn.q_proj.lora_A.weight": torch.randn(3, 5, generator=gen),
        "b.half": torch.randn(2, 2, generator=gen).half(),
        "c.double": torch.randn(4, generator=gen).double(),
        "d.int": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "e.empty": torch.zeros(0, 3),
    }
    save_file(tensors, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    layout = {key: (value.dtype, tuple(value.shape)) for key, value in tensors.items()}
    writer = formats.SafetensorsWriter(tmp_path / "streamed.safetensors", layout, {"format": "pt"})
    for key in reversed(list(tensors)):  # any order
        writer.write(key, tensors[key])
    writer.close()
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_read_fused_expert_lora_returns_the_file_tensors(kt_run):
    path, experts, _ = kt_run
    read = formats.read_fused_expert_lora(path / "fused_expert_lora.safetensors")
    assert sorted(read) == [0, 1]
    for layer, tensors in experts.items():
        assert list(read[layer]) == list(formats.KT_TENSOR_NAMES)
        for name, tensor in tensors.items():
            assert read[layer][name].dtype == torch.bfloat16 and torch.equal(read[layer][name], tensor)
    E, H, I, r = 4, 32, 16, 4
    assert [tuple(read[0][n].shape) for n in formats.KT_TENSOR_NAMES] == [
        (E, r, H), (E, I, r), (E, r, H), (E, I, r), (E, r, I), (E, H, r)]


def test_expert_peft_tensors_reference_naming_and_roundtrip(kt_helpers):
    experts = kt_helpers.random_experts((0, 3), E=2, H=5, I=7, r=3, dtype=torch.float32)
    peft = formats.expert_peft_tensors(experts)
    assert len(peft) == 2 * 6 * 2
    # hand-written reference mapping (notes section 3): A = *_lora_a[e], B = *_lora_b[e], no transpose
    assert torch.equal(peft["model.layers.3.mlp.experts.1.gate_proj.lora_A.weight"], experts[3]["gate_lora_a"][1])
    assert torch.equal(peft["model.layers.0.mlp.experts.0.down_proj.lora_B.weight"], experts[0]["down_lora_b"][0])
    assert peft["model.layers.3.mlp.experts.1.gate_proj.lora_A.weight"].shape == (3, 5)
    assert peft["model.layers.0.mlp.experts.0.down_proj.lora_B.weight"].shape == (5, 3)
    assert peft["model.layers.0.mlp.experts.1.up_proj.lora_B.weight"].shape == (7, 3)
    back = formats.fuse_expert_peft_tensors(peft)
    for layer in experts:
        for name in formats.KT_TENSOR_NAMES:
            assert torch.equal(back[layer][name], experts[layer][name])
    # PEFT's own saved prefix is accepted on the way back
    prefixed = {f"base_model.model.{key}": value for key, value in peft.items()}
    assert torch.equal(formats.fuse_expert_peft_tensors(prefixed)[3]["up_lora_b"], experts[3]["up_lora_b"])


def test_write_peft_adapter_files(tmp_path):
    tensors = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 3)}
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    out = formats.write_peft_adapter(tmp_path / "out", tensors, config)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (out / "adapter_config.json").read_text() == json.dumps(config, indent=2, sort_keys=True) + "\n"
    from safetensors import safe_open
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    with pytest.raises(FormatError, match="not empty"):
        formats.write_peft_adapter(out, tensors, config)
    formats.write_peft_adapter(out, {"x.lora_A.weight": torch.zeros(1, 1)}, config, overwrite=True)
    assert list(load_file(str(out / "adapter_model.safetensors"))) == ["x.lora_A.weight"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dirs left behind


def test_write_kt_sft_output_matches_kt_layout(tmp_path, kt_helpers):
    experts = kt_helpers.random_experts((0, 1), E=4, H=32, I=16, r=4, dtype=torch.float32)
    nonexpert = kt_helpers.random_nonexpert((0, 1), r=4)
    config = kt_helpers.peft_config()
    out = formats.write_kt_sft_output(tmp_path / "run", nonexpert=nonexpert, experts=experts, adapter_config=config,
                                      base_model_name_or_path="/models/base")
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "fused_expert_lora.safetensors", "kt_adapter_manifest.json"]
    peft = load_file(str(out / "adapter_model.safetensors"))
    assert sorted(peft) == sorted(f"base_model.model.{key}" for key in nonexpert)
    fused = load_file(str(out / "fused_expert_lora.safetensors"))
    assert sorted(fused) == sorted(f"layers.{l}.experts.{n}" for l in (0, 1) for n in formats.KT_TENSOR_NAMES)
    assert all(t.dtype == torch.bfloat16 for t in fused.values())  # KT writes BF16
    assert torch.equal(fused["layers.1.experts.down_lora_b"], experts[1]["down_lora_b"].bfloat16())
    manifest = json.loads((out / "kt_adapter_manifest.json").read_text())
    assert manifest["version"] == 1 and manifest["status"] == "ready"
    assert manifest["base"] == {"model_name_or_path": "/models/base"}
    assert manifest["lora"] == {"rank": 4, "alpha": 16.0}
    assert sorted(manifest["artifacts"]) == ["adapter_config.json", "adapter_model.safetensors",
                                             "fused_expert_lora.safetensors"]
    for name, record in manifest["artifacts"].items():
        data = (out / name).read_bytes()
        assert record["size"] == len(data) and record["sha256"] == hashlib.sha256(data).hexdigest()
    contract = manifest["artifacts"]["fused_expert_lora.safetensors"]
    assert contract["tensor_count"] == 12
    assert contract["tensors"]["layers.0.experts.gate_lora_b"] == {"shape": [4, 16, 4], "dtype": "BF16"}
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == "/models/base" and written["lora_alpha"] == 16


def test_load_adapter_dir_kt_run(kt_run):
    path, experts, nonexpert = kt_run
    adapter = formats.load_adapter_dir(path)
    assert (adapter.rank, adapter.alpha, adapter.expert_format) == (4, 16, "kt_fused")
    assert sorted(adapter.nonexpert) == sorted(nonexpert)  # cleaned: no base_model.model.
    assert all(torch.equal(adapter.nonexpert[k], v) for k, v in nonexpert.items())
    assert all(torch.equal(adapter.experts[1][n], experts[1][n]) for n in formats.KT_TENSOR_NAMES)


def test_load_adapter_dir_per_expert_kt_run(tmp_path, kt_helpers):
    experts = kt_helpers.random_experts((0, 1), E=3, H=6, I=5, r=2, dtype=torch.float32)
    nonexpert = kt_helpers.random_nonexpert((0,), r=2, modules={"q_proj": (6, 6)})
    path = kt_helpers.write_run(tmp_path / "run", experts=experts, nonexpert=nonexpert,
                                config=kt_helpers.peft_config(r=2), fused=False)
    adapter = formats.load_adapter_dir(path)
    assert adapter.expert_format == "peft_per_expert" and sorted(adapter.nonexpert) == sorted(nonexpert)
    for layer in (0, 1):
        for name in formats.KT_TENSOR_NAMES:
            assert torch.equal(adapter.experts[layer][name], experts[layer][name])


def test_orig_module_and_prefix_cleaning(tmp_path, kt_helpers):
    path = tmp_path / "run"
    path.mkdir()
    a, b = torch.randn(2, 4), torch.randn(4, 2)
    save_file({"base_model.model.model.layers.0.mlp.shared_expert.gate_proj.orig_module.lora_A.weight": a,
               "base_model.model.model.layers.0.mlp.shared_expert.gate_proj.orig_module.lora_B.weight": b},
              str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    adapter = formats.load_adapter_dir(path)
    assert sorted(adapter.nonexpert) == ["model.layers.0.mlp.shared_expert.gate_proj.lora_A.weight",
                                         "model.layers.0.mlp.shared_expert.gate_proj.lora_B.weight"]
    assert adapter.experts == {}  # a shared expert is not a routed expert


def test_config_rules_match_the_reference():
    config = {"r": 3, "lora_alpha": 9, "lora_dropout": 0.05, "target_modules": ["model.layers.0.mlp.gate", "q_proj"],
              "target_parameters": None}
    keys = ["model.layers.0.self_attn.v_proj.lora_A.weight", "model.layers.0.linear_attn.out_proj.lora_A.weight",
            "model.layers.0.mlp.shared_expert_gate.lora_A.weight", "model.embed_tokens.lora_embedding_A"]
    common = dict(rank=3, alpha=9, base_model_name_or_path="/b")
    merged = formats.merged_config(config, nonexpert_keys=keys, **common)
    assert merged["target_modules"] == ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "out_proj",
                                        "embed_tokens", "gate", "shared_expert_gate"]
    assert (merged["r"], merged["lora_alpha"], merged["base_model_name_or_path"]) == (3, 9, "/b")
    assert (merged["peft_type"], merged["bias"], merged["task_type"], merged["lora_dropout"]) == (
        "LORA", "none", "CAUSAL_LM", 0.05)
    assert formats.expert_config(config, **common)["target_modules"] == ["gate_proj", "up_proj", "down_proj"]
    assert formats.nonexpert_config(config, nonexpert_keys=keys, **common)["target_modules"] == [
        "v_proj", "out_proj", "embed_tokens", "shared_expert_gate"]


def test_alpha_precedence(tmp_path):
    assert formats.resolve_alpha({"lora_alpha": 9}, 16.0, {"lora": {"alpha": 4.0}}, tmp_path) == 9
    assert formats.resolve_alpha({}, 16.0, {"lora": {"alpha": 4.0}}, tmp_path) == 16.0
    assert formats.resolve_alpha({}, None, {"lora": {"alpha": 4.0}}, tmp_path) == 4.0
    with pytest.raises(FormatError, match="pass --lora-alpha"):
        formats.resolve_alpha({}, None, None, tmp_path)


@pytest.mark.parametrize("config, problem", [
    ({"num_hidden_layers": 1, "num_local_experts": 4, "hidden_size": 32, "moe_intermediate_size": 16},
     "num_hidden_layers=1 but the adapter has expert LoRA for layer 1"),
    ({"num_experts": 8, "hidden_size": 32, "moe_intermediate_size": 16}, "num_experts=8"),
    ({"n_routed_experts": 4, "hidden_size": 32, "moe_intermediate_size": 16, "first_k_dense_replace": 1},
     "layer 0 is a dense MLP layer"),
    ({"text_config": {"num_experts": 4, "hidden_size": 64, "moe_intermediate_size": 16}}, "hidden_size=64"),
    ({"num_experts": 4, "hidden_size": 32, "moe_intermediate_size": 12}, "moe_intermediate_size=12"),
])
def test_base_model_check_field_names(tmp_path, config, problem):
    (tmp_path / "config.json").write_text(json.dumps(config))
    geometry = formats.ExpertGeometry(num_experts=4, rank=4, hidden=32, intermediate=16)
    with pytest.raises(FormatError, match=problem):
        formats.check_base_model(tmp_path / "config.json", [0, 1], geometry)


def test_base_model_resolved_from_local_dir_and_hf_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--org--tiny-moe" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--tiny-moe" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny-moe" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert formats.resolve_base_model_config("org/tiny-moe") == (snapshot / "config.json", None)
    assert formats.resolve_base_model_config(str(snapshot)) == (snapshot / "config.json", None)
    path, note = formats.resolve_base_model_config("org/not-cached")
    assert path is None and "neither a local directory nor in the Hugging Face cache" in note


def test_target_parameters_adapter_matches_peft_delta_weights(tmp_path):
    """PEFT `target_parameters` on transformers 5.x fused experts, read into KT layout: per-expert deltas
    s*B@A must equal PEFT's own get_delta_weight (A rows expert-major, B columns expert-minor)."""
    peft = pytest.importorskip("peft")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=8,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(config)
    lora = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj"], init_lora_weights=False,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft_model = peft.get_peft_model(model, lora)
    peft_model.save_pretrained(tmp_path / "tp")
    adapter = formats.load_adapter_dir(tmp_path / "tp")
    assert adapter.expert_format == "peft_target_parameters" and (adapter.rank, adapter.alpha) == (2, 6)
    assert any(".self_attn.q_proj.lora_A" in key for key in adapter.nonexpert)
    scale = 6 / 2
    for layer in range(2):
        outer = peft_model.base_model.model.model.layers[layer].mlp.experts  # down_proj wrapper
        inner = outer.base_layer  # gate_up_proj wrapper
        assert {outer.parameter_name, inner.parameter_name} == {"down_proj", "gate_up_proj"}
        gate_up = (inner if inner.parameter_name == "gate_up_proj" else outer).get_delta_weight("default")
        down = (outer if outer.parameter_name == "down_proj" else inner).get_delta_weight("default")
        kt = adapter.experts[layer]
        assert kt["gate_lora_a"].shape == (4, 2, 32) and kt["down_lora_b"].shape == (4, 32, 2)
        for e in range(4):
            torch.testing.assert_close(scale * kt["gate_lora_b"][e] @ kt["gate_lora_a"][e], gate_up[e, :8])
            torch.testing.assert_close(scale * kt["up_lora_b"][e] @ kt["up_lora_a"][e], gate_up[e, 8:])
            torch.testing.assert_close(scale * kt["down_lora_b"][e] @ kt["down_lora_a"][e], down[e])


def test_concurrent_publish_of_the_same_dir(tmp_path):
    """Two writers (e.g. two TP ranks splitting one adapter): the second gets FileExistsError, no temp dir left."""
    from kt_serve.formats.safetensors_io import StagedDir

    first, second = StagedDir(tmp_path / "out", overwrite=False), StagedDir(tmp_path / "out", overwrite=False)
    (first.path / "a").write_text("1")
    (second.path / "a").write_text("2")
    first.publish()
    with pytest.raises(FileExistsError, match="not empty"):
        second.publish()
    second.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (tmp_path / "out" / "a").read_text() == "1"
