"""The MoE block in one call (csrc/moe/router.cpp; kt_serve.kernel.experts.MoEExperts.forward_routed) against plain
torch: softmax top-k as SGLang's torch-native router computes it (torch.softmax, torch.topk, renormalisation), then the
fp32 per-expert reference of tests/moe_reference.py.
"""

import pytest
import torch

from kt_serve import _kernel
from kt_serve.kernel.linear import PackedLinear
from kt_serve.kernel.experts import ExpertLoRA, MoEExperts
from moe_reference import moe_lora_reference


def torch_topk(logits_bf16, k, renormalize):
    """SGLang's fused_topk_torch_native: softmax over fp32(bf16 logits), top-k, optional renormalisation."""
    p = torch.softmax(logits_bf16.float(), dim=-1)
    w, ids = torch.topk(p, k, dim=-1)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w, ids.to(torch.int32)


def kernel_topk(logits_bf16, k, renormalize):
    T, E = logits_bf16.shape
    ids = torch.empty(T, k, dtype=torch.int32)
    w = torch.empty(T, k)
    _kernel.softmax_topk(T, E, logits_bf16.data_ptr(), E, k, renormalize, ids.data_ptr(), w.data_ptr())
    return w, ids


@pytest.mark.parametrize("E,k", [(128, 8), (60, 4), (8, 8), (7, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_matches_torch(E, k, renormalize):
    g = torch.Generator().manual_seed(E * 10 + k)
    # distinct values, exact in bf16 (torch.topk orders ties arbitrarily; ties have their own test)
    logits = torch.stack([(torch.randperm(E, generator=g).float() - E / 2) / 16 for _ in range(37)]).bfloat16()
    w, ids = kernel_topk(logits, k, renormalize)
    w_ref, ids_ref = torch_topk(logits, k, renormalize)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(37), rtol=1e-6, atol=0)


def test_softmax_topk_ties_take_the_lower_expert_first():
    logits = torch.zeros(2, 6).bfloat16()
    logits[0, [1, 3, 4]] = 2.0   # a three-way tie for two places
    logits[1, [5, 2]] = torch.tensor([1.0, 1.0]).bfloat16()
    w, ids = kernel_topk(logits, 2, True)
    assert ids.tolist() == [[1, 3], [2, 5]]
    torch.testing.assert_close(w, torch.full((2, 2), 0.5))


def test_softmax_topk_refuses_k_outside_1_to_e():
    logits = torch.zeros(1, 4).bfloat16()
    with pytest.raises(ValueError, match="k = 5 for 4 experts"):
        kernel_topk(logits, 5, True)


def block(E=16, H=64, I=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(H, H, generator=g))
    gate_w = Q[:E].bfloat16()  # orthonormal rows, so the inputs below set the logits
    gate, up = ((torch.randn(E, I, H, generator=g) * 0.05).bfloat16() for _ in range(2))
    down = (torch.randn(E, H, I, generator=g) * 0.05).bfloat16()
    return g, Q, gate_w, gate, up, down


def inputs(g, Q, T, E):
    """T inputs whose logits are about a permutation of E values 0.25 apart: no near-tie in any top-k."""
    z = torch.randn(T, Q.shape[0], generator=g)
    z[:, :E] = torch.stack([(torch.randperm(E, generator=g).float() - E / 2) / 4 for _ in range(T)])
    return (z @ Q).bfloat16()


def reference_routing(x, gate_w, k, renormalize):
    """Routing from fp32 logits rounded to bf16 (SGLang's bf16 gate), and the top-k margin it rests on."""
    logits = (x.float() @ gate_w.float().T).bfloat16()
    top = logits.float().topk(k + 1, dim=-1).values
    return torch_topk(logits, k, renormalize), (top[:, k - 1] - top[:, k]).min().item()


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("T", [1, 3, 8, 40])
@pytest.mark.parametrize("renormalize", [True, False])
def test_forward_routed_matches_router_and_experts_reference(T, renormalize):
    E, H, I, k = 16, 64, 32, 4
    g, Q, gate_w, gate, up, down = block(E, H, I, seed=T)
    x = inputs(g, Q, T, E)
    (w, ids), margin = reference_routing(x, gate_w, k, renormalize)
    assert margin > 0.02, "the test's premise: no routing near-tie that bf16 rounding of the logits could flip"
    experts = MoEExperts(gate, up, down, max_tokens=64)
    y = experts.forward_routed(x, PackedLinear(gate_w), k, renormalize)
    ref = moe_lora_reference(x, ids, w, gate.float(), up.float(), down.float())
    assert rel_l2(y, ref) < 1e-2


def test_forward_routed_applies_each_tokens_expert_adapter():
    E, H, I, k, r, T = 16, 64, 32, 4, 4, 6
    g, Q, gate_w, gate, up, down = block(E, H, I, seed=7)
    shapes = {"gate_lora_a": (E, r, H), "gate_lora_b": (E, I, r), "up_lora_a": (E, r, H), "up_lora_b": (E, I, r),
              "down_lora_a": (E, r, I), "down_lora_b": (E, H, r)}
    lora = {n: (torch.randn(*s, generator=g) * 0.2).bfloat16() for n, s in shapes.items()}
    x = inputs(g, Q, T, E)
    (w, ids), margin = reference_routing(x, gate_w, k, True)
    assert margin > 0.02
    experts = MoEExperts(gate, up, down, max_tokens=64, max_slots=1)
    experts.set_adapter(0, ExpertLoRA(*lora.values(), alpha=8.0))
    slots = torch.tensor([0, -1, 0, 0, -1, 0], dtype=torch.int32)
    y = experts.forward_routed(x, PackedLinear(gate_w), k, True, slots=slots)
    ref = moe_lora_reference(x, ids, w, gate.float(), up.float(), down.float(), slots=slots,
                             loras={0: {**{n: t.float() for n, t in lora.items()}, "alpha": 8.0}})
    base = moe_lora_reference(x, ids, w, gate.float(), up.float(), down.float())
    assert rel_l2(y, ref) < 1e-2
    assert rel_l2(ref, base) > 0.1  # the adapter moves the adapted tokens' outputs well past the tolerance


def test_forward_routed_refuses_a_gate_of_another_shape():
    _, _, gate_w, gate, up, down = block()
    experts = MoEExperts(gate, up, down)
    with pytest.raises(ValueError, match=r"gate is \[8, 64\], the experts want \[16, 64\]"):
        experts.forward_routed(torch.zeros(1, 64).bfloat16(), PackedLinear(gate_w[:8]), 2, True)
    with pytest.raises(ValueError, match="top_k must be in 1..16"):
        experts.forward_routed(torch.zeros(1, 64).bfloat16(), PackedLinear(gate_w), 17, True)
