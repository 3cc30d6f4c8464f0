"""Qwen3.5 LoRA names rewritten for SGLang's modules (kt_serve.formats.sglang_modules): the weight deltas B @ A
SGLang would apply per output row must equal the adapter's own, gate LoRA is set apart for the plugin, and modules
nothing can apply are refused."""

from __future__ import annotations

import pytest
import torch

from kt_serve.formats import FormatError
from kt_serve.formats.sglang_modules import gdn_dims, needs_sglang_names, split_gate_modules, to_sglang_modules

H, R, KD, VD = 24, 4, 8, 16
DIMS = {"key_dim": KD, "value_dim": VD}
PREFIX = "model.language_model.layers.0.linear_attn"


def lora(out_rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, H, generator=g), torch.randn(out_rows, R, generator=g)


def peft(**modules):
    out = {}
    for leaf, (a, b) in modules.items():
        out[f"{PREFIX}.{leaf}.lora_A.weight"] = a
        out[f"{PREFIX}.{leaf}.lora_B.weight"] = b
    return out


def delta(tensors, leaf):
    return tensors[f"{PREFIX}.{leaf}.lora_B.weight"] @ tensors[f"{PREFIX}.{leaf}.lora_A.weight"]


def test_in_proj_qkv_splits_into_q_k_v_with_the_same_delta():
    qkv, z = lora(2 * KD + VD, 0), lora(VD, 1)
    out, targets = to_sglang_modules("adapter", peft(in_proj_qkv=qkv, in_proj_z=z), DIMS)
    want = qkv[1] @ qkv[0]  # the adapter's own delta of in_proj_qkv, rows q | k | v
    got = torch.cat([delta(out, "in_proj_q"), delta(out, "in_proj_k"), delta(out, "in_proj_v")])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(delta(out, "in_proj_z"), z[1] @ z[0], rtol=0, atol=0)
    assert not any("in_proj_qkv." in k for k in out)
    assert targets == ["in_proj_qkvz"]


def test_untrained_stack_members_are_zero_lora():
    out, targets = to_sglang_modules("adapter", {**peft(in_proj_z=lora(VD, 2)), **peft(out_proj=lora(H, 3))}, DIMS)
    for leaf, rows in (("in_proj_q", KD), ("in_proj_k", KD), ("in_proj_v", VD)):
        assert delta(out, leaf).shape == (rows, H)
        assert delta(out, leaf).abs().max() == 0
    assert targets == ["in_proj_qkvz", "out_proj"]


def test_modules_nothing_can_apply_are_refused():
    tensors = peft(in_proj_qkv=lora(2 * KD + VD, 0), conv1d=lora(4, 5))
    with pytest.raises(FormatError, match=rf"adapter: LoRA on {PREFIX}\.conv1d: SGLang has no LoRA layer for "
                                          r"Qwen3\.5's short convolution; train the adapter without conv1d"):
        to_sglang_modules("adapter", tensors, DIMS)


def test_gate_modules_go_to_the_plugin_by_layer_and_leaf():
    """in_proj_a / in_proj_b (SGLang's fused in_proj_ba) and the routers are taken out for the plugin's gate LoRA,
    the rest is left for SGLang."""
    b, a, qkv = lora(4, 5), lora(4, 6), lora(2 * KD + VD, 0)
    router = lora(8, 7)
    tensors = {**peft(in_proj_b=b, in_proj_a=a, in_proj_qkv=qkv),
               "model.language_model.layers.3.mlp.gate.lora_A.weight": router[0],
               "model.language_model.layers.3.mlp.gate.lora_B.weight": router[1]}
    assert needs_sglang_names(peft(in_proj_b=b))
    rest, gates = split_gate_modules("adapter", tensors)
    assert rest == peft(in_proj_qkv=qkv)
    assert sorted(gates) == [(0, "in_proj_a"), (0, "in_proj_b"), (3, "gate")]
    assert gates[(0, "in_proj_a")]["A"] is a[0] and gates[(3, "gate")]["B"] is router[1]


def test_rows_that_do_not_fit_the_model_are_refused():
    with pytest.raises(FormatError, match=r"in_proj_qkv.lora_B.weight: 31 rows, the model's in_proj_qkv has 32"):
        to_sglang_modules("adapter", peft(in_proj_qkv=lora(2 * KD + VD - 1, 0)), DIMS)


def test_other_families_pass_through():
    keys = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(R, H)}
    assert not needs_sglang_names(keys)
    assert gdn_dims({"hidden_size": 8}) == {}
    assert gdn_dims({"linear_key_head_dim": 4, "linear_num_key_heads": 2, "linear_value_head_dim": 8,
                     "linear_num_value_heads": 4}) == {"key_dim": 8, "value_dim": 32}
