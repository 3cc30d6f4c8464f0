"""kt_serve.train config validation and SFT data handling (no model, no kernel)."""

import json

import pytest
import yaml

from kt_serve.train.config import ConfigError, load_config
from kt_serve.train.data import (IGNORE_INDEX, NAMED_TEMPLATES, BatchPlan, DataError, SFTDataset, TokenizerTemplate,
                                 encode_example, load_dataset_specs)

REQUIRED = {"model_name_or_path": "/models/m", "output_dir": "/tmp/out", "dataset": "d"}


def write_yaml(tmp_path, fields):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(fields))
    return path


# ------------------------------------------------------------------------------------------------- config

def test_config_llamafactory_fields_and_overrides(tmp_path):
    path = write_yaml(tmp_path, {**REQUIRED, "stage": "sft", "do_train": True, "finetuning_type": "lora",
                                 "lora_rank": 4, "learning_rate": "1e-4", "lora_target": "q_proj, v_proj",
                                 "kt_config": {"threads": 2}})
    cfg = load_config(path, ["max_steps=7", "kt_config.dense_device=cpu", "lora_rank=16"])
    assert cfg.learning_rate == pytest.approx(1e-4)  # YAML 1.1 reads 1e-4 as a string; LLaMA-Factory accepts it
    assert cfg.lora_rank == 16 and cfg.lora_alpha == 32.0  # LLaMA-Factory default alpha = 2 * rank
    assert cfg.max_steps == 7 and cfg.kt_config.threads == 2 and cfg.kt_config.dense_device == "cpu"
    assert cfg.lora_targets == ["q_proj", "v_proj"] and cfg.lora_scaling == 2.0


@pytest.mark.parametrize("extra, message", [
    ({"quantization_bit": 4}, "unknown field(s) quantization_bit"),
    ({"kt_config": {"threadz": 4}}, "kt_config.threadz"),
    ({"num_train_epochs": 2, "max_steps": 10}, "max_steps and num_train_epochs"),
    ({"warmup_ratio": 0.1, "warmup_steps": 5}, "warmup_ratio and warmup_steps"),
    ({"finetuning_type": "full"}, "finetuning_type"),
    ({"use_rslora": True}, "use_rslora"),
    ({"lora_dropout": 1.5}, "lora_dropout"),
    ({"lora_rank": "eight"}, "lora_rank: expected int"),
    ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type"),
    ({"resume_from_checkpoint": True, "overwrite_output_dir": True}, "contradict"),
    ({"kt_config": {"dense_device": "tpu"}}, "kt_config.dense_device"),
])
def test_config_rejects_bad_fields(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(write_yaml(tmp_path, {**REQUIRED, **extra}))


def test_config_missing_required(tmp_path):
    with pytest.raises(ConfigError, match="missing required field.*output_dir"):
        load_config(write_yaml(tmp_path, {"model_name_or_path": "m", "dataset": "d"}))


# --------------------------------------------------------------------------------------------------- data

@pytest.fixture(scope="module")
def tokenizer():
    from kt_serve.harness.tiny_model import build_tokenizer

    return build_tokenizer(1024)


def write_dataset(tmp_path, info, files):
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    return tmp_path


def test_alpaca_and_sharegpt_messages(tmp_path):
    alpaca = [{"q": "Add", "extra": "2 and 3", "a": "5", "sys": "Be brief.", "hist": [["Hi", "Hello"]]}]
    sharegpt = [{"turns": [{"role": "sys", "text": "S"}, {"role": "u", "text": "Q1"}, {"role": "bot", "text": "A1"}]}]
    info = {
        "a": {"file_name": "a.json", "columns": {"prompt": "q", "query": "extra", "response": "a", "system": "sys",
                                                  "history": "hist"}},
        "s": {"file_name": "s.jsonl", "formatting": "sharegpt", "columns": {"messages": "turns"},
              "tags": {"role_tag": "role", "content_tag": "text", "user_tag": "u", "assistant_tag": "bot",
                       "system_tag": "sys"}},
    }
    d = write_dataset(tmp_path, info, {"a.json": json.dumps(alpaca), "s.jsonl": json.dumps(sharegpt[0]) + "\n"})
    spec_a, spec_s = load_dataset_specs(d, ["a", "s"])
    assert spec_a.to_messages(spec_a.read_records()[0], 0) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Add\n2 and 3"}, {"role": "assistant", "content": "5"}]
    assert spec_s.to_messages(spec_s.read_records()[0], 0) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}]


@pytest.mark.parametrize("info, files, message", [
    ({"x": {"file_name": "x.json"}}, {}, "no dataset named d"),
    ({"d": {"hf_hub_url": "org/ds"}}, {}, "unsupported key.*hf_hub_url"),
    ({"d": {"file_name": "missing.json"}}, {}, "does not exist"),
    ({"d": {"file_name": "d.json", "formatting": "openai"}}, {"d.json": "[]"}, "formatting must be"),
    ({"d": {"file_name": "d.json"}}, {"d.json": "{not json"}, "cannot read JSON"),
])
def test_dataset_info_errors(tmp_path, info, files, message):
    d = write_dataset(tmp_path, info, files)
    with pytest.raises(DataError, match=message):
        specs = load_dataset_specs(d, ["d"])
        specs[0].read_records()


def test_conversation_must_end_with_assistant(tmp_path):
    row = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}, {"from": "human", "value": "Q2"}]}
    d = write_dataset(tmp_path, {"d": {"file_name": "d.json", "formatting": "sharegpt"}}, {"d.json": json.dumps([row])})
    spec = load_dataset_specs(d, ["d"])[0]
    with pytest.raises(DataError, match="record 0: expected alternating"):
        spec.to_messages(spec.read_records()[0], 0)


MESSAGES = [{"role": "system", "content": "Be a pirate."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Arr, hello."}, {"role": "user", "content": "What is 2 plus 2?"},
            {"role": "assistant", "content": "It be 4."}]
# The same conversation in ChatML, written out by hand; the two responses (with their end-of-turn) are trained.
PROMPT_1 = "<|im_start|>system\nBe a pirate.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
RESPONSE_1 = "Arr, hello.<|im_end|>\n"
PROMPT_2 = "<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n"
RESPONSE_2 = "It be 4.<|im_end|>\n"


@pytest.mark.parametrize("template", ["tokenizer", "chatml"])
def test_labels_cover_only_responses(tokenizer, template):
    tmpl = TokenizerTemplate(tokenizer) if template == "tokenizer" else NAMED_TEMPLATES[template]
    example = encode_example(MESSAGES, tmpl, tokenizer, cutoff_len=4096)
    assert tokenizer.decode(example.input_ids) == PROMPT_1 + RESPONSE_1 + PROMPT_2 + RESPONSE_2
    pieces = [tokenizer.encode(t, add_special_tokens=False) for t in (PROMPT_1, RESPONSE_1, PROMPT_2, RESPONSE_2)]
    expected = ([IGNORE_INDEX] * len(pieces[0]) + pieces[1] + [IGNORE_INDEX] * len(pieces[2]) + pieces[3])
    assert example.labels == expected
    if template == "tokenizer":  # a plain cut; named templates cut per turn (tests/test_train_templates.py)
        cut = encode_example(MESSAGES, tmpl, tokenizer, cutoff_len=10)
        assert cut.input_ids == example.input_ids[:10] and cut.labels == example.labels[:10]


def test_collate_pads_right(tokenizer):
    ds = SFTDataset([encode_example(MESSAGES[:3], NAMED_TEMPLATES["chatml"], tokenizer, 64),
                     encode_example(MESSAGES[3:], NAMED_TEMPLATES["chatml"], tokenizer, 64)], pad_token_id=0)
    batch = ds.collate([0, 1])
    n0, n1 = len(ds.examples[0].input_ids), len(ds.examples[1].input_ids)
    assert batch["input_ids"].shape == (2, max(n0, n1))
    assert batch["attention_mask"].sum(1).tolist() == [n0, n1]
    short = 0 if n0 < n1 else 1
    assert (batch["labels"][short, min(n0, n1):] == IGNORE_INDEX).all()
    assert (batch["input_ids"][short, min(n0, n1):] == 0).all()


def test_batch_plan_covers_each_epoch_and_resumes():
    plan = BatchPlan(num_examples=11, batch_size=2, accumulation=2, seed=3)
    assert plan.micro_batches_per_epoch == 6 and plan.steps_per_epoch == 3
    assert plan.total_steps(2.0, -1) == 6 and plan.total_steps(2.0, 5) == 5
    steps = [s for _, s in zip(range(7), plan.steps())]
    for epoch in range(2):
        seen = sorted(i for _, _, groups in steps[3 * epoch: 3 * epoch + 3] for mb in groups for i in mb)
        assert seen == list(range(11))
    assert steps[0][2] != steps[3][2]  # a new order each epoch
    assert [s for _, s in zip(range(3), plan.steps(4))] == steps[4:7]


def test_example_dataset_ships_and_loads(tokenizer):
    from pathlib import Path

    import kt_serve
    from kt_serve.train.config import TrainConfig

    data_dir = Path(kt_serve.__file__).parent / "data" / "example_dataset"
    cfg = TrainConfig(model_name_or_path="m", output_dir="o", dataset="pirate_alpaca,pirate_sharegpt",
                      dataset_dir=str(data_dir), cutoff_len=256)
    ds = SFTDataset.build(cfg, tokenizer)
    assert len(ds) >= 200
    responses = [tokenizer.decode([t for t in e.labels if t != IGNORE_INDEX]) for e in ds.examples]
    assert all(r.startswith("Arr, matey!") and r.endswith("Yo ho ho!<|im_end|>\n") for r in responses[:200])
