"""KT-FT LoRA Experts: read from KT's layout (formats/lora_experts.py), refused when malformed, kept by the
converter, and served per request on a real Qwen3-MoE server, mixed in one batch with base requests and adapters
without them, against an fp32 HF reference that adds (1/N) Σ_j down_j(SiLU(gate_j x) ⊙ up_j x) to each MoE block's
output (kt_serve.harness.reference.HFReference, written from the formula)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kt_serve
from kt_serve.convert import main as convert_main
from kt_serve.formats import FormatError, open_adapter_dir
from kt_serve.harness.server import SGLangServer
from kt_serve.harness.tiny_model import build_tiny_moe
from kt_serve.harness.reference import HFReference, model_dims, write_expert_peft_adapter, write_kt_adapter
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
        # no LoRA for SGLang's layers: SGLang gets an empty half, the plugin applies the rest
        "le_only": write_kt_adapter(root / "le_only", model, seed=34, attention=False, experts=False,
                                    lora_experts=2),
        "le_experts": write_kt_adapter(root / "le_experts", model, seed=35, attention=False, lora_experts=3),
        "experts_only": write_expert_peft_adapter(root / "experts_only", model, seed=36),
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


DATA_DIR = Path(kt_serve.__file__).parent / "data" / "example_dataset"
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


def train_run(model, out, lora_experts: bool):
    from kt_serve.train import load_config, train

    cfg = load_config(None, [f"model_name_or_path={model}", f"output_dir={out}", "dataset=pirate_alpaca",
                             f"dataset_dir={DATA_DIR}", "cutoff_len=64", "max_steps=40", "learning_rate=5e-3",
                             "per_device_train_batch_size=4", "logging_steps=5", "save_steps=1000",
                             "kt_config.threads=2", "seed=5", "lora_target=q_proj,v_proj",  # experts frozen
                             f"kt_use_lora_experts={str(lora_experts).lower()}", "kt_lora_expert_num=2",
                             "kt_lora_expert_intermediate_size=32"])
    return [e["loss"] for e in train(cfg)]


@pytest.fixture(scope="module")
def trained(qwen3):
    """kt_serve.train on the served model with only q_proj LoRA (routed experts frozen), with and without LoRA
    Experts; then kt_serve.convert's merged dir of the run with them."""
    root, model, _ = qwen3
    with_le = train_run(model, root / "trained", True)
    without = train_run(model, root / "trained_without", False)
    assert convert_main([str(root / "trained"), str(root / "trained_merged")]) == 0
    return root / "trained", root / "trained_merged", with_le, without


def test_training_with_lora_experts_lowers_the_loss_and_writes_kts_keys(qwen3, trained):
    _, model, _ = qwen3
    out, merged, with_le, without = trained
    print(f"\nloss every 5 steps, q_proj LoRA + LoRA Experts: {[round(x, 3) for x in with_le]}"
          f"\n                   q_proj LoRA alone:         {[round(x, 3) for x in without]}")
    assert sum(with_le[-3:]) < sum(without[-3:])
    saved = load_file(out / "adapter_model.safetensors")
    layers, H = model_dims(model)["L"], model_dims(model)["H"]
    want = {LE.format(layer, j, p) for layer in range(layers) for j in range(2) for p in ("gate", "up", "down")}
    assert want <= set(saved)
    assert all(saved[k].shape == ((H, 32) if "le_down" in k else (32, H)) for k in want)
    assert all(saved[LE.format(layer, j, "down")].abs().max() > 0 for layer in range(layers) for j in range(2))
    le = open_adapter_dir(out).lora_experts
    assert (le.num, le.intermediate_size) == (2, 32)


def test_lora_experts_start_at_zero_with_kts_init(qwen3):
    """le_down zeros, le_gate / le_up nn.Linear's kaiming-uniform (a=√5: bound 1/√H), no bias; not under PEFT."""
    from kt_serve.train import load_config
    from kt_serve.train.model import TrainModel

    root, model, _ = qwen3
    cfg = load_config(None, [f"model_name_or_path={model}", f"output_dir={root / 'unused'}", "dataset=pirate_alpaca",
                             f"dataset_dir={DATA_DIR}", "lora_target=all", "kt_use_lora_experts=true",
                             "kt_lora_expert_num=0", "kt_config.threads=2"])
    assert (cfg.kt_lora_expert_num, cfg.kt_lora_expert_intermediate_size) == (2, 1024)
    tm = TrainModel.load(cfg)
    params = {n: p for n, p in tm.named_trainable_parameters().items() if ".lora_experts." in n}
    H = model_dims(model)["H"]
    assert len(params) == model_dims(model)["L"] * 2 * 3 and not any("lora_A" in n for n in params)
    for name, p in params.items():
        if "le_down" in name:
            assert p.shape == (H, 1024) and not p.any()
        else:
            assert p.shape == (1024, H) and 0.5 / H ** 0.5 < p.abs().max() <= 1 / H ** 0.5
    assert "LoRA Experts" in tm.parameter_report()


@pytest.fixture(scope="module")
def served(qwen3, trained):
    root, model, adapters = qwen3
    adapters = {**adapters, "trained": trained[1]}
    ref = HFReference(model)
    prompts = pick_prompts(ref, [[], *([p] for p in adapters.values())], n=2)
    args = LORA_ARGS + ["--lora-paths", *(f"{n}={p}" for n, p in adapters.items())]
    with SGLangServer(model, args) as server:
        yield server, model, adapters, ref, prompts


@pytest.mark.parametrize("name", ["le2", "le3", "trained", "le_only", "le_experts"])
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


def test_an_expert_only_adapter_is_served_per_request(served):
    """Without LoRA Experts too: an adapter with nothing for SGLang's layers (expert LoRA only) is named per request
    (SGLang holds an empty half) and gives the reference, away from the base model."""
    server, model, adapters, ref, prompts = served
    ids, logprobs = complete(server, f"{model}:experts_only", prompts[1])
    assert_matches_reference(ref, prompts[1], ids, logprobs, [adapters["experts_only"]])
    base = ref.logprobs(prompts[1] + ids, len(prompts[1]), [])
    assert max(abs(a - b) for a, b in zip(logprobs, base)) > MIN_EFFECT


def test_mixed_batch_with_and_without_lora_experts(served):
    server, model, adapters, ref, prompts = served
    jobs = [(name, tuple(prompt)) for prompt in prompts
            for name in (None, "le2", "le3", "plain", "le_only", "le_experts", "experts_only")]

    def run(job):
        name, prompt = job
        return complete(server, model if name is None else f"{model}:{name}", list(prompt))

    for (name, prompt), (ids, logprobs) in concurrent_equals_sequential(run, jobs).items():
        assert_matches_reference(ref, list(prompt), ids, logprobs, [] if name is None else [adapters[name]])


def test_the_global_expert_adapter_flag_refuses_lora_experts(qwen3):
    """--kt-expert-lora-path applies an adapter's expert LoRA only; one with LoRA Experts would be served without
    them, so the server refuses to start, saying how to serve it."""
    from kt_serve.harness.server import ServerStartError

    _, model, adapters = qwen3
    with pytest.raises(ServerStartError, match="holds KT-FT LoRA Experts, which this flag would leave out"):
        with SGLangServer(model, ["--kt-expert-lora-path", str(adapters["le2"])]):
            pass


def test_load_and_unload_under_traffic(served):
    """An adapter with LoRA Experts loaded by /load_lora_adapter while other requests run, used, then unloaded:
    the traffic's answers stay right and the new name serves the reference."""
    import concurrent.futures

    server, model, adapters, ref, prompts = served
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        traffic = [pool.submit(complete, server, f"{model}:plain", prompts[0]) for _ in range(4)]
        status, body = server.post("/load_lora_adapter", {"lora_name": "dyn", "lora_path": str(adapters["le3"])})
        assert status == 200 and body.get("success"), body
        for f in traffic:
            ids, logprobs = f.result()
            assert_matches_reference(ref, prompts[0], ids, logprobs, [adapters["plain"]])
    ids, logprobs = complete(server, f"{model}:dyn", prompts[1])
    assert_matches_reference(ref, prompts[1], ids, logprobs, [adapters["le3"]])
    status, body = server.post("/unload_lora_adapter", {"lora_name": "dyn"})
    assert status == 200 and body.get("success"), body
    ids, logprobs = complete(server, f"{model}:le2", prompts[1])
    assert_matches_reference(ref, prompts[1], ids, logprobs, [adapters["le2"]])
