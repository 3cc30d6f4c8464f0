"""kt_serve.train on Qwen3.5-MoE (Gated DeltaNet + gated full attention, shared expert): gradient parity with the
pure-torch reference (tests/train_reference.py on transformers' own torch GDN path) with lora_target: all — every
projection, linear attention (in_proj_a / in_proj_b too), the shared-expert gate and the routers."""

from __future__ import annotations

import pytest

from kt_serve.harness.tiny_model import build_tiny_moe
from test_train import check_parity

LINEAR = [f"linear_attn.{m}" for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")]
FULL = [f"self_attn.{p}_proj" for p in "qkvo"]
SHARED = [f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")] + ["mlp.shared_expert_gate", "mlp.gate"]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("models") / "qwen35", "qwen3_5_moe", hidden_size=64,
                          moe_intermediate_size=32, num_experts=4, top_k=2)


def test_qwen35_gradient_parity_with_pure_torch_reference(qwen35, tmp_path):
    kinds = ["linear"] * 3 + ["full"]
    check_parity(qwen35, qwen35, tmp_path, "all",
                 lambda layer: (LINEAR if kinds[layer] == "linear" else FULL) + SHARED, "qwen3_5_moe", layers=4)
