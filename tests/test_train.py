"""kt_serve.train end to end on tiny random MoE checkpoints, against the pure-torch reference in train_reference.py.

- parity: 5 optimizer steps of kt_serve.train (kernel experts, PEFT non-expert LoRA) and of the reference
  (fp32 HF model, per-expert LoRA math in plain torch) from the same LoRA init on the same batches give the same
  losses and the same saved LoRA tensors;
- resume from checkpoint-N continues the uninterrupted run's loss curve exactly;
- learning: the shipped pirate dataset is learned, and the saved adapter, run through the reference's plain-torch
  forward, answers in the pirate format where the base model does not;
- output_dir safety and CLI errors.
"""

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kt_serve
from kt_serve.formats.names import (ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE, FUSED_EXPERT_LORA_FILE,
                                    KT_ADAPTER_MANIFEST_FILE)
from kt_serve.harness.tiny_model import build_tiny_moe
from kt_serve.train import load_config, train
from kt_serve.train.__main__ import main as cli_main
from kt_serve.train.data import SFTDataset
from kt_serve.train.model import TrainModel
from kt_serve.train.trainer import LOG_FILE, PLOT_FILE, Trainer

sys.path.insert(0, str(Path(__file__).parent))
import train_reference as ref  # noqa: E402

DATA_DIR = Path(kt_serve.__file__).parent / "data" / "example_dataset"
TINY = dict(hidden_size=64, moe_intermediate_size=32, num_experts=4, top_k=2, num_layers=2)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {family: build_tiny_moe(root / family, family, **TINY) for family in ("qwen3_moe", "qwen2_moe", "deepseek_v2")}


def make_config(model_dir, output_dir, *overrides):
    return load_config(None, [f"model_name_or_path={model_dir}", f"output_dir={output_dir}",
                              "dataset=pirate_alpaca,pirate_sharegpt", f"dataset_dir={DATA_DIR}", "cutoff_len=64",
                              "logging_steps=1", "save_steps=1000", "kt_config.threads=2", *overrides])


def saved_lora(out_dir: Path) -> dict[str, torch.Tensor]:
    return {**load_file(out_dir / ADAPTER_MODEL_FILE), **load_file(out_dir / FUSED_EXPERT_LORA_FILE)}


def rel_l2(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def expected_keys(layers, nonexpert_modules):
    """``nonexpert_modules``: a list for every layer, or a function of the layer (hybrid models)."""
    per_layer = nonexpert_modules if callable(nonexpert_modules) else lambda layer: nonexpert_modules
    keys = {f"base_model.model.model.layers.{l}.{m}.lora_{s}.weight"
            for l in range(layers) for m in per_layer(l) for s in "AB"}
    return keys | {f"layers.{l}.experts.{p}_lora_{s}" for l in range(layers) for p in ("gate", "up", "down") for s in "ab"}


PARITY_CASES = {
    # family: (lora_target, non-expert modules it must reach)
    "qwen3_moe": ("q_proj,v_proj,gate,gate_proj,up_proj,down_proj", ["self_attn.q_proj", "self_attn.v_proj", "mlp.gate"]),
    "qwen2_moe": ("all", [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")]
                  + ["mlp.shared_expert_gate", "mlp.gate"]),
    "deepseek_v2": ("all", ["self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj",
                            "mlp.gate"] + [f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")]),
}


@pytest.mark.parametrize("family", list(PARITY_CASES))
def test_gradient_parity_with_pure_torch_reference(tiny_models, tmp_path, family):
    lora_target, modules = PARITY_CASES[family]
    check_parity(tiny_models[family], tiny_models[family], tmp_path, lora_target, modules, family)


def check_parity(model_dir, reference_dir, tmp_path, lora_target, modules, label, *overrides, layers=TINY["num_layers"]):
    """5 steps of kt_serve.train on ``model_dir`` (with ``overrides``) against the pure-torch reference trained on
    ``reference_dir`` (the same model, or its weights as the kernel holds them: dequantized experts) from the
    same LoRA init on the same batches: losses within 2e-2, saved tensors within 5e-2 (rel-L2)."""
    steps, lr = 5, 2e-3
    cfg = make_config(model_dir, tmp_path / "out", f"lora_target={lora_target}", f"max_steps={steps}",
                      "per_device_train_batch_size=2", "gradient_accumulation_steps=2", f"learning_rate={lr}",
                      "lr_scheduler_type=cosine", "warmup_steps=1", "max_grad_norm=1.0", "seed=5", *overrides)
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(cfg.model_name_or_path)
    dataset = SFTDataset.build(cfg, tokenizer)
    tm = TrainModel.load(cfg)
    assert tm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")  # dense_device: auto
    # Non-zero B from the start so that every gradient path (x, routing weights, A and B) is exercised at step 1.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in tm.named_trainable_parameters().items():
            if "lora_B" in name or name.endswith("_lora_b"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    init = {ref.saved_name(n): p.detach().to("cpu", copy=True) for n, p in tm.named_trainable_parameters().items()}
    assert set(init) == expected_keys(layers, modules)

    trainer = Trainer(cfg, tm, dataset)
    losses = [e["loss"] for e in trainer.train()]
    batches = [[dataset.collate(mb) for mb in groups] for _, _, groups in itertools.islice(trainer.plan.steps(), steps)]
    ref_losses, ref_final, _ = ref.train(str(reference_dir), batches, init, alpha=cfg.lora_alpha, lr=lr,
                                         scheduler="cosine", warmup_steps=1, total_steps=steps, max_grad_norm=1.0)

    print(f"{label}: max loss rel diff {max(abs(a - b) / b for a, b in zip(losses, ref_losses)):.2e}")
    assert len(losses) == steps
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) / abs(want) <= 2e-2, (losses, ref_losses)
    assert losses[-1] < losses[0]
    final = saved_lora(Path(cfg.output_dir))
    assert set(final) == set(ref_final)
    errors = {k: rel_l2(final[k], ref_final[k]) for k in final}
    print(f"{label}: losses {[round(x, 4) for x in losses]}, max tensor rel-L2 {max(errors.values()):.2e}")
    assert max(errors.values()) <= 5e-2, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    moved = {k: rel_l2(ref_final[k], init[k]) for k in ref_final}
    assert min(moved.values()) > 1e-3  # every tensor trained, so the comparison above is not init vs init
    return losses, ref_losses


def test_resume_reproduces_uninterrupted_run(tiny_models, tmp_path):
    common = ["max_steps=6", "save_steps=3", "per_device_train_batch_size=2", "gradient_accumulation_steps=2",
              "learning_rate=5e-3", "lr_scheduler_type=cosine", "warmup_steps=2"]
    full = make_config(tiny_models["qwen3_moe"], tmp_path / "full", *common)
    full_log = train(full)
    assert (tmp_path / "full" / "checkpoint-3" / "optimizer.pt").is_file()

    resumed_dir = tmp_path / "resumed"
    resumed = make_config(tiny_models["qwen3_moe"], resumed_dir, *common,
                          f"resume_from_checkpoint={tmp_path / 'full' / 'checkpoint-3'}")
    resumed_log = train(resumed)
    assert [e["step"] for e in resumed_log] == list(range(1, 7))
    for a, b in zip(full_log, resumed_log):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4) and b["lr"] == pytest.approx(a["lr"])
    logged = [json.loads(line) for line in (resumed_dir / LOG_FILE).read_text().splitlines()]
    assert [e["step"] for e in logged] == list(range(1, 7))
    a, b = saved_lora(tmp_path / "full"), saved_lora(resumed_dir)
    assert max(rel_l2(b[k], a[k]) for k in a) < 1e-3

    # resume_from_checkpoint: true picks the latest checkpoint in output_dir
    again = make_config(tiny_models["qwen3_moe"], tmp_path / "full", *common[:1], "save_steps=3",
                        *common[2:], "resume_from_checkpoint=true")
    assert [e["step"] for e in train(again)] == list(range(1, 7))


def greedy_reply(model, tokenizer, question, max_new_tokens=24):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    ids = torch.tensor([ids])
    prompt_len = ids.shape[1]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = model(input_ids=ids).logits[0, -1].argmax().view(1, 1)
            ids = torch.cat([ids, nxt], dim=1)
            if nxt.item() == tokenizer.eos_token_id:
                break
    return tokenizer.decode(ids[0, prompt_len:].tolist())


def test_learns_pirate_style(tmp_path):
    from transformers import AutoTokenizer

    model_dir = build_tiny_moe(tmp_path / "model", "qwen3_moe", seed=1)
    out = tmp_path / "out"
    cfg = make_config(model_dir, out, "dataset=pirate_alpaca", "max_steps=100", "per_device_train_batch_size=8",
                      "learning_rate=5e-3", "lr_scheduler_type=cosine", "logging_steps=10", "plot_loss=true",
                      "lora_target=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    log = train(cfg)
    first, last = log[0]["loss"], log[-1]["loss"]
    print(f"pirate loss: first logged {first:.3f} -> last {last:.3f}")
    assert last < 0.6 * first
    for name in (ADAPTER_MODEL_FILE, FUSED_EXPERT_LORA_FILE, ADAPTER_CONFIG_FILE, KT_ADAPTER_MANIFEST_FILE, LOG_FILE, PLOT_FILE):
        assert (out / name).is_file(), name
    assert not any(p.name.startswith(".") for p in out.iterdir())  # no staging leftovers

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tuned, _ = ref.build_model(model_dir, saved_lora(out), cfg.lora_alpha)
    base, _ = ref.build_model(model_dir, {}, cfg.lora_alpha)
    questions = ["What is 20 plus 22?", "What is the capital of Germany?", "Tell me a joke.", "What color is a banana?"]
    tuned_replies = [greedy_reply(tuned, tokenizer, q) for q in questions]
    base_replies = [greedy_reply(base, tokenizer, q) for q in questions]
    print("tuned:", tuned_replies, "\nbase:", base_replies)
    assert sum(r.startswith("Arr, matey!") and "Yo ho ho!" in r for r in tuned_replies) >= 3
    assert not any("Arr" in r for r in base_replies)


def test_partial_expert_targets_and_cpu_placement(tiny_models, tmp_path):
    cfg = make_config(tiny_models["qwen3_moe"], tmp_path / "out", "lora_target=q_proj,down_proj")
    tm = TrainModel.load(cfg)
    for kernel in tm.kernels.values():
        trained = {n for n, p in kernel.named_parameters() if p.requires_grad}
        assert trained == {"down_lora_a", "down_lora_b"}
    tm.model.to(torch.bfloat16)  # as a GPU placement would do with .to("cuda"): the kernel's LoRA must not follow
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for k in tm.kernels.values() for p in k.parameters())
    # routed experts frozen (their LoRA stays at its zero-B init): allowed, e.g. beside LoRA Experts
    frozen = TrainModel.load(make_config(tiny_models["qwen3_moe"], tmp_path / "o2", "lora_target=q_proj"))
    assert not any(p.requires_grad for k in frozen.kernels.values() for p in k.parameters())
    assert frozen.named_trainable_parameters()
    with pytest.raises(ValueError, match="no module named w9"):
        TrainModel.load(make_config(tiny_models["qwen3_moe"], tmp_path / "o3", "lora_target=w9,down_proj"))


def test_output_dir_rules(tiny_models, tmp_path):
    model_dir = tiny_models["qwen3_moe"]
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    for out, message in [(tmp_path / "busy", "not empty"), (model_dir / "out", "base model directory"),
                         (model_dir, "base model directory")]:
        with pytest.raises(ValueError, match=message):
            train(make_config(model_dir, out, "max_steps=1"))
    assert (tmp_path / "busy" / "keep.txt").read_text() == "x" and not (model_dir / "out").exists()
    log = train(make_config(model_dir, tmp_path / "busy", "max_steps=1", "overwrite_output_dir=true"))
    assert len(log) == 1 and not (tmp_path / "busy" / "keep.txt").exists()


def test_cli_errors_are_one_line_and_write_nothing(tiny_models, tmp_path, capsys):
    config = tmp_path / "train.yaml"
    config.write_text(f"model_name_or_path: {tiny_models['qwen3_moe']}\noutput_dir: {tmp_path / 'out'}\n"
                      f"dataset: pirate_alpaca\ndataset_dir: {DATA_DIR}\nlora_rnk: 8\n")
    assert cli_main([str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "lora_rnk" in err
    assert cli_main([str(config), "lora_rnk=", "dataset=nope"]) == 2  # still unknown field first
    config.write_text(config.read_text().replace("lora_rnk: 8\n", "dataset: nope\n").replace("dataset: pirate_alpaca\n", ""))
    assert cli_main([str(config)]) == 2
    assert "no dataset named nope" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_example_launch_config_is_valid():
    cfg = load_config(Path(__file__).parents[1] / "launch" / "train_example.yaml",
                      ["model_name_or_path=/models/any", "output_dir=/tmp/any"])
    assert cfg.dataset_names and cfg.kt_config is not None
