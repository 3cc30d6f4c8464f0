"""python -m kt_serve.convert and the converters/ drop-in, on KT output dirs built by hand (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kt_serve import convert
from kt_serve.formats import KT_TENSOR_NAMES

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
PROJ = {"gate_lora_a": ("gate_proj", "A"), "gate_lora_b": ("gate_proj", "B"), "up_lora_a": ("up_proj", "A"),
        "up_lora_b": ("up_proj", "B"), "down_lora_a": ("down_proj", "A"), "down_lora_b": ("down_proj", "B")}


def expected_expert_tensors(experts):
    """Reference converter's expansion, written out independently of kt_serve."""
    return {f"model.layers.{layer}.mlp.experts.{e}.{PROJ[name][0]}.lora_{PROJ[name][1]}.weight": tensor[e]
            for layer, tensors in experts.items() for name, tensor in tensors.items() for e in range(tensor.shape[0])}


def assert_tensors_equal(path: Path, expected: dict):
    written = load_file(str(path / "adapter_model.safetensors"))
    assert sorted(written) == sorted(expected)
    for key, value in expected.items():
        assert written[key].dtype == value.dtype and written[key].shape == value.shape, key
        assert torch.equal(written[key], value), key


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "kt_serve.convert", *map(str, args)], capture_output=True,
                          text=True, env=ENV, cwd=cwd, timeout=120)


def test_default_outputs_beside_input(kt_run, kt_model_dir):
    path, experts, nonexpert = kt_run
    result = run_cli(path, "--base-model-name-or-path", kt_model_dir)
    assert result.returncode == 0, result.stderr
    expert_dir, nonexpert_dir = path.parent / "run_expert", path.parent / "run_nonexpert"
    assert sorted(p.name for p in path.parent.iterdir()) == ["base_model", "run", "run_expert", "run_nonexpert"]
    lines = result.stdout.splitlines()
    assert f"Checked shapes against {kt_model_dir / 'config.json'}" in lines
    assert ("Converted KT fused expert LoRA adapter: 64 tensors, rank=4, target_modules="
            "['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']") in lines
    assert (f"Wrote expert adapter: 48 tensors, target_modules=['gate_proj', 'up_proj', 'down_proj'], "
            f"output_dir={expert_dir}") in lines
    assert f"output_dir={nonexpert_dir}" in lines[-1]

    assert_tensors_equal(expert_dir, expected_expert_tensors(experts))
    assert_tensors_equal(nonexpert_dir, nonexpert)
    expert_keys = set(load_file(str(expert_dir / "adapter_model.safetensors")))
    nonexpert_keys = set(load_file(str(nonexpert_dir / "adapter_model.safetensors")))
    assert not expert_keys & nonexpert_keys
    assert all(".mlp.experts." in k for k in expert_keys) and not any(".mlp.experts." in k for k in nonexpert_keys)

    input_config = json.loads((path / "adapter_config.json").read_text())
    expert_config = json.loads((expert_dir / "adapter_config.json").read_text())
    assert expert_config == {**input_config, "target_modules": ["gate_proj", "up_proj", "down_proj"],
                             "base_model_name_or_path": str(kt_model_dir)}
    nonexpert_config = json.loads((nonexpert_dir / "adapter_config.json").read_text())
    assert nonexpert_config == {**input_config, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                                "base_model_name_or_path": str(kt_model_dir)}
    assert (expert_dir / "adapter_config.json").read_text().endswith("}\n")


def test_reference_case_merged_and_split(tmp_path, kt_helpers):
    """The upstream unit test's data: E=2, H=5, I=7, r=3, fp32, layer 2, config alpha 9 beats CLI 16."""
    experts = kt_helpers.random_experts((2,), E=2, H=5, I=7, r=3, dtype=torch.float32)
    nonexpert = {"model.layers.2.self_attn.q_proj.lora_A.weight": torch.randn(3, 5),
                 "model.layers.2.self_attn.q_proj.lora_B.weight": torch.randn(5, 3)}
    run = kt_helpers.write_run(tmp_path / "run", experts=experts, nonexpert=nonexpert,
                               config={"r": 3, "lora_alpha": 9, "target_modules": ["q_proj"]})
    code = convert.main([str(run), str(tmp_path / "merged"), "--base-model-name-or-path", "org/base",
                         "--lora-alpha", "16", "--expert-output-dir", str(tmp_path / "e"),
                         "--nonexpert-output-dir", str(tmp_path / "n")])
    assert code == 0
    merged = load_file(str(tmp_path / "merged" / "adapter_model.safetensors"))
    assert len(merged) == 14
    assert merged["model.layers.2.mlp.experts.1.gate_proj.lora_A.weight"].shape == (3, 5)
    assert merged["model.layers.2.mlp.experts.0.down_proj.lora_B.weight"].shape == (5, 3)
    assert_tensors_equal(tmp_path / "merged", {**expected_expert_tensors(experts), **nonexpert})
    assert len(load_file(str(tmp_path / "e" / "adapter_model.safetensors"))) == 12
    config = json.loads((tmp_path / "merged" / "adapter_config.json").read_text())
    assert config == {"r": 3, "lora_alpha": 9, "peft_type": "LORA", "bias": "none", "task_type": "CAUSAL_LM",
                      "base_model_name_or_path": "org/base",
                      "target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"]}


def test_per_expert_input_and_merged_input(tmp_path, kt_helpers):
    """KT output for non-fused models (experts per expert in adapter_model.safetensors) and a merged adapter
    both split into the same expert / non-expert adapters; fused -> per-expert -> fused is lossless."""
    d = kt_helpers.dims
    experts = kt_helpers.random_experts(d["layers"], d["E"], d["H"], d["I"], d["r"])
    nonexpert = kt_helpers.random_nonexpert(d["layers"], d["r"])
    run = kt_helpers.write_run(tmp_path / "run", experts=experts, nonexpert=nonexpert,
                               config=kt_helpers.peft_config(), fused=False)
    assert convert.main([str(run), str(tmp_path / "merged")]) == 0
    assert_tensors_equal(tmp_path / "merged", {**expected_expert_tensors(experts), **nonexpert})
    assert convert.main([str(tmp_path / "merged"), "--expert-output-dir", str(tmp_path / "e"),
                         "--nonexpert-output-dir", str(tmp_path / "n")]) == 0
    assert_tensors_equal(tmp_path / "e", expected_expert_tensors(experts))
    assert_tensors_equal(tmp_path / "n", nonexpert)

    from kt_serve.formats import load_adapter_dir, write_kt_sft_output

    back = load_adapter_dir(tmp_path / "e")
    write_kt_sft_output(tmp_path / "fused_again", nonexpert={}, experts=back.experts,
                        adapter_config={"r": 4, "lora_alpha": 16}, base_model_name_or_path="b")
    fused = load_file(str(tmp_path / "fused_again" / "fused_expert_lora.safetensors"))
    for layer in experts:
        for name in KT_TENSOR_NAMES:
            assert torch.equal(fused[f"layers.{layer}.experts.{name}"], experts[layer][name])


def test_overwrite_replaces_only_after_success(kt_run, tmp_path):
    path, experts, _ = kt_run
    out = tmp_path / "merged"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert convert.main([str(path), str(out)]) == 2  # not empty
    assert convert.main([str(path), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    before = (out / "adapter_model.safetensors").read_bytes()
    fused = load_file(str(path / "fused_expert_lora.safetensors"))
    fused["layers.0.experts.up_lora_b"][0, 0, 0] = float("nan")
    save_file(fused, str(path / "fused_expert_lora.safetensors"))
    (path / "kt_adapter_manifest.json").unlink()
    assert convert.main([str(path), str(out), "--overwrite"]) == 2  # bad input: the old output stays
    assert (out / "adapter_model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "run"]


def test_check_prints_summary(kt_run):
    path, _, _ = kt_run
    result = run_cli("--check", path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith(f"{path}: OK, rank=4, lora_alpha=16")
    assert "experts: kt_fused in fused_expert_lora.safetensors, 2 layers [0..1], E=4, H=32, I=16" in result.stdout
    assert "manifest: verified" in result.stdout
    assert sorted(p.name for p in path.parent.iterdir()) == ["run"]


def test_dropin_script_reference_cli_and_api(kt_run, tmp_path):
    path, experts, nonexpert = kt_run
    script = REPO / "converters" / "convert_kt_to_sglang_adapter.py"
    result = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "m")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "--base-model-name-or-path" in result.stderr  # required, as the reference
    result = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "m"), "--base-model-name-or-path",
                             "org/base", "--expert-output-dir", str(tmp_path / "e")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("Converted KT fused expert LoRA adapter: 64 tensors, rank=4")
    assert_tensors_equal(tmp_path / "m", {**expected_expert_tensors(experts), **nonexpert})

    import importlib.util
    spec = importlib.util.spec_from_file_location("dropin", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    summary = module.convert_kt_to_sglang_adapter(path, tmp_path / "m2", base_model_name_or_path="org/base",
                                                  nonexpert_output_dir=tmp_path / "n2")
    assert summary == {
        "input_dir": str(path), "output_dir": str(tmp_path / "m2"), "tensor_count": 64, "rank": 4,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "lora_alpha": 16,
        "split_outputs": {"nonexpert": {"output_dir": str(tmp_path / "n2"), "tensor_count": 16,
                                        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}}


def test_peft_loads_nonexpert_adapter_on_tiny_qwen3_moe(kt_run, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path, _, nonexpert = kt_run
    assert convert.main([str(path), "--nonexpert-output-dir", str(tmp_path / "n")]) == 0
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2)
    base = Qwen3MoeForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 6))
    # fp32 reference: fold s*B@A into a copy of the base weights by hand
    reference = Qwen3MoeForCausalLM(config).eval()
    reference.load_state_dict(base.state_dict())
    with torch.no_grad():
        for key, a in nonexpert.items():
            if ".lora_A." in key:
                module = reference.get_submodule(key.split(".lora_A.")[0])
                module.weight += (16 / 4) * nonexpert[key.replace("lora_A", "lora_B")] @ a
        expected = reference(ids).logits
    model = peft.PeftModel.from_pretrained(base, tmp_path / "n").eval()
    state = model.state_dict()
    for key, value in nonexpert.items():
        assert torch.equal(state[f"base_model.model.{key.replace('.weight', '.default.weight')}"], value)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)


# ---- bad input: one line naming the file and the problem, exit code 2, no output directories ----

def _fused(path):
    return path / "fused_expert_lora.safetensors"


def _edit_fused(path, edit):
    tensors = load_file(str(_fused(path)))
    edit(tensors)
    save_file(tensors, str(_fused(path)))
    (path / "kt_adapter_manifest.json").unlink()


def _edit_peft(path, edit):
    tensors = load_file(str(path / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "kt_adapter_manifest.json").unlink()


def _edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (path / "adapter_config.json").write_text(json.dumps(config))
    (path / "kt_adapter_manifest.json").unlink()


def _set(key, value):
    return lambda tensors: tensors.__setitem__(key, value)


def _poison(key, value):
    def edit(tensors):
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[3] = value
    return edit


BAD_INPUTS = {
    "missing input dir": (lambda p: __import__("shutil").rmtree(p), "run", "input directory not found"),
    "empty input dir": (lambda p: [f.unlink() for f in p.iterdir()], "run",
                        "holds neither adapter_model.safetensors nor fused_expert_lora.safetensors"),
    "truncated safetensors": (lambda p: _fused(p).write_bytes(_fused(p).read_bytes()[:-100]),
                              "fused_expert_lora.safetensors", "not a readable safetensors file"),
    "corrupt header": (lambda p: _fused(p).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......"),
                       "fused_expert_lora.safetensors", "not a readable safetensors file"),
    "unexpected fused key": (lambda p: _edit_fused(p, _set("model.layers.0.foo", torch.zeros(1))),
                             "fused_expert_lora.safetensors", "unexpected key model.layers.0.foo"),
    "unsupported KT tensor": (lambda p: _edit_fused(p, _set("layers.0.experts.gate_lora_c", torch.zeros(4, 4, 32))),
                              "fused_expert_lora.safetensors", "unsupported KT fused expert LoRA tensor"),
    "unexpected peft key": (lambda p: _edit_peft(p, _set("base_model.model.model.norm.weight", torch.zeros(32))),
                            "adapter_model.safetensors", "unexpected key base_model.model.model.norm.weight"),
    "inconsistent E": (lambda p: _edit_fused(p, lambda t: t.update({k: t[k][:3].contiguous() for k in t
                                                                      if k.startswith("layers.1.")})),
                       "fused_expert_lora.safetensors", "inconsistent expert count: layers.1.experts.gate_lora_a has E=3"),
    "inconsistent r": (lambda p: _edit_fused(p, lambda t: t.update(
        {k: (v[:, :2] if k.endswith("_a") else v[:, :, :2]).contiguous() for k, v in t.items() if k.startswith("layers.1.")})),
                       "fused_expert_lora.safetensors", "inconsistent LoRA rank: layers.1.experts.gate_lora_a has r=2"),
    "missing layer tensor": (lambda p: _edit_fused(p, lambda t: t.pop("layers.1.experts.down_lora_a")),
                             "fused_expert_lora.safetensors", "layer 1 lacks expert tensor(s) down_lora_a"),
    "A/B inner dim": (lambda p: _edit_fused(p, lambda t: t.update({"layers.0.experts.up_lora_b": t["layers.0.experts.up_lora_b"][:, :, :3].contiguous()})),
                      "fused_expert_lora.safetensors",
                      "A/B inner dimension mismatch: layers.0.experts.up_lora_b has rank 3 but layers.0.experts.up_lora_a has rank 4"),
    "nonexpert inner dim": (lambda p: _edit_peft(p, _set("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(32, 3))),
                            "adapter_model.safetensors", "A/B inner dimension mismatch"),
    "NaN expert": (lambda p: _edit_fused(p, _poison("layers.1.experts.down_lora_b", float("nan"))),
                   "fused_expert_lora.safetensors", "layer 1 down_lora_b holds NaN or Inf values"),
    "Inf nonexpert": (lambda p: _edit_peft(p, _poison("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight", float("inf"))),
                      "adapter_model.safetensors", "model.layers.1.self_attn.v_proj.lora_B.weight holds NaN or Inf"),
    "manifest hash": (lambda p: _fused(p).write_bytes(_fused(p).read_bytes()[:-2] + b"\x7f\x7f"),
                      "kt_adapter_manifest.json", "sha256 mismatch for fused_expert_lora.safetensors"),
    "no alpha": (lambda p: _edit_config(p, lora_alpha=None), "adapter_config.json", "pass --lora-alpha"),
    "config rank": (lambda p: _edit_config(p, r=8), "adapter_config.json", "r=8 but the LoRA tensors have rank 4"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input(case, kt_run):
    path, _, _ = kt_run
    damage, file, problem = BAD_INPUTS[case]
    damage(path)
    outputs = [path.parent / "merged", path.parent / "e", path.parent / "n"]
    before = sorted(p.name for p in path.parent.iterdir())
    code = convert.main([str(path), str(outputs[0]), "--expert-output-dir", str(outputs[1]),
                         "--nonexpert-output-dir", str(outputs[2])])
    assert code == 2
    assert sorted(p.name for p in path.parent.iterdir()) == before  # no output, no temp dirs


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_message(case, kt_run, capsys):
    path, _, _ = kt_run
    damage, file, problem = BAD_INPUTS[case]
    damage(path)
    assert convert.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert file in err and problem in err, err
    assert not (path.parent / "run_expert").exists() and not (path.parent / "run_nonexpert").exists()


@pytest.mark.parametrize("args, problem", [
    (["{run}", "{run}"], "merged output directory must not be, contain or lie inside the input directory"),
    (["{run}", "{run}/inside"], "must not be, contain or lie inside the input"),
    (["{run}", "{tmp}/m", "--expert-output-dir", "{tmp}/m/e"], "expert output directory must be distinct from and not nested"),
    (["{run}", "{tmp}/m", "--nonexpert-output-dir", "{tmp}/m"], "must be distinct"),
    (["{run}", "{tmp}"], "must not be, contain or lie inside the input"),
])
def test_bad_output_paths(kt_run, tmp_path, args, problem, capsys):
    path, _, _ = kt_run
    before = sorted(p.name for p in tmp_path.iterdir())
    assert convert.main([a.format(run=path, tmp=tmp_path) for a in args]) == 2
    assert problem in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "fused_expert_lora.safetensors", "kt_adapter_manifest.json"]


def test_nonempty_output_and_missing_nonexpert_via_subprocess(kt_run, tmp_path, kt_helpers):
    path, _, _ = kt_run
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("x")
    result = run_cli(path, tmp_path / "taken", "--expert-output-dir", tmp_path / "e")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"error: {tmp_path / 'taken'}: output directory is not empty (use --overwrite / overwrite=True to replace it)\n"
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["keep.txt"] and not (tmp_path / "e").exists()

    d = kt_helpers.dims
    only_experts = kt_helpers.write_run(tmp_path / "experts_only", nonexpert={}, config=kt_helpers.peft_config(),
                                        experts=kt_helpers.random_experts(d["layers"], d["E"], d["H"], d["I"], d["r"]))
    result = run_cli(only_experts, "--nonexpert-output-dir", tmp_path / "n", "--expert-output-dir", tmp_path / "e")
    assert result.returncode == 2
    assert "adapter_model.safetensors: holds no non-expert LoRA" in result.stderr
    assert not (tmp_path / "n").exists() and not (tmp_path / "e").exists()
    result = run_cli(tmp_path / "missing")
    assert result.returncode == 2 and result.stderr == f"error: {tmp_path / 'missing'}: input directory not found\n"


def test_base_model_mismatch(kt_run, kt_model_dir, capsys):
    path, _, _ = kt_run
    config = json.loads((kt_model_dir / "config.json").read_text())
    (kt_model_dir / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 24}))
    assert convert.main([str(path), "--base-model-name-or-path", str(kt_model_dir)]) == 2
    err = capsys.readouterr().err
    assert f"{kt_model_dir / 'config.json'}: moe_intermediate_size=24 but the adapter's expert LoRA has I=16" in err
    assert not (path.parent / "run_expert").exists()


def test_default_mode_without_nonexpert_writes_expert_only(tmp_path, kt_helpers, capsys):
    d = kt_helpers.dims
    experts = kt_helpers.random_experts(d["layers"], d["E"], d["H"], d["I"], d["r"])
    run = kt_helpers.write_run(tmp_path / "run", nonexpert={}, experts=experts, config=kt_helpers.peft_config())
    assert convert.main([str(run), "--base-model-name-or-path", "org/base"]) == 0
    assert "has no non-expert LoRA; no non-expert adapter written" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run_expert"]
    assert_tensors_equal(tmp_path / "run_expert", expected_expert_tensors(experts))
