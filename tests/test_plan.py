"""kt_serve.plan: host memory counted from a checkpoint's headers, against bytes computed by hand from the configs
(and the kernel's own packed sizes), and the launch refusal it drives: a checkpoint that cannot fit is refused in
seconds with the figures, before anything loads."""

import json
import time

import pytest

from kt_serve import plan
from kt_serve.harness.tiny_model import build_tiny_moe

GIB = 2**30


def rows(p) -> dict:
    return {part.split(" (")[0]: nbytes for part, _, nbytes in p.rows}


def test_qwen3_moe_int4_experts_int8_dense_by_hand(tmp_path):
    model = build_tiny_moe(tmp_path / "q3", "qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_experts=8,
                           num_layers=2, vocab_size=1024)
    p = plan.serving_plan(model, plan.ServeOptions(expert_dtype="int4", dense_dtype="int8", lm_head_dtype="int8",
                                                   max_total_tokens=1000), available=64 * GIB)
    r = rows(p)
    # experts: 2 layers x 8 x (gate + up [128, 256] + down [256, 128]) at half a byte plus a 4-byte word per 128
    assert r["routed experts"] == 2 * 8 * (3 * 128 * 256) * (0.5 + 4 / 128)
    # attention: q, o [256, 256], k, v [128, 256] (4 heads of 64, 2 kv heads) at a byte plus an fp32 scale per row
    assert r["dense layers"] == 2 * (2 * 256 * 256 + 2 * 128 * 256) * (1 + 4 / 256)
    # routers [8, 256] and norms (2 x 256 + 2 x 64 a layer, 256 final) in bf16
    assert r["routers, norms, other small tensors"] == (2 * (8 * 256 + 2 * 256 + 2 * 64) + 256) * 2
    assert r["embeddings"] == 1024 * 256 * 2
    assert r["lm_head"] == 1024 * 256 * (1 + 4 / 256)
    assert p.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2  # layers x (K, V) x kv heads x head dim x bf16
    assert r["KV cache"] == 1000 * p.kv_bytes_per_token
    # the expert row is what the kernel packs
    from kt_serve.kernel.experts import MoEExperts
    import torch

    packed = MoEExperts(torch.zeros(8, 128, 256), torch.zeros(8, 128, 256), torch.zeros(8, 256, 128),
                        weight_format="int4", group_size=128)
    assert r["routed experts"] == 2 * packed.weight_bytes


def test_deepseek_mla_bf16_experts_by_hand(tmp_path):
    model = build_tiny_moe(tmp_path / "ds", "deepseek_v2", hidden_size=128, moe_intermediate_size=64, num_experts=8,
                           num_layers=3)
    p = plan.serving_plan(model, plan.ServeOptions(), available=64 * GIB)
    r = rows(p)
    assert r["routed experts"] == 3 * 8 * 3 * 128 * 64 * 2  # bf16 as stored; the shared expert is a dense layer
    assert p.kv_bytes_per_token == 3 * (32 + 16) * 2  # MLA: kv_lora_rank + qk_rope_head_dim a layer, bf16
    assert r["embeddings"] == 1024 * 128 * 2 and r["lm_head"] == 1024 * 128 * 2


def test_qwen3_5_fp8_experts_and_hybrid_kv_by_hand(tmp_path):
    model = build_tiny_moe(tmp_path / "q35", "qwen3_5_moe", hidden_size=128, moe_intermediate_size=128, num_experts=8)
    p = plan.serving_plan(model, plan.ServeOptions(expert_dtype="fp8"), available=64 * GIB)
    # 4 layers, each MoE: gate / up [128, 128], down [128, 128] as e4m3 plus an fp32 scale per 128 K values
    assert rows(p)["routed experts"] == 4 * 8 * 3 * 128 * 128 * (1 + 4 / 128)
    # one full-attention layer in four keeps a KV cache: 2 kv heads of 32
    assert p.kv_bytes_per_token == 1 * 2 * 2 * 32 * 2


def test_what_does_not_fit_is_refused_with_the_figures_and_the_flags_that_fit(tmp_path):
    model = build_tiny_moe(tmp_path / "q3", "qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_experts=8,
                           num_layers=2, vocab_size=1024)
    options = plan.ServeOptions(expert_adapter_bytes=0, max_total_tokens=1000)  # settled bytes fixed by the flags
    bf16 = plan.serving_plan(model, options, available=64 * GIB)
    int8 = plan.serving_plan(model, plan.ServeOptions(expert_dtype="int8", expert_adapter_bytes=0,
                                                      max_total_tokens=1000), available=64 * GIB)
    assert rows(int8)["routed experts"] < rows(bf16)["routed experts"] / 1.9
    tight = (bf16.settled + int8.settled) // 2  # int8 experts fit, bf16 do not
    message = plan.refusal(model, options, available=tight)
    assert message is not None and "will not fit" in message and "try --kt-expert-dtype int8" in message, message
    assert "| routed experts (2 MoE layers) | bf16 |" in message
    assert plan.refusal(model, plan.ServeOptions(expert_dtype="int8", expert_adapter_bytes=0, max_total_tokens=1000),
                        available=tight) is None


def test_the_cli_prints_the_table_and_exits_1_when_it_does_not_fit(tmp_path, capsys):
    model = build_tiny_moe(tmp_path / "q3", "qwen3_moe", num_layers=2)
    assert plan.main([str(model), "--available", "64GiB"]) == 0
    assert "| routed experts (2 MoE layers) | bf16 |" in capsys.readouterr().out
    assert plan.main([str(model), "--available", "1GiB"]) == 1
    assert "will not fit" in capsys.readouterr().out


def sparse_checkpoint(out, tiny):
    """The tiny checkpoint's files, but its config and one header claiming 512 experts of 4096 x 4096: tens of GiB
    that exist only in the header (a sparse file), so a launch must refuse it from the headers alone."""
    from kt_serve.formats.safetensors_io import SafetensorsWriter
    import shutil
    import torch

    shutil.copytree(tiny, out)
    config = json.loads((out / "config.json").read_text())
    config.update(num_experts=512, moe_intermediate_size=4096)
    (out / "config.json").write_text(json.dumps(config))
    layout = {f"model.layers.{L}.mlp.experts.{e}.{n}.weight": (torch.bfloat16, (4096, 4096))
              for L in range(2) for e in range(512) for n in ("gate_proj", "up_proj", "down_proj")}
    writer = SafetensorsWriter(out / "model-experts.safetensors", layout)
    writer.abort()  # the header and a sparse body of the declared size
    return out


def test_a_launch_that_cannot_fit_is_refused_in_seconds(tmp_path):
    pytest.importorskip("sglang")
    from kt_serve.harness.server import SGLangServer, ServerStartError

    model = sparse_checkpoint(tmp_path / "big", build_tiny_moe(tmp_path / "q3", "qwen3_moe", num_layers=2))
    t0 = time.perf_counter()
    with pytest.raises(ServerStartError) as err:
        with SGLangServer(model, [], startup_timeout=120):
            pass
    message = str(err.value)
    assert "will not fit: it needs" in message and "GiB this host has available" in message, message[-3000:]
    assert "| routed experts (2 MoE layers) | bf16 |" in message
    assert time.perf_counter() - t0 < 60  # refused by the launcher, not after loading


def test_training_plan_counts_the_lora_and_the_bf16_load_by_hand(tmp_path, capsys):
    model = build_tiny_moe(tmp_path / "q3", "qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_experts=8,
                           num_layers=2, vocab_size=1024)
    config = tmp_path / "train.yaml"
    config.write_text(f"model_name_or_path: {model}\nstage: sft\ndo_train: true\nfinetuning_type: lora\n"
                      "lora_rank: 4\nlora_target: q_proj,down_proj\ndataset: pirate_alpaca\n"
                      "dataset_dir: kt_serve/data/example_dataset\ntemplate: tokenizer\ncutoff_len: 64\n"
                      f"output_dir: {tmp_path / 'out'}\nper_device_train_batch_size: 2\n"
                      "kt_config:\n  dense_device: cpu\n  kt_expert_weight_format: int8\n")
    p = plan.training_plan(config, available=64 * GIB)
    r = rows(p)
    # int8: a byte plus an fp32 scale per row of K values (gate / up K = 256, down K = 128)
    assert r["routed experts in the kernel"] == 2 * 8 * (2 * 128 * 256 * (1 + 4 / 256) + 256 * 128 * (1 + 4 / 128))
    # expert down_proj LoRA (A [4, 128] + B [256, 4] per expert) and q_proj LoRA (A [4, 256] + B [256, 4] a layer),
    # each value with its gradient and two AdamW moments in fp32
    assert r["expert LoRA, rank 4, with gradients and AdamW states"] == 2 * 8 * 4 * (128 + 256) * 16
    assert r["non-expert LoRA"] == 2 * 4 * (256 + 256) * 16
    # transformers loads every tensor in bf16 before the kernel packs the experts
    from kt_serve.formats.checkpoint import tensor_entries

    assert p.staged_bytes == sum(e.numel for e in tensor_entries(model)) * 2
    assert plan.main(["--train", str(config), "--available", "64GiB"]) == 0
    assert "| expert LoRA, rank 4" in capsys.readouterr().out
