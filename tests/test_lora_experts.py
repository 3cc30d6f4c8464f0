"""KT-FT LoRA Experts: read from KT's layout (formats/lora_experts.py), refused when malformed, kept by the
converter, and served per request on a real Qwen3-MoE server, mixed in one batch with base requests and adapters
without them, against an fp32 HF reference that adds (1/N) Σ_j down_j(SiLU(gate_j x) ⊙ up_j x) to each MoE block's
output (serving_reference.HFReference, written from the formula)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kt_serve.convert import main as convert_main
from kt_serve.formats import FormatError, open_adapter_dir
from kt_serve.harness.server import SGLangServer
from kt_serve.harness.tiny_model import build_tiny_moe
from serving_reference import HFReference, model_dims, write_kt_adapter
from test_serving import LORA_ARGS, MIN_EFFECT, assert_matches_reference, complete, concurrent_equals_sequential, \
    pick_prompts


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_experts")
    model = str(build_tiny_moe(root / "qwen3", "qwen3_moe"))
    adapters = {
        "le2": write_kt_adapter(root / "le2", model, seed=31, lora_experts=2),  # + attention + expert LoRA
        "le3": write_kt_adapter(root / "le3", model, seed=32, experts=False, lora_experts=3,
                                lora_expert_dtype=torch.float32),                   # fp32, no expert LoRA
        "plain": write_kt_adapter(root / "plain", model, seed=33),                  # no LoRA Experts
    }
    return root, model, adapters


def rewrite(src, dst, edit):
    """A copy of adapter dir ``src`` whose adapter_model.safetensors went through ``edit(tensors)``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "kt_adapter_manifest.json":  # the manifest would (rightly) catch the edit first
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "adapter_model.safetensors", metadata={"format": "pt"})
    return dst


LE = "base_model.model.model.layers.{}.mlp.lora_experts.{}.le_{}.weight"


def test_kt_layout_is_read_with_n_and_sizes_from_the_keys(qwen3):
    _, model, adapters = qwen3
    d = model_dims(model)
    for name, n, dtype in (("le2", 2, torch.bfloat16), ("le3", 3, torch.float32)):
        source = open_adapter_dir(adapters[name])
        le = source.lora_experts
        assert (le.num, le.hidden_size, le.intermediate_size) == (n, d["H"], 16)
        assert sorted(le.layers) == list(range(d["L"]))
        raw = load_file(adapters[name] / "adapter_model.safetensors")
        assert torch.equal(le.layers[1]["down"][n - 1], raw[LE.format(1, n - 1, "down")])
        assert le.layers[0]["gate"].dtype == dtype
        assert not any("lora_experts" in key for key in source.nonexpert)
    assert open_adapter_dir(adapters["plain"]).lora_experts is None


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(LE.format(1, 1, "up")), r"layer 1 lora_experts\.1 has no le_up\.weight"),
    (lambda t: [t.pop(LE.format(layer, 1, p)) for layer in (0, 1) for p in ("gate", "up", "down")],
     r"layer 0: lora_experts \[1\] missing \(indices \[0, 2\]"),
    (lambda t: t.__setitem__(LE.format(1, 0, "down"), torch.zeros(8, 16, dtype=torch.bfloat16)),
     r"lora_experts\.0\.le_down\.weight has shape \[8, 16\], expected \[\d+, 16\]"),
    (lambda t: t[LE.format(0, 2, "gate")].__setitem__((0, 0), float("nan")),
     r"lora_experts\.2\.le_gate\.weight holds NaN or Inf values"),
])
def test_malformed_lora_experts_are_refused_naming_the_tensor(qwen3, tmp_path, edit, message):
    _, _, adapters = qwen3
    bad = rewrite(adapters["le3"], tmp_path / "bad", edit)
    with pytest.raises(FormatError, match=message):
        open_adapter_dir(bad)


def test_a_config_that_contradicts_the_tensors_is_refused(qwen3, tmp_path):
    _, _, adapters = qwen3
    bad = rewrite(adapters["le2"], tmp_path / "bad", lambda t: None)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "kt_lora_experts": {"num": 3,
                                                                                        "intermediate_size": 16}}))
    with pytest.raises(FormatError, match=r"kt_lora_experts=.*but the tensors hold num=2, intermediate_size=16"):
        open_adapter_dir(bad)


def test_convert_keeps_them_beside_the_non_expert_lora(qwen3, tmp_path, capsys):
    _, model, adapters = qwen3
    out = tmp_path / "out"
    assert convert_main([str(adapters["le2"]), "--output-dir", str(out / "merged"), "--expert-output-dir",
                         str(out / "expert"), "--nonexpert-output-dir", str(out / "nonexpert")]) == 0
    original = open_adapter_dir(adapters["le2"]).lora_experts
    for role in ("merged", "nonexpert"):
        config = json.loads((out / role / "adapter_config.json").read_text())
        assert config["kt_lora_experts"] == {"num": 2, "intermediate_size": 16}
        assert "mlp" not in config["target_modules"]
        kept = open_adapter_dir(out / role).lora_experts
        assert all(torch.equal(kept.layers[layer][p], original.layers[layer][p])
                   for layer in original.layers for p in ("gate", "up", "down"))
    assert open_adapter_dir(out / "expert").lora_experts is None
    assert convert_main(["--check", str(adapters["le2"])]) == 0
    assert "LoRA Experts (KT-FT, added to every MoE block's output): N=2 SwiGLU MLPs of I=16" in capsys.readouterr().out


@pytest.fixture(scope="module")
def served(qwen3):
    root, model, adapters = qwen3
    ref = HFReference(model)
    prompts = pick_prompts(ref, [[], *([p] for p in adapters.values())], n=2)
    args = LORA_ARGS + ["--lora-paths", *(f"{n}={p}" for n, p in adapters.items())]
    with SGLangServer(model, args) as server:
        yield server, model, adapters, ref, prompts


@pytest.mark.parametrize("name", ["le2", "le3"])
def test_served_per_request_within_tolerance_of_the_formula(served, name):
    server, model, adapters, ref, prompts = served
    prompt = prompts[0]
    ids, logprobs = complete(server, f"{model}:{name}", prompt)
    assert_matches_reference(ref, prompt, ids, logprobs, [adapters[name]])
    # the LoRA Experts really acted: the same adapter without them is another model
    without = rewrite(adapters[name], adapters[name].parent / f"{name}_without",
                      lambda t: [t.pop(k) for k in [k for k in t if ".lora_experts." in k]]) \
        if not (adapters[name].parent / f"{name}_without").exists() else adapters[name].parent / f"{name}_without"
    other = ref.logprobs(prompt + ids, len(prompt), [without])
    assert max(abs(a - b) for a, b in zip(logprobs, other)) > MIN_EFFECT


def test_mixed_batch_with_and_without_lora_experts(served):
    server, model, adapters, ref, prompts = served
    jobs = [(name, tuple(prompt)) for prompt in prompts for name in (None, "le2", "le3", "plain")]

    def run(job):
        name, prompt = job
        return complete(server, model if name is None else f"{model}:{name}", list(prompt))

    for (name, prompt), (ids, logprobs) in concurrent_equals_sequential(run, jobs).items():
        assert_matches_reference(ref, list(prompt), ids, logprobs, [] if name is None else [adapters[name]])
