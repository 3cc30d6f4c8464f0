"""kt_serve.train on frozen quantized experts (kt_config.kt_expert_weight_format), against the pure-torch reference
trained on the weights the kernel holds, computed independently:

- int4 on a bf16 checkpoint: the reference model's experts are tests/quant_reference.py's int4 quantization
  of the checkpoint (the kernel's rules re-implemented in torch);
- a native FP8 checkpoint (the cookbook's "Native FP8 + LoRA", written by tests/fp8_checkpoint.py): the reference is
  the checkpoint dequantized in plain torch, experts and dense layers alike;
- the KT config names (kt_backend AMXINT4 / AMXINT8 / FP8, kt_weight_lifecycle) and their conflicts.
"""

import json
import shutil

import pytest

from fp8_checkpoint import write_fp8_checkpoint
from kt_serve.harness.tiny_model import build_tiny_moe
from kt_serve.train import load_config
from kt_serve.train.config import ConfigError
from quant_reference import write_expert_quantized_reference
from test_train import DATA_DIR, PARITY_CASES, TINY, check_parity

LORA_TARGET, MODULES = PARITY_CASES["qwen3_moe"]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("models") / "qwen3_moe", "qwen3_moe", **TINY)


def test_int4_experts_match_reference_on_dequantized_weights(tiny_qwen3, tmp_path):
    reference = write_expert_quantized_reference(tiny_qwen3, tmp_path / "int4_reference", "int4")
    losses, _ = check_parity(tiny_qwen3, reference, tmp_path, LORA_TARGET, MODULES, "int4",
                             "kt_config.kt_expert_weight_format=int4")
    # the bf16-expert reference is a different computation: int4 (about 9% weight error here) moves the loss
    bf16_losses, _ = check_parity(tiny_qwen3, tiny_qwen3, tmp_path / "bf16", LORA_TARGET, MODULES, "bf16")
    assert max(abs(a - b) for a, b in zip(losses, bf16_losses)) > 1e-3


def test_kt_weight_path_reads_the_packed_weight_cache(tiny_qwen3, tmp_path, caplog):
    """kt_weight_path is the server's packed-weight cache (--kt-weight-cache): the first run packs each layer and
    writes it there, the second reads every layer from it instead of quantizing, and both train against the
    reference on the int4-dequantized weights as above."""
    reference = write_expert_quantized_reference(tiny_qwen3, tmp_path / "int4_reference", "int4")
    cache = tmp_path / "cache"
    for run in ("first", "second"):
        caplog.clear()
        with caplog.at_level("INFO"):
            check_parity(tiny_qwen3, reference, tmp_path / run, LORA_TARGET, MODULES, f"int4 cache, {run} run",
                         "kt_config.kt_expert_weight_format=int4", f"kt_weight_path={cache}")
        read = [r for r in caplog.messages if "int4 experts read from the packed-weight cache" in r]
        assert len(read) == (0 if run == "first" else TINY["num_layers"]), caplog.messages
    assert len(list(cache.rglob("layer_*.safetensors"))) == TINY["num_layers"]


def test_native_fp8_checkpoint_trains_on_its_own_weights(tiny_qwen3, tmp_path):
    fp8_dir, reference = write_fp8_checkpoint(tiny_qwen3, tmp_path / "fp8", tmp_path / "fp8_reference")
    check_parity(fp8_dir, reference, tmp_path, LORA_TARGET, MODULES, "fp8", "kt_config.kt_expert_weight_format=fp8")


def test_kt_format_names(tiny_qwen3, tmp_path):
    def fmt(*overrides):
        cfg = load_config(None, [f"model_name_or_path={tiny_qwen3}", f"output_dir={tmp_path / 'o'}",
                                 "dataset=pirate_alpaca", f"dataset_dir={DATA_DIR}", *overrides])
        return cfg.kt_config.kt_expert_weight_format

    assert fmt() == "bf16"
    assert fmt("kt_config.kt_backend=AMXINT4") == "int4"
    assert fmt("kt_config.kt_backend=AMXINT8", "kt_config.kt_expert_weight_format=int8") == "int8"
    assert fmt("kt_config.kt_expert_weight_format=FP8", "kt_config.kt_weight_lifecycle=persistent") == "fp8"
    for overrides, message in [
        (["kt_config.kt_backend=AMXINT4", "kt_config.kt_expert_weight_format=int8"],
         "kt_config.kt_backend AMXINT4 holds int4 experts but kt_expert_weight_format is int8"),
        (["kt_config.kt_expert_weight_format=nf4"], "kt_config.kt_expert_weight_format: 'nf4' is not supported"),
        (["kt_config.kt_weight_lifecycle=streaming"], "kt_config.kt_weight_lifecycle: 'streaming'"),
        (["kt_non_expert_weight_path=/data/x"], "kt_non_expert_weight_path: KT's converted non-expert files"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            fmt(*overrides)


def test_other_checkpoint_quantization_is_refused(tiny_qwen3, tmp_path):
    from kt_serve.train.fp8_checkpoint import Fp8Checkpoint

    awq = tmp_path / "awq"
    shutil.copytree(tiny_qwen3, awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'awq' is not read; train from a bf16 or FP8"):
        Fp8Checkpoint.detect(awq)
    assert Fp8Checkpoint.detect(tiny_qwen3) is None
