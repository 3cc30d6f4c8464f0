"""LoRA dropout on the expert LoRA inputs (PEFT semantics) in the kernel's training forward and backward.

The mask is re-implemented here in numpy from its definition in csrc/moe/dropout.h, so the kernel is checked
against an independent reference twice: the masks themselves, and the forward and every gradient against the
fp32 torch reference (tests/moe_reference.py) fed those numpy masks. Every kernel table of this CPU runs.
"""

import math

import numpy as np
import pytest
import torch

from kt_serve import _kernel
from kt_serve.formats.names import KT_TENSOR_NAMES
from kt_serve.kernel.experts import ExpertLoRA, MoEExperts, dropout_keep_mask
from kt_serve.train.expert_autograd import MoELoRAExperts
from moe_reference import moe_lora_reference
from test_kernel import ISAS, TOL, make_lora, make_weights, module_forward_backward, rel_l2, routing

U64 = np.uint64


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mix(z):
    z = z ^ (z >> U64(30))
    z = z * U64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> U64(27))
    z = z * U64(0x94D049BB133111EB)
    return z ^ (z >> U64(31))


def ref_keep_mask(seed, proj, T, k, cols, p):
    """csrc/moe/dropout.h, written out again: bool [T, k, cols]."""
    G = np.array([[0x9E3779B97F4A7C15]], dtype=U64)  # arrays wrap mod 2**64 silently (numpy scalars warn)
    thr = min(65535, math.floor(p * 65536 + 0.5))
    key = _mix(np.array([[seed]], dtype=U64) + U64(proj + 1) * G)
    rowkey = _mix(key + (np.arange(T * k, dtype=U64)[:, None] + U64(1)) * G)
    c = np.arange(cols, dtype=U64)[None, :]
    word = _mix(rowkey + ((c >> U64(2)) + U64(1)) * G)
    lane = (word >> (U64(16) * (c & U64(3)))) & U64(0xFFFF)
    return torch.from_numpy(lane >= thr).reshape(T, k, cols)


def ref_masks(seed, T, k, H, I, p):
    return p, tuple(ref_keep_mask(seed, proj, T, k, cols, p) for proj, cols in ((0, H), (1, H), (2, I)))


# ---------------------------------------------------------------------------------------------------------------
# The mask


@pytest.mark.parametrize("seed", [0, 1, 12345678901234567, 2**63 + 5, 2**64 - 1])
@pytest.mark.parametrize("T,k,cols", [(1, 1, 5), (3, 2, 70), (7, 3, 130)])
def test_mask_matches_independent_reimplementation(seed, T, k, cols):
    for proj in (0, 1, 2):
        for p in (0.05, 0.1, 0.5, 0.9):
            assert torch.equal(dropout_keep_mask(seed, proj, T, k, cols, p), ref_keep_mask(seed, proj, T, k, cols, p))


def test_mask_statistics_and_independence():
    T, k, cols = 64, 4, 1024  # 262144 elements: the keep fraction's std is below 1e-3
    for p in (0.1, 0.5):
        m = [dropout_keep_mask(7, proj, T, k, cols, p) for proj in (0, 1, 2)]
        for mi in m:
            assert abs(mi.float().mean().item() - (1 - p)) < 5e-3
        disagree = 2 * p * (1 - p)  # for independent masks
        for a, b in ((m[0], m[1]), (m[0], m[2]), (m[1], m[2]), (m[0], dropout_keep_mask(8, 0, T, k, cols, p))):
            assert abs((a != b).float().mean().item() - disagree) < 1e-2
    assert bool(dropout_keep_mask(3, 0, 4, 2, 64, 0.0).all())
    assert torch.equal(dropout_keep_mask(-1, 1, 3, 2, 70, 0.1), dropout_keep_mask(2**64 - 1, 1, 3, 2, 70, 0.1))
    assert dropout_keep_mask(0, 2, 0, 4, 8, 0.1).shape == (0, 4, 8)


# ---------------------------------------------------------------------------------------------------------------
# Forward and gradients against the reference


def reference(x, ids, w, gate, up, down, lo, grad_out, **kw):
    xs = x.float().clone().requires_grad_(True)
    ws = w.float().clone().requires_grad_(True)
    params = {n: lo[n].float().clone().requires_grad_(True) for n in KT_TENSOR_NAMES}
    params["alpha"] = lo["alpha"]
    y = moe_lora_reference(xs, ids, ws, gate, up, down, lora=params, **kw)
    y.backward(grad_out.float())
    return y, xs.grad, ws.grad, {n: params[n].grad for n in KT_TENSOR_NAMES}


def skip_some(ids, E):
    ids = ids.clone()
    ids[0, 0] = -1
    if ids.shape[0] > 1:
        ids[1, -1] = E + 3
    return ids


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("E,H,I,r,T,k", [(8, 70, 45, 1, 1, 3), (8, 70, 45, 8, 7, 2), (16, 70, 45, 8, 512, 4)])
def test_training_module_matches_reference(isa, p, E, H, I, r, T, k):
    gate, up, down = make_weights(E, H, I, seed=80)
    lo = make_lora(E, H, I, r, seed=81, scale=0.2)
    x = randn(T, H, seed=83).to(torch.bfloat16)
    ids, w = routing(T, k, E, seed=82)
    ids = skip_some(ids, E)
    grad_out = randn(T, H, seed=84).to(torch.bfloat16)
    seed = 1000 + T
    drop = ref_masks(seed, T, k, H, I, p)
    y_ref, gx_ref, gw_ref, gl_ref = reference(x, ids, w, gate, up, down, lo, grad_out, dropout=drop)
    *_, gl_plain = reference(x, ids, w, gate, up, down, lo, grad_out)
    assert rel_l2(gl_ref["gate_lora_a"], gl_plain["gate_lora_a"]) > 0.05  # the masks matter at this scale

    mod = MoELoRAExperts(gate, up, down, rank=r, alpha=lo["alpha"], isa=isa, dropout=p)
    mod.dropout_seed = seed
    y, xs, ws = module_forward_backward(mod, lo, x, ids, w, grad_out)
    assert rel_l2(y, y_ref) <= TOL
    assert rel_l2(xs.grad, gx_ref) <= TOL
    assert rel_l2(ws.grad, gw_ref) <= TOL
    assert ws.grad[0, 0] == 0
    for n in KT_TENSOR_NAMES:
        assert rel_l2(getattr(mod, n).grad, gl_ref[n]) <= TOL, n


def grad_buffers(lo):
    return ExpertLoRA(*(torch.zeros(t.shape) for t in ExpertLoRA.from_kt(lo, 1).tensors()), alpha=1.0)


def run(m, x, ids, w, go, bufs, **kw):
    """forward_sft + backward on slot 0's gradient buffers (zeroed first): (out, grad_x, grad_w, *lora grads)."""
    for t in bufs.tensors():
        t.zero_()
    y = m.forward_sft(x, ids, w, save_for_backward=True, **kw)
    gx, gw = m.backward(go)
    return (y, gx, gw) + tuple(t.clone() for t in bufs.tensors())


@pytest.mark.parametrize("isa", ISAS)
def test_mixed_slots_with_dropout(isa):
    # Base-only tokens (slot -1) never drop; tokens of the adapter drop by their pair's row t*k + j.
    E, H, I, r, T, k, p, seed = 6, 66, 34, 4, 40, 2, 0.3, 99
    gate, up, down = make_weights(E, H, I, seed=90)
    lo = make_lora(E, H, I, r, seed=91, scale=0.2)
    x = randn(T, H, seed=93).to(torch.bfloat16)
    ids, w = routing(T, k, E, seed=92)
    ids = skip_some(ids, E)
    go = randn(T, H, seed=94).to(torch.bfloat16)
    slots = torch.tensor([(-1, 0, 0)[t % 3] for t in range(T)], dtype=torch.int32)
    m = MoEExperts(gate, up, down, max_slots=2, isa=isa)
    m.set_adapter(0, ExpertLoRA.from_kt(lo, lo["alpha"]))
    bufs = grad_buffers(lo)
    m.set_grad_buffers(0, bufs)
    y, gx, gw, *gl = run(m, x, ids, w, go, bufs, slots=slots, dropout=p, dropout_seed=seed)
    params = {n: lo[n].float().clone().requires_grad_(True) for n in KT_TENSOR_NAMES}
    params["alpha"] = lo["alpha"]
    xs, ws = x.float().clone().requires_grad_(True), w.clone().requires_grad_(True)
    y_ref = moe_lora_reference(xs, ids, ws, gate, up, down, slots=slots, loras={0: params},
                               dropout=ref_masks(seed, T, k, H, I, p))
    y_ref.backward(go.float())
    assert rel_l2(y, y_ref) <= TOL
    assert rel_l2(gx, xs.grad) <= TOL
    assert rel_l2(gw, ws.grad) <= TOL
    for g, n in zip(gl, KT_TENSOR_NAMES):
        assert rel_l2(g, params[n].grad) <= TOL, n


# ---------------------------------------------------------------------------------------------------------------
# Exactness: p = 0, seeds


def setup(isa, E=8, H=70, I=45, r=8, T=33, k=3, seed=100):
    gate, up, down = make_weights(E, H, I, seed=seed)
    lo = make_lora(E, H, I, r, seed=seed + 1, scale=0.2)
    x = randn(T, H, seed=seed + 3).to(torch.bfloat16)
    ids, w = routing(T, k, E, seed=seed + 2)
    go = randn(T, H, seed=seed + 4).to(torch.bfloat16)
    m = MoEExperts(gate, up, down, isa=isa)
    m.set_adapter(0, ExpertLoRA.from_kt(lo, lo["alpha"]))
    bufs = grad_buffers(lo)
    m.set_grad_buffers(0, bufs)
    return m, bufs, (x, skip_some(ids, E), w, go)


@pytest.mark.parametrize("isa", ISAS)
def test_zero_dropout_is_bit_identical(isa):
    m, bufs, args = setup(isa)
    plain = run(m, *args, bufs, slots=0)
    zero = run(m, *args, bufs, slots=0, dropout=0.0, dropout_seed=12345)
    for a, b in zip(plain, zero):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa", ISAS)
def test_same_seed_same_results_other_seed_differs(isa):
    m, bufs, args = setup(isa)
    a = run(m, *args, bufs, slots=0, dropout=0.1, dropout_seed=7)
    b = run(m, *args, bufs, slots=0, dropout=0.1, dropout_seed=7)
    c = run(m, *args, bufs, slots=0, dropout=0.1, dropout_seed=8)
    plain = run(m, *args, bufs, slots=0)
    for i, (ta, tb, tc, tp) in enumerate(zip(a, b, c, plain)):
        assert torch.equal(ta, tb), i
        assert not torch.equal(ta, tc), i
        assert not torch.equal(ta, tp), i


# ---------------------------------------------------------------------------------------------------------------
# Errors, eval mode


@pytest.mark.parametrize("isa", ISAS)
def test_forward_without_saving_drops_the_same(isa):
    """A gradient-checkpointed layer's first forward saves nothing; its output must equal the recompute's."""
    m, _, (x, ids, w, _) = setup(isa)
    saved = m.forward_sft(x, ids, w, save_for_backward=True, slots=0, dropout=0.3, dropout_seed=7)
    unsaved = m.forward_sft(x, ids, w, slots=0, dropout=0.3, dropout_seed=7)
    assert torch.equal(saved, unsaved)
    assert not torch.equal(unsaved, m.forward_sft(x, ids, w, slots=0))


def test_dropout_needs_a_valid_rate():
    m, _, (x, ids, w, _) = setup(ISAS[0])
    for bad in (1.0, -0.1, float("nan"), 1.5, True, "0.1"):
        with pytest.raises(ValueError, match=r"dropout must be a float in \[0, 1\)"):
            m.forward_sft(x, ids, w, save_for_backward=True, slots=0, dropout=bad)
    with pytest.raises(ValueError, match="dropout_seed must be an int"):
        m.forward_sft(x, ids, w, save_for_backward=True, slots=0, dropout=0.1, dropout_seed=1.5)
    gate, up, down = make_weights(2, 16, 8)
    with pytest.raises(ValueError, match=r"dropout must be a float in \[0, 1\)"):
        MoELoRAExperts(gate, up, down, rank=2, alpha=4.0, dropout=1.0)
    with pytest.raises(ValueError, match="proj must be 0"):
        dropout_keep_mask(0, 3, 2, 2, 8, 0.1)
    with pytest.raises(ValueError, match="dropout must be in"):
        _kernel.dropout_keep_mask(0, 0, 1, 8, 1.0, torch.empty(8, dtype=torch.bool).data_ptr())


@pytest.mark.parametrize("isa", ISAS)
def test_training_module_drops_only_in_training_mode(isa):
    E, H, I, r, T = 4, 48, 20, 4, 12
    gate, up, down = make_weights(E, H, I, seed=110)
    lo = make_lora(E, H, I, r, seed=111, scale=0.2)
    x = randn(T, H, seed=113)
    ids, w = routing(T, 2, E, seed=112)
    mods = [MoELoRAExperts(gate, up, down, rank=r, alpha=lo["alpha"], isa=isa, dropout=p) for p in (0.5, 0.0)]
    for mod in mods:
        with torch.no_grad():
            for n in KT_TENSOR_NAMES:
                getattr(mod, n).copy_(lo[n].float())
        mod.dropout_seed = 5
    dropping, plain = mods
    expected = plain(x, ids, w)
    assert not torch.equal(dropping(x, ids, w), expected)
    dropping.eval()
    assert torch.equal(dropping(x, ids, w), expected)
    with torch.no_grad():
        assert torch.equal(dropping(x, ids, w), expected)
