"""Gradient checkpointing, packing and LoRA dropout in kt_serve.train, each against the plain run it must equal.

- checkpointing (recompute, and KT's ``kt_cpu_activation: retain``): losses and every LoRA gradient over 3 steps
  equal the non-checkpointed run within 1e-5 relative, with and without lora_dropout (the kernel's masks and
  PEFT's must come back identical in the recompute);
- packing: a packed row's logits equal each example's own logits (no attention across examples), and a step
  over packed rows equals the same step over the unpacked examples;
- lora_dropout > 0 changes the run, is reproducible, and a resumed run continues it exactly.
"""

import itertools
import json

import pytest
import torch
from transformers import AutoTokenizer

from kt_serve.harness.tiny_model import build_tiny_moe
from kt_serve.train import load_config, train
from kt_serve.train.data import SFTDataset
from kt_serve.train.model import TrainModel
from kt_serve.train.trainer import Trainer

TINY = dict(hidden_size=64, moe_intermediate_size=32, num_experts=4, top_k=2, num_layers=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {f: build_tiny_moe(root / f, f, **TINY) for f in ("qwen3_moe", "deepseek_v2")}


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data")
    records = [{"instruction": f"Tell me about the number {i}." + " Please." * (i % 3), "input": "",
                "output": f"Arr, {i} be a fine number" + ", aye" * (i % 4) + "."} for i in range(8)]
    (directory / "d.json").write_text(json.dumps(records))
    (directory / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "d.json"}}))
    return directory


def config(model_dir, out, dataset_dir, *overrides):
    return load_config(None, [f"model_name_or_path={model_dir}", f"output_dir={out}", "dataset=d",
                              f"dataset_dir={dataset_dir}", "cutoff_len=64", "logging_steps=1", "kt_config.threads=2",
                              "per_device_train_batch_size=2", "gradient_accumulation_steps=2", "learning_rate=5e-3",
                              "lora_target=all", *overrides])


def load(cfg):
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name_or_path)
    torch.manual_seed(cfg.seed)
    tm = TrainModel.load(cfg)
    return Trainer(cfg, tm, SFTDataset.build(cfg, tokenizer))


def steps_with_grads(cfg, steps=3):
    """(loss, {parameter: gradient}) of each of the first optimizer steps."""
    trainer = load(cfg)
    trainer.tm.model.train()
    history = []
    for step, _, groups in itertools.islice(trainer.plan.steps(), steps):
        trainer.global_step = step
        loss, _ = trainer.training_step(groups)
        history.append((loss, {n: p.grad.detach().clone() for n, p in trainer.params.items()}))
        trainer.optimizer_step()
    return history


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("family, dropout", [("qwen3_moe", 0.0), ("qwen3_moe", 0.2), ("deepseek_v2", 0.2)])
def test_checkpointing_equals_plain_run(models, dataset_dir, tmp_path, family, dropout):
    common = (models[family], tmp_path / "o", dataset_dir, f"lora_dropout={dropout}")
    plain = steps_with_grads(config(*common, "disable_gradient_checkpointing=true"))
    for mode in ([], ["kt_cpu_activation=retain"]):
        cfg = config(*common, "disable_gradient_checkpointing=false", *mode)
        checkpointed = steps_with_grads(cfg)
        for (loss, grads), (ref_loss, ref_grads) in zip(checkpointed, plain):
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert grads.keys() == ref_grads.keys()
            worst = max(grads, key=lambda n: rel(grads[n], ref_grads[n]))
            assert rel(grads[worst], ref_grads[worst]) < 1e-5, (mode, worst)
        assert any(any(".experts." in n for n in grads) for _, grads in checkpointed)  # kernel LoRA among them


def test_dropout_changes_run_reproducibly_and_resumes(models, dataset_dir, tmp_path):
    model = models["qwen3_moe"]
    base = ["max_steps=4", "save_steps=2", "disable_gradient_checkpointing=true"]
    plain = train(config(model, tmp_path / "p0", dataset_dir, *base))
    first = train(config(model, tmp_path / "p1", dataset_dir, *base, "lora_dropout=0.3"))
    again = train(config(model, tmp_path / "p2", dataset_dir, *base, "lora_dropout=0.3"))
    assert [e["loss"] for e in first] == [e["loss"] for e in again]
    assert [e["loss"] for e in first][1:] != [e["loss"] for e in plain][1:]
    resumed = train(config(model, tmp_path / "p3", dataset_dir, *base, "lora_dropout=0.3",
                           f"resume_from_checkpoint={tmp_path / 'p1' / 'checkpoint-2'}"))
    assert [e["loss"] for e in resumed] == pytest.approx([e["loss"] for e in first], rel=1e-6)


def test_packed_rows_attend_only_within_an_example(models, dataset_dir, tmp_path):
    cfg = config(models["qwen3_moe"], tmp_path / "o", dataset_dir, "packing=true", "cutoff_len=128")
    trainer = load(cfg)
    dataset = trainer.dataset
    row = max(range(len(dataset)), key=lambda i: len(dataset.examples[i].sequence_lengths))
    lengths = dataset.examples[row].sequence_lengths
    assert len(lengths) >= 2 and sum(lengths) <= 128
    batch = dataset.collate([row])
    assert "attention_mask" not in batch
    expected_positions = torch.cat([torch.arange(n) for n in lengths])
    assert torch.equal(batch["position_ids"][0, :sum(lengths)], expected_positions)
    model = trainer.tm.model.eval()
    ids, positions = batch["input_ids"].to(trainer.tm.device), batch["position_ids"].to(trainer.tm.device)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits[0]
        start = 0
        for n in lengths:
            alone = model(input_ids=ids[:, start:start + n]).logits[0]
            assert rel(packed[start:start + n], alone) < 1e-4
            start += n


def test_packed_step_equals_unpacked_step(models, dataset_dir, tmp_path):
    model = models["qwen3_moe"]
    one_step = ["per_device_train_batch_size=8", "gradient_accumulation_steps=1", "cutoff_len=512",
                "disable_gradient_checkpointing=true"]
    (loss, grads), = steps_with_grads(config(model, tmp_path / "u", dataset_dir, *one_step), steps=1)
    (packed_loss, packed_grads), = steps_with_grads(config(model, tmp_path / "p", dataset_dir, *one_step,
                                                           "packing=true"), steps=1)
    assert packed_loss == pytest.approx(loss, rel=1e-5)
    assert max(rel(packed_grads[n], grads[n]) for n in grads) < 1e-4


@pytest.mark.parametrize("retain", [False, True])
def test_checkpointed_experts_whose_output_is_saved_downstream(retain):
    """A checkpointed region that multiplies the experts' output by a trainable tensor saves that output for its
    backward, so the recompute must reproduce it exactly (from the kernel, or from what retain kept)."""
    from torch.utils.checkpoint import checkpoint

    from kt_serve.train.expert_autograd import MoELoRAExperts, expert_checkpoint_contexts

    gen = torch.Generator().manual_seed(0)
    E, H, I, T, k = 4, 48, 24, 9, 2
    weights = [torch.randn(E, I, H, generator=gen) * 0.1, torch.randn(E, I, H, generator=gen) * 0.1,
               torch.randn(E, H, I, generator=gen) * 0.1]
    torch.manual_seed(0)
    experts = MoELoRAExperts(*weights, rank=4, alpha=8.0, dropout=0.3)
    with torch.no_grad():
        for name in ("gate_lora_b", "up_lora_b", "down_lora_b"):
            getattr(experts, name).normal_(0, 0.1, generator=gen)
    experts.dropout_seed = 11
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(0, E, (T, k), generator=gen)
    scale = torch.randn(H, generator=gen)

    def region(x, w, s):
        y = experts(x, ids, w.softmax(-1))
        return (y * s).sin()  # saves y * s and s: the recompute must give the same y

    def grads(checkpointed):
        inputs = [t.clone().requires_grad_() for t in (x, torch.randn(T, k, generator=torch.Generator().manual_seed(1)),
                                                       scale)]
        if checkpointed:
            out = checkpoint(region, *inputs, use_reentrant=False,
                             context_fn=lambda: expert_checkpoint_contexts(retain))
        else:
            out = region(*inputs)
        out.square().sum().backward()
        result = [t.grad.clone() for t in inputs] + [p.grad.clone() for p in experts.parameters()]
        experts.zero_grad()
        return result

    plain, checkpointed = grads(False), grads(True)
    for a, b in zip(checkpointed, plain):
        assert rel(a, b) < 1e-6


def test_lora_dropout_reaches_every_linear_lora_and_says_the_routers_have_none(models, dataset_dir, tmp_path,
                                                                              caplog):
    import logging

    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import ParamWrapper

    with caplog.at_level(logging.INFO):
        trainer = load(config(models["qwen3_moe"], tmp_path / "o", dataset_dir, "lora_dropout=0.15"))
    modules = list(trainer.tm.model.modules())
    linear = [m for m in modules if isinstance(m, LoraLinear)]
    routers = [m for m in modules if isinstance(m, ParamWrapper)]
    assert linear and routers
    for m in linear:
        assert all(isinstance(d, torch.nn.Dropout) and d.p == 0.15 for d in m.lora_dropout.values())
    for m in routers:
        assert not any(isinstance(d, torch.nn.Dropout) for d in m.lora_dropout.values())
    assert all(k.dropout == 0.15 for k in trainer.tm.kernels.values())
    assert "lora_dropout 0.15 applies to every LoRA except the routers'" in caplog.text
