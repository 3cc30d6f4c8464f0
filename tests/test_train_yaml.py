"""The LLaMA-Factory + KT training YAMLs people already have run unchanged through ``python -m kt_serve.train``.

- the two seed YAMLs (tests/fixtures/, verbatim but for the model, dataset_dir and output paths) train a few
  steps on a tiny model, write the KT SFT output, and the log names every field that had no effect;
- each KT / LLaMA-Factory field either works (save_strategy, save_total_limit, save_only_model,
  dataloader_num_workers, kt_num_threads / cpu_infer) or fails with a one-line error naming it;
- typos fail naming the closest known field.
"""

import json
import logging
from pathlib import Path

import pytest
import yaml

from kt_serve.formats.names import ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE, FUSED_EXPERT_LORA_FILE
from kt_serve.harness.tiny_model import build_tiny_moe
from kt_serve.train import load_config, train
from kt_serve.train.__main__ import main as cli_main
from kt_serve.train.config import ConfigError
from kt_serve.train.trainer import LOG_FILE, PLOT_FILE

FIXTURES = Path(__file__).parent / "fixtures"
TINY = dict(hidden_size=64, moe_intermediate_size=32, num_experts=4, top_k=2, num_layers=2)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("models") / "qwen3_moe", "qwen3_moe", **TINY)


def write_datasets(directory: Path, names_and_sizes: dict[str, int]) -> Path:
    """Local alpaca datasets under the names a YAML asks for (LLaMA-Factory's identity / alpaca_en_demo ...)."""
    directory.mkdir(parents=True, exist_ok=True)
    info = {}
    for name, size in names_and_sizes.items():
        records = [{"instruction": f"Question {i} of {name}: what is {i} plus {i}?", "input": "",
                    "output": f"Arr, {i} plus {i} be {2 * i}, matey."} for i in range(size)]
        (directory / f"{name}.json").write_text(json.dumps(records))
        info[name] = {"file_name": f"{name}.json"}
    (directory / "dataset_info.json").write_text(json.dumps(info))
    return directory


def substituted(fixture: str, tmp_path: Path, model_dir: Path, dataset_dir: Path) -> Path:
    """The fixture's text with only the model, output and dataset_dir paths put in (every other line as shipped)."""
    lines = []
    for line in (FIXTURES / fixture).read_text().splitlines():
        if line.startswith("model_name_or_path:"):
            line = f"model_name_or_path: {model_dir}"
        elif line.startswith("output_dir:"):
            line = f"output_dir: {tmp_path / 'out'}\ndataset_dir: {dataset_dir}"
        lines.append(line)
    path = tmp_path / fixture
    path.write_text("\n".join(lines) + "\n")
    return path


# fixture: (datasets it names -> examples, steps its epochs/batches give, fields that have no effect here)
SEED_YAMLS = {
    "cookbook_qwen35_397b_bf16_lora.yaml": (
        {"your_dataset": 1}, 3,
        ["ddp_timeout", "use_kt", "kt_config.kt_tp_enabled", "kt_config.kt_threadpool_count",
         "kt_config.kt_max_cache_depth", "kt_config.kt_share_backward_bb"]),
    "llamafactory_qwen3moe_lora_sft_kt.yaml": (
        {"identity": 4, "alpaca_en_demo": 4}, 3, ["ddp_timeout", "use_kt", "kt_optimize_rule", "chunk_size"]),
}


@pytest.mark.parametrize("fixture", list(SEED_YAMLS))
def test_seed_yaml_trains_unchanged(fixture, tiny_model, tmp_path, caplog):
    datasets, steps, inert = SEED_YAMLS[fixture]
    shipped = yaml.safe_load((FIXTURES / fixture).read_text())
    path = substituted(fixture, tmp_path, tiny_model, write_datasets(tmp_path / "data", datasets))
    with caplog.at_level(logging.INFO):
        assert cli_main([str(path)]) == 0
    out = tmp_path / "out"
    for name in (ADAPTER_MODEL_FILE, FUSED_EXPERT_LORA_FILE, ADAPTER_CONFIG_FILE, PLOT_FILE):
        assert (out / name).is_file(), name
    logged = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    assert logged[-1]["step"] == logged[-1]["total_steps"] == steps
    adapter_config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    assert adapter_config["r"] == shipped["lora_rank"] and adapter_config["lora_alpha"] == shipped["lora_alpha"]
    assert adapter_config["lora_dropout"] == shipped["lora_dropout"]
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config ")]
    assert sorted(n.split(":")[0].removeprefix("config ") for n in notes) == sorted(inert)
    # the 64 kernel threads these YAMLs ask for are capped to this machine's CPUs, and said so
    assert any("kernel threads: 64 asked" in r.getMessage() for r in caplog.records)
    # gradient checkpointing (disable_gradient_checkpointing: false / LLaMA-Factory's default) is on
    assert any("gradient checkpointing: recompute" in r.getMessage() for r in caplog.records)


REQUIRED = {"model_name_or_path": "/models/m", "output_dir": "/tmp/out", "dataset": "d"}


@pytest.mark.parametrize("extra, message", [
    ({"lora_rnk": 8}, "lora_rnk (did you mean lora_rank?)"),
    ({"kt_config": {"kt_num_thread": 8}}, "kt_config.kt_num_thread (did you mean kt_config.kt_num_threads?)"),
    ({"save_stratgy": "steps"}, "did you mean save_strategy?"),
    ({"cpu_infer": 8, "kt_config": {"kt_num_threads": 4}}, "cpu_infer (8) and kt_config threads (4) contradict"),
    ({"kt_config": {"threads": 2, "kt_num_threads": 4}}, "kt_config.threads (2) and kt_config.kt_num_threads (4)"),
    ({"kt_config": {"kt_expert_weight_format": "nf4"}}, "kt_config.kt_expert_weight_format: 'nf4' is not supported"),
    ({"kt_config": {"kt_backend": "LLAMAFILE"}}, "kt_config.kt_backend: 'LLAMAFILE' is not available"),
    ({"kt_config": {"kt_model_max_length": 1024}, "cutoff_len": 2048}, "kt_model_max_length (1024) must be greater"),
    ({"use_kt": False}, "use_kt: false"),
    ({"kt_non_expert_weight_path": "/w"}, "kt_non_expert_weight_path: KT's converted non-expert files are not read"),
    ({"save_strategy": "best"}, "save_strategy: expected one of steps, epoch, no"),
    ({"kt_cpu_activation": "keep"}, "kt_cpu_activation: expected one of retain, recompute"),
    ({"lora_dropout": 1.0}, "lora_dropout: expected 0 <= p < 1"),
    ({"save_total_limit": 0}, "save_total_limit: expected a positive integer"),
])
def test_field_errors_name_the_field(tmp_path, extra, message):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**REQUIRED, **extra}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_kt_field_mapping():
    cfg = load_config(None, [*(f"{k}={v}" for k, v in REQUIRED.items()), "cpu_infer=3", "cutoff_len=100",
                             "per_device_train_batch_size=4", "kt_config.kt_backend=AVX512",
                             "kt_config.kt_expert_weight_format=BF16", "kt_config.kt_model_max_length=300"])
    assert cfg.kt_config.threads == 3 and cfg.kt_config.isa == "avx512_bf16"
    assert cfg.kernel_max_tokens == 300 * 4  # a micro-batch of rows of kt_model_max_length tokens
    assert load_config(None, [f"{k}={v}" for k, v in REQUIRED.items()]).kernel_max_tokens == 2048


def quick_config(model_dir, out, dataset_dir, *overrides):
    return load_config(None, [f"model_name_or_path={model_dir}", f"output_dir={out}", "dataset=d",
                              f"dataset_dir={dataset_dir}", "cutoff_len=64", "logging_steps=1",
                              "kt_config.threads=2", "disable_gradient_checkpointing=true", *overrides])


def checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def test_save_strategies_limit_and_model_only(tiny_model, tmp_path):
    data = write_datasets(tmp_path / "data", {"d": 4})  # 4 examples, batch 2: 2 steps an epoch
    common = ["per_device_train_batch_size=2", "num_train_epochs=3"]
    train(quick_config(tiny_model, tmp_path / "epoch", data, *common, "save_strategy=epoch"))
    assert checkpoints(tmp_path / "epoch") == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    train(quick_config(tiny_model, tmp_path / "no", data, *common, "save_strategy=no", "save_steps=1"))
    assert checkpoints(tmp_path / "no") == []
    train(quick_config(tiny_model, tmp_path / "limit", data, *common, "save_steps=1", "save_total_limit=2"))
    assert checkpoints(tmp_path / "limit") == ["checkpoint-5", "checkpoint-6"]
    only = tmp_path / "only"
    train(quick_config(tiny_model, only, data, *common, "save_steps=2", "save_only_model=true"))
    assert checkpoints(only) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert (only / "checkpoint-2" / ADAPTER_MODEL_FILE).is_file()
    assert not (only / "checkpoint-2" / "optimizer.pt").exists()
    with pytest.raises(ValueError, match="save_only_model: true, so it holds no optimizer"):
        train(quick_config(tiny_model, only, data, *common, "save_steps=2",
                           f"resume_from_checkpoint={only / 'checkpoint-2'}"))


def test_dataloader_workers_give_the_same_run(tiny_model, tmp_path):
    data = write_datasets(tmp_path / "data", {"d": 6})
    common = ["per_device_train_batch_size=2", "gradient_accumulation_steps=2", "max_steps=3"]
    inline = train(quick_config(tiny_model, tmp_path / "inline", data, *common))
    workers = train(quick_config(tiny_model, tmp_path / "workers", data, *common, "dataloader_num_workers=2"))
    assert [e["loss"] for e in workers] == [e["loss"] for e in inline]


def test_tokenized_cache_overwrite_cache_and_preprocessing_workers(tmp_path, caplog):
    from kt_serve.harness.tiny_model import build_tokenizer
    from kt_serve.train.data import SFTDataset

    tokenizer = build_tokenizer(1000)
    data = write_datasets(tmp_path / "data", {"d": 600})

    def build(*overrides):
        cfg = load_config(None, [*(f"{k}={v}" for k, v in REQUIRED.items()), f"dataset_dir={data}", "template=qwen",
                                 "cutoff_len=64", *overrides])
        caplog.clear()
        with caplog.at_level(logging.INFO):
            rows = [(e.input_ids, e.labels) for e in SFTDataset.build(cfg, tokenizer).examples]
        return rows, caplog.text

    first, log = build()
    assert "tokenized dataset cached at" in log and len(first) == 600
    again, log = build()
    assert "loaded from the cache" in log and again == first
    parallel, log = build("overwrite_cache=true", "preprocessing_num_workers=2")
    assert "tokenizing 600 conversations in 2 processes" in log and "loaded from the cache" not in log
    assert parallel == first
    fewer, log = build("max_samples=10")  # other data: another cache entry
    assert "loaded from the cache" not in log and fewer == first[:10]


def test_tokenized_cache_failures_only_warn(tmp_path, caplog, monkeypatch):
    from kt_serve.harness.tiny_model import build_tokenizer
    from kt_serve.train import data_cache
    from kt_serve.train.data import SFTDataset

    tokenizer = build_tokenizer(1000)
    data = write_datasets(tmp_path / "data", {"d": 3})
    cfg = load_config(None, [*(f"{k}={v}" for k, v in REQUIRED.items()), f"dataset_dir={data}", "template=qwen",
                             "cutoff_len=64"])
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # the cache root is a file: the entry cannot be written
    monkeypatch.setenv("KT_SERVE_CACHE", str(blocked))
    with caplog.at_level(logging.INFO):
        reference = [e.input_ids for e in SFTDataset.build(cfg, tokenizer).examples]
    assert "cannot write the tokenized-dataset cache" in caplog.text and len(reference) == 3

    monkeypatch.setenv("KT_SERVE_CACHE", str(tmp_path / "cache"))
    SFTDataset.build(cfg, tokenizer)
    (entry,) = data_cache.cache_dir().glob("*.json")
    entry.write_text("{truncated")  # e.g. a disk that filled up under another writer
    caplog.clear()
    with caplog.at_level(logging.INFO):
        rebuilt = [e.input_ids for e in SFTDataset.build(cfg, tokenizer).examples]
    assert "is unreadable; tokenizing anew" in caplog.text and rebuilt == reference
    assert [p.name for p in data_cache.cache_dir().iterdir()] == [entry.name]  # rewritten, no temp file left


def test_kt_weight_path_of_kt_converted_files_is_refused_and_a_cache_dir_accepted(tmp_path):
    kt_files = tmp_path / "kt_int8"
    kt_files.mkdir()
    (kt_files / "layer0.safetensors").write_bytes(b"")
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**REQUIRED, "kt_weight_path": str(kt_files)}))
    with pytest.raises(ConfigError, match=r"kt_weight_path: .* holds KT's converted expert files, which kt_serve "
                                          r"does not read; give the packed-weight cache directory"):
        load_config(path)
    path.write_text(yaml.safe_dump({**REQUIRED, "kt_weight_path": str(tmp_path / "cache")}))
    assert load_config(path).kt_weight_path == str(tmp_path / "cache")
