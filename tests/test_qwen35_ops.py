"""kt_serve's torch stand-ins for sgl-kernel's Qwen3.5 / GDN CPU ops, called as SGLang 0.5.23 calls them, against
independent references: transformers 5.19's pure-torch Qwen3.5-MoE functions and plain fp32 formulas written here.

State pools are indexed by cache indices that skip slots and carry PAD_SLOT_ID (-1) rows; inputs are bf16 like the
server's; slots a call must not touch are checked unchanged.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from kt_serve.kernel import gdn
from test_kernel import ISAS
from kt_serve.sglang_plugin.models import qwen35_gdn
from kt_serve.sglang_plugin.hooks import FLA_GATED_RMS_NORM
from kt_serve.sglang_plugin.models.qwen35 import install_qwen35_cpu_ops, rms_norm_gated_forward_hook

tf = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")

SERVED = install_qwen35_cpu_ops()
OPS = torch.ops.sgl_kernel
mamba = importlib.import_module("sgl_kernel.mamba")

HK, HV, DK, DV, WIDTH = 2, 4, 32, 32, 4  # GQA ratio 2 as Qwen3.5 (16 k / 32 v heads)
BF = torch.bfloat16
PAD = -1


def close(actual, expected, tol=2e-2):
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.fixture(params=[True, False], ids=["C++", "torch"])
def kernel_path(request, monkeypatch):
    """The GDN ops (conv update, recurrent step, the prefill's delta rule) through csrc/ops/gdn.cpp, and through
    qwen35_gdn's torch formulas."""
    monkeypatch.setattr(qwen35_gdn, "USE_KERNEL", request.param)
    return request.param


@pytest.fixture(autouse=True)
def _seed_no_grad():
    torch.manual_seed(0)
    with torch.inference_mode():
        yield


def test_install_is_idempotent_and_serves_every_op():
    assert install_qwen35_cpu_ops() == SERVED
    for name in ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
                 "fused_qkvzba_split_reshape_cat_contiguous_cpu", "fused_sigmoid_gating_delta_rule_update_cpu",
                 "fused_gdn_gating_cpu", "causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu",
                 "chunk_gated_delta_rule_cpu", "fused_rmsnorm_gated_cpu"):
        assert hasattr(OPS, name), name
    for name in ("causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu"):
        assert callable(getattr(mamba, name)) and getattr(mamba, name).__module__.startswith("kt_serve"), name
    assert not hasattr(OPS, "convert_weight_packed")  # else SGLang would believe in AMX weight packing


# ------------------------------------------------------------------------------------------- norms and gates


@pytest.mark.parametrize("gate_3d", [False, True])
def test_fused_sigmoid_mul_in_place(gate_3d):
    x = torch.randn(5, 3 * 16, dtype=BF)
    gate = torch.randn(5, 3, 32, dtype=BF)[..., :16] if gate_3d else torch.randn(5, 48, dtype=BF)
    expected = x.float() / (1 + torch.exp(-gate.reshape(5, 48).float()))
    before = x.data_ptr()
    assert OPS.fused_sigmoid_mul_cpu(x, gate) is None
    assert x.data_ptr() == before
    close(x, expected)


def _gemma_ref(x, weight, eps, head_dim):
    norm = tf.Qwen3_5MoeRMSNorm(head_dim, eps=eps)
    norm.weight.copy_(weight.float())
    return norm(x.reshape(-1, head_dim).float())


def test_fused_qk_gemma_rmsnorm_on_split_views():
    heads, kv_heads, d, eps = 4, 2, 32, 1e-6
    qkv = torch.randn(6, (heads + 2 * kv_heads) * d, dtype=BF) * 3
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)  # strided views, as in qwen3_5.py
    qw, kw = torch.randn(d, dtype=BF) * 0.1, torch.randn(d, dtype=BF) * 0.1
    qo, ko = OPS.fused_qk_gemma_rmsnorm_cpu(q, k, qw, kw, eps, d)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == BF
    close(qo.reshape(-1, d), _gemma_ref(q, qw, eps, d))
    close(ko.reshape(-1, d), _gemma_ref(k, kw, eps, d))


def test_fused_qk_gemma_rmsnorm_with_gate_interleaved_heads():
    heads, kv_heads, d, eps, t = 4, 2, 32, 1e-6, 3
    q = torch.randn(t, heads, d, dtype=BF)
    gate = torch.randn(t, heads, d, dtype=BF)
    k = torch.randn(t, kv_heads * d, dtype=BF)
    q_gate = torch.cat((q, gate), dim=-1).reshape(t, heads * 2 * d)  # per head [q_h | gate_h]
    qkv = torch.cat((q_gate, k, k), dim=-1)
    q_gate, k, _ = qkv.split([heads * 2 * d, kv_heads * d, kv_heads * d], dim=-1)
    qw, kw = torch.randn(d, dtype=BF) * 0.1, torch.randn(d, dtype=BF) * 0.1
    qo, ko, go = OPS.fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, qw, kw, eps, d, heads)
    assert qo.shape == (t * heads, d) and ko.shape == (t * kv_heads, d) and go.shape == (t * heads, d)
    close(qo, _gemma_ref(q, qw, eps, d))
    close(ko, _gemma_ref(k, kw, eps, d))
    assert torch.equal(go, gate.reshape(-1, d))


def test_fused_qkvzba_split_reshape_cat_contiguous():
    t = 3
    qkvz = torch.randn(t, 2 * HK * DK + 2 * HV * DV, dtype=BF)
    ba = torch.randn(t, 2 * HV, dtype=BF)
    mixed_qkv, z, b, a = OPS.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, HK, HV, DK, DV)
    q, k, v, z_ref = torch.split(qkvz, [HK * DK, HK * DK, HV * DV, HV * DV], dim=-1)
    assert torch.equal(mixed_qkv, torch.cat((q, k, v), dim=-1)) and mixed_qkv.is_contiguous()
    assert torch.equal(z, z_ref.reshape(t, HV, DV)) and torch.equal(b, ba[:, :HV]) and torch.equal(a, ba[:, HV:])
    assert mixed_qkv.data_ptr() != qkvz.data_ptr()
    with pytest.raises((ValueError, RuntimeError), match="do not fit"):
        OPS.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, HK, HV, DK, DV + 1)


def _gating_ref(A_log, a, b, dt_bias):
    x = a.float() + dt_bias.float()
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    return -torch.exp(A_log.float()) * softplus, 1 / (1 + torch.exp(-b.float()))


def test_fused_gdn_gating():
    A_log, dt_bias = torch.randn(HV), torch.randn(HV, dtype=BF)
    a, b = torch.randn(7, HV, dtype=BF) * 10, torch.randn(7, HV, dtype=BF)
    g, beta = OPS.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    g_ref, beta_ref = _gating_ref(A_log, a, b, dt_bias)
    assert g.shape == (1, 7, HV) and g.dtype == torch.float32 and beta.dtype == BF
    close(g[0], g_ref, 1e-5)
    close(beta[0], beta_ref, 1e-2)


def test_rms_norm_gated_matches_transformers_and_sglang_module():
    layernorm_gated = importlib.import_module(FLA_GATED_RMS_NORM.rsplit(".", 1)[0])
    norm = layernorm_gated.RMSNorm(DV, eps=1e-6, group_size=None, norm_before_gate=True, dtype=BF)
    norm.weight.copy_(torch.randn(DV) * 0.5 + 1)
    ref = tf.Qwen3_5MoeRMSNormGated(DV, eps=1e-6)
    ref.weight.copy_(norm.weight.float())
    x, z = torch.randn(6 * HV, DV, dtype=BF), torch.randn(6, HV, DV, dtype=BF)  # z 3D as in qwen3_5.py
    out = rms_norm_gated_forward_hook(lambda *a: pytest.fail("took SGLang's Triton path"), norm, x, z)
    assert out.dtype == BF and out.shape == x.shape
    close(out, ref(x.float(), z.reshape(-1, DV).float()))
    close(OPS.fused_rmsnorm_gated_cpu(x, norm.weight, z.reshape(-1, DV), 1e-6), out, 1e-2)


@pytest.mark.parametrize("norm_before_gate,activation", [(False, "swish"), (True, "sigmoid"), (True, "swish")])
@pytest.mark.parametrize("dtype", [torch.float32, BF], ids=["fp32 (torch)", "bf16 (C++ where the norm comes first)"])
def test_rms_norm_gated_groups_and_gate_order(norm_before_gate, activation, dtype):
    layernorm_gated = importlib.import_module(FLA_GATED_RMS_NORM.rsplit(".", 1)[0])
    norm = layernorm_gated.RMSNorm(64, eps=1e-5, group_size=16, norm_before_gate=norm_before_gate,
                                   activation=activation)
    norm.weight.copy_(torch.randn(64))
    x, z = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    xf, zf = x.float(), z.float()
    act = torch.sigmoid(zf) if activation == "sigmoid" else zf * torch.sigmoid(zf)
    h = xf if norm_before_gate else xf * act
    hg = h.view(5, 4, 16)
    expected = (hg / torch.sqrt(hg.pow(2).mean(-1, keepdim=True) + 1e-5)).view(5, 64) * norm.weight
    expected = expected * act if norm_before_gate else expected
    out = rms_norm_gated_forward_hook(None, norm, x, z)
    assert out.dtype == dtype
    close(out, expected, 1e-5 if dtype == torch.float32 else 1e-2)


def test_rms_norm_gated_bf16_takes_the_kernel(monkeypatch):
    """Qwen3.5's configuration (bf16, norm before a SiLU gate) runs csrc/ops/norm.cpp, not the torch formula, and
    follows the module's weight when it is written in place."""
    from kt_serve.sglang_plugin.models import qwen35

    monkeypatch.setattr(qwen35, "rms_norm_gated", lambda *a, **k: pytest.fail("the torch formula ran"))
    layernorm_gated = importlib.import_module(FLA_GATED_RMS_NORM.rsplit(".", 1)[0])
    norm = layernorm_gated.RMSNorm(DV, eps=1e-6, group_size=None, norm_before_gate=True, dtype=BF)
    x, z = torch.randn(3 * HV, DV, dtype=BF), torch.randn(3, HV, DV, dtype=BF)
    for scale in (1.0, -2.0):
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, DV) * scale)
        xf, zf = x.float(), z.reshape(-1, DV).float()
        expected = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float() * F.silu(zf)
        close(rms_norm_gated_forward_hook(None, norm, x, z), expected)


# ------------------------------------------------------------------------------------------------------ conv1d


def _conv_setup(dim=48, slots=9):
    weight = (torch.randn(dim, WIDTH) * 0.5).to(BF)
    bias = torch.randn(dim, dtype=BF) * 0.1
    pool = torch.randn(slots, dim, WIDTH - 1, dtype=BF)
    return weight, bias, pool


def _conv_ref(x, state, weight, bias):
    """transformers' causal_conv1d_update over a whole sequence: x [dim, L], state [dim, K-1] -> (out, new state)."""
    st = state.clone().unsqueeze(0)
    out = tf.causal_conv1d_update(x.unsqueeze(0), st, weight, bias, activation="silu")
    return out[0], st[0]


def test_causal_conv1d_fn_varlen_initial_states_and_padding(kernel_path):
    weight, bias, pool = _conv_setup()
    lens = [5, 1, 2, 9, 3]
    has_init = torch.tensor([True, True, False, False, True])
    idx = torch.tensor([7, 2, 4, 0, PAD], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(sum(lens), weight.shape[0], dtype=BF)  # [tokens, dim] as projected
    before = pool.clone()
    out = mamba.causal_conv1d_fn_cpu(x.transpose(0, 1), weight, bias, activation="silu", conv_states=pool,
                                     has_initial_state=has_init, cache_indices=idx, query_start_loc=qsl,
                                     seq_lens_cpu=lens).transpose(0, 1)
    assert out.shape == x.shape and out.is_contiguous() and out.dtype == BF
    for n, (s, e) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist())):
        init = before[idx[n]] if has_init[n] and idx[n] >= 0 else torch.zeros_like(before[0])
        ref_out, ref_state = _conv_ref(x[s:e].t(), init, weight, bias)
        close(out[s:e], ref_out.t())
        if idx[n] >= 0:
            assert torch.equal(pool[idx[n]], ref_state), n
        else:  # padding row: output still computed (zero state), nothing written
            ref0 = tf.causal_conv1d_fn(x[s:e].t().unsqueeze(0), weight, bias, activation="silu")[0]
            close(out[s:e], ref0.t())
    untouched = [i for i in range(pool.shape[0]) if i not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_causal_conv1d_update_decode_with_padding_rows(kernel_path):
    weight, bias, pool = _conv_setup()
    idx = torch.tensor([5, PAD, 1, 8], dtype=torch.int32)
    x = torch.randn(4, weight.shape[0], dtype=BF)
    before = pool.clone()
    out = mamba.causal_conv1d_update_cpu(x, pool, weight, bias, "silu", conv_state_indices=idx)
    for row, slot in enumerate(idx.tolist()):
        if slot == PAD:
            assert torch.all(out[row] == 0)
            continue
        ref_out, ref_state = _conv_ref(x[row:row + 1].t(), before[slot], weight, bias)
        close(out[row], ref_out[:, 0])
        assert torch.equal(pool[slot], ref_state)
    assert torch.equal(pool[[0, 2, 3, 4, 6, 7]], before[[0, 2, 3, 4, 6, 7]])
    with pytest.raises((NotImplementedError, RuntimeError), match="VNNI"):
        OPS.causal_conv1d_update_cpu(x, pool, weight, bias, True, None, idx, -1, True)


def test_causal_conv1d_prefill_then_decode_equals_one_prefill(kernel_path):
    weight, bias, pool = _conv_setup()
    x = torch.randn(13, weight.shape[0], dtype=BF)
    one = mamba.causal_conv1d_fn_cpu(x.t(), weight, bias, "silu", pool, torch.tensor([False]),
                                     torch.tensor([3], dtype=torch.int32), torch.tensor([0, 13], dtype=torch.int32),
                                     [13]).t()
    whole_state = pool[3].clone()
    pool[6] = torch.randn_like(pool[6])  # garbage: has_initial_state False must ignore it
    part = mamba.causal_conv1d_fn_cpu(x[:10].t(), weight, bias, "silu", pool, torch.tensor([False]),
                                      torch.tensor([6], dtype=torch.int32), torch.tensor([0, 10], dtype=torch.int32),
                                      [10]).t()
    steps = [mamba.causal_conv1d_update_cpu(x[t:t + 1], pool, weight, bias, "silu",
                                            torch.tensor([6], dtype=torch.int32)) for t in range(10, 13)]
    close(torch.cat([part] + steps), one, 1e-2)
    assert torch.equal(pool[6], whole_state)


# ------------------------------------------------------------------------------------------------- delta rule


def _gdn_inputs(tokens, dk=DK, dv=DV):
    q = torch.randn(1, tokens, HK, dk, dtype=BF)
    k = torch.randn(1, tokens, HK, dk, dtype=BF)
    v = torch.randn(1, tokens, HV, dv, dtype=BF)
    a, b = torch.randn(tokens, HV, dtype=BF), torch.randn(tokens, HV, dtype=BF)
    A_log, dt_bias = torch.rand(HV) * 0.5, torch.randn(HV, dtype=BF) * 0.5
    return q, k, v, a, b, A_log, dt_bias


def _recurrent_ref(q, k, v, a, b, A_log, dt_bias, state, beta_dtype=torch.float32):
    """transformers' token-by-token GDN (GQA expanded as its GatedDeltaNet does). q/k/v: [1, T, H, D]. Prefill gets
    beta in the activation dtype (fused_gdn_gating's output), decode computes it in fp32: beta_dtype says which."""
    g, beta = _gating_ref(A_log, a, b, dt_bias)
    beta = beta.to(beta_dtype).float()
    rep = HV // HK
    return tf.torch_recurrent_gated_delta_rule(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v,
                                               g.unsqueeze(0), beta.unsqueeze(0), initial_state=state,
                                               output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("idx", [[6, PAD, 2, 9], [3, 4, 5]], ids=["scattered+pad", "contiguous-run"])
def test_recurrent_decode_step(idx, kernel_path):
    batch = len(idx)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(batch)
    pool = torch.randn(11, HV, DK, DV) * 0.3
    before = pool.clone()
    indices = torch.tensor(idx, dtype=torch.int32)
    out = OPS.fused_sigmoid_gating_delta_rule_update_cpu(  # keywords and [1, batch, H, D] as gdn_triton.decode
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=pool,
        initial_state_indices=indices, cu_seqlens=torch.arange(batch + 1, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0)
    assert out.shape == (batch, 1, HV, DV) and out.dtype == BF
    for row, slot in enumerate(idx):
        if slot == PAD:
            assert torch.all(out[row] == 0)
            continue
        sl = slice(row, row + 1)
        ref_out, ref_state = _recurrent_ref(q[:, sl], k[:, sl], v[:, sl], a[sl], b[sl], A_log, dt_bias,
                                            before[slot:slot + 1])
        close(out[row, 0], ref_out[0, 0])
        close(pool[slot], ref_state[0], 1e-4)
    untouched = [i for i in range(11) if i not in idx]
    assert torch.equal(pool[untouched], before[untouched])


def _prefill(q, k, v, a, b, A_log, dt_bias, pool, cu, idx):
    g, beta = OPS.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    out, final, h = mamba.chunk_gated_delta_rule_cpu(  # keywords as gdn_triton.extend
        q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        head_first=False, use_qk_l2norm_in_kernel=True, initial_state_indices=torch.tensor(idx, dtype=torch.int32))
    return out, final


def test_chunked_prefill_several_sequences_against_transformers(kernel_path):
    lens = [70, 1, 130, 64, 9]  # inside, at and across 64-token chunk boundaries
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    idx = [4, 0, 7, PAD, 2]
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(cu[-1])
    pool = torch.randn(9, HV, DK, DV) * 0.3
    before = pool.clone()
    out, final = _prefill(q, k, v, a, b, A_log, dt_bias, pool, cu, idx)
    assert out.shape == v.shape and out.dtype == BF and final.shape == (len(lens), HV, DK, DV)
    g, beta = _gating_ref(A_log, a, b, dt_bias)
    beta = beta.to(BF).float()  # what the chunk op receives from fused_gdn_gating
    rep = HV // HK
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        init = before[idx[n]:idx[n] + 1] if idx[n] != PAD else None
        ref_out, ref_state = tf.torch_chunk_gated_delta_rule(
            q[:, s:e].repeat_interleave(rep, 2), k[:, s:e].repeat_interleave(rep, 2), v[:, s:e],
            g[None, s:e], beta[None, s:e], initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
        close(out[:, s:e], ref_out)
        close(final[n], ref_state[0], 1e-4)
        if idx[n] != PAD:
            close(pool[idx[n]], ref_state[0], 1e-4)
    untouched = [i for i in range(9) if i not in idx]
    assert torch.equal(pool[untouched], before[untouched])


def test_prefill_continued_from_saved_state_equals_one_prefill(kernel_path):
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(150)
    pool = torch.zeros(4, HV, DK, DV)
    one, _ = _prefill(q, k, v, a, b, A_log, dt_bias, pool, [0, 150], [1])
    whole = pool[1].clone()
    cut = 90
    head, _ = _prefill(q[:, :cut], k[:, :cut], v[:, :cut], a[:cut], b[:cut], A_log, dt_bias, pool, [0, cut], [2])
    tail, _ = _prefill(q[:, cut:], k[:, cut:], v[:, cut:], a[cut:], b[cut:], A_log, dt_bias, pool, [0, 150 - cut],
                       [2])
    close(torch.cat((head, tail), dim=1), one)
    close(pool[2], whole, 1e-4)


@pytest.mark.parametrize("dk,dv", [(DK, DV), (16, 48)], ids=["k=v", "k!=v pool as SGLang allocates (Hv, Dv, Dk)"])
def test_prefill_then_decode_equals_one_prefill(dk, dv, kernel_path):
    total, cut = 80, 77
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(total, dk, dv)
    pool = torch.zeros(5, HV, dv, dk)  # SGLang's (Hv, V, K): with K != V only [K][V] read transposed fits
    one, _ = _prefill(q, k, v, a, b, A_log, dt_bias, pool, [0, total], [0])
    whole = pool[0].clone()
    part, _ = _prefill(q[:, :cut], k[:, :cut], v[:, :cut], a[:cut], b[:cut], A_log, dt_bias, pool, [0, cut], [3])
    steps = []
    for t in range(cut, total):  # positional, as the op's schema orders them
        steps.append(OPS.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log, dt_bias, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[t:t + 1], b[t:t + 1], pool,
            torch.tensor([3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), True))
    close(torch.cat([part] + [s.transpose(0, 1) for s in steps], dim=1), one)
    close(pool[3], whole, 1e-2)  # decode's beta is fp32, prefill's bf16 (as in SGLang): a 2^-8 relative difference
    ref_out, ref_state = _recurrent_ref(q, k, v, a, b, A_log, dt_bias, None, beta_dtype=BF)
    close(one, ref_out)
    close(pool[0].transpose(-1, -2) if dk != dv else pool[0], ref_state[0], 1e-4)


def test_bad_state_pool_shape_is_refused():
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(2)
    with pytest.raises((ValueError, RuntimeError), match="fits neither"):
        OPS.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, torch.zeros(3, HV, DK, DV + 1),
                                                       torch.tensor([0, 1], dtype=torch.int32),
                                                       torch.arange(3, dtype=torch.int32), True)
    assert qwen35_gdn.CHUNK == 64


def test_decode_slot_outside_the_pool_is_refused_with_nothing_written():
    """The C++ decode ops check every request's slot before touching any state (a bad cache index must not corrupt
    the other requests' states or write past the pool)."""
    weight, bias, pool = _conv_setup()
    before = pool.clone()
    x = torch.randn(2, weight.shape[0], dtype=BF)
    with pytest.raises((IndexError, RuntimeError), match="state slot 9, the pool holds 9"):
        gdn.conv_update(x, pool, weight, bias, True, torch.tensor([1, 9], dtype=torch.int32))
    assert torch.equal(pool, before)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(2)
    states = torch.randn(3, HV, DK, DV)
    kept = states.clone()
    with pytest.raises((IndexError, RuntimeError), match="state slot 3, the pool holds 3"):
        gdn.recurrent_step(A_log, dt_bias, q, k, v, a, b, states, torch.tensor([0, 3], dtype=torch.int32), True,
                           1.0, 20.0)
    assert torch.equal(states, kept)


def test_decode_ops_take_the_kernel_for_sglang_inputs(monkeypatch):
    """bf16 activations and fp32 states as SGLang passes them take csrc/ops/gdn.cpp (not the torch formulas)."""
    def torch_path(*args, **kwargs):
        raise AssertionError("the torch formulas ran")

    # both torch decode formulas start there or at _heads_view
    monkeypatch.setattr(qwen35_gdn, "_valid_rows", torch_path)
    monkeypatch.setattr(qwen35_gdn, "_heads_view", torch_path)
    weight, bias, pool = _conv_setup()
    mamba.causal_conv1d_update_cpu(torch.randn(2, weight.shape[0], dtype=BF), pool, weight, bias, "silu",
                                   conv_state_indices=torch.tensor([0, PAD], dtype=torch.int32))
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(2)
    OPS.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, torch.randn(3, HV, DK, DV),
                                                   torch.tensor([2, PAD], dtype=torch.int32),
                                                   torch.arange(3, dtype=torch.int32), True)


def test_strided_pools_as_sglang_may_lay_them_out(kernel_path):
    """Conv states dim-contiguous (the AMX layout, memory_pool._init_amx_conv_state) and an SSM pool whose slots are
    not packed (an envelope holding other state between slots): same results as packed pools."""
    weight, bias, packed = _conv_setup()
    strided = torch.empty(packed.shape[0], WIDTH - 1, packed.shape[1], dtype=BF).transpose(1, 2)
    strided.copy_(packed)
    x = torch.randn(3, weight.shape[0], dtype=BF)
    idx = torch.tensor([2, 3, 4], dtype=torch.int32)
    outs = [mamba.causal_conv1d_update_cpu(x, pool, weight, bias, "silu", conv_state_indices=idx)
            for pool in (packed, strided)]
    assert torch.equal(strided, packed) and strided.stride(1) == 1 and torch.equal(*outs)
    lens, qsl = [4, 2], torch.tensor([0, 4, 6], dtype=torch.int32)
    xs = torch.randn(6, weight.shape[0], dtype=BF)
    outs = [mamba.causal_conv1d_fn_cpu(xs.t(), weight, bias, "silu", pool, torch.tensor([True, False]), idx[:2], qsl,
                                       lens) for pool in (packed, strided)]
    assert torch.equal(strided, packed) and torch.equal(*outs)

    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(3)
    envelope = torch.randn(6, 2, HV, DK, DV) * 0.3
    ssm = envelope[:, 0]
    before = ssm.clone()
    indices = torch.tensor([1, 2, 3], dtype=torch.int32)  # one run of three slots: views that cannot be flattened
    out = OPS.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, ssm, indices,
                                                         torch.arange(4, dtype=torch.int32), True)
    for row in range(3):
        sl = slice(row, row + 1)
        ref_out, ref_state = _recurrent_ref(q[:, sl], k[:, sl], v[:, sl], a[sl], b[sl], A_log, dt_bias,
                                            before[row + 1:row + 2])
        close(out[row, 0], ref_out[0, 0])
        close(ssm[row + 1], ref_state[0], 1e-4)
    assert torch.equal(ssm[[0, 4, 5]], before[[0, 4, 5]])


def test_prefill_in_blocks_of_chunks_equals_one_block(monkeypatch):
    """Long prefills on the torch formulas build their intra-chunk tensors CHUNKS_PER_BLOCK chunks at a time: block
    edges change nothing."""
    monkeypatch.setattr(qwen35_gdn, "USE_KERNEL", False)
    lens = [130, 70, 9, 200]
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(cu[-1])
    pool = torch.randn(6, HV, DK, DV) * 0.3
    results = []
    for blocks in (qwen35_gdn.CHUNKS_PER_BLOCK, 1, 3):
        monkeypatch.setattr(qwen35_gdn, "CHUNKS_PER_BLOCK", blocks)
        p = pool.clone()
        results.append((_prefill(q, k, v, a, b, A_log, dt_bias, p, cu, [5, 1, 3, 0])[0], p))
    for out, p in results[1:]:
        close(out, results[0][0], 1e-3)
        close(p, results[0][1], 1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_prefill_scan_on_every_isa_table_against_transformers(isa):
    """csrc/ops/gdn.cpp's prefill scan on each kernel table (its per-ISA gdn_scan_columns), Qwen3.5's head sizes: a
    128-wide state is four column blocks, the 64-token window crossed, an empty sequence, states from a strided pool (an
    envelope holding other state between slots, as SGLang may lay it out) and from none (indices None: the given
    states left unchanged)."""
    hk, hv, d = 2, 4, 128
    lens = [70, 5, 0]
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    q = torch.randn(1, cu[-1], hk, d, dtype=BF)
    k = torch.randn(1, cu[-1], hk, d, dtype=BF)
    v = torch.randn(1, cu[-1], hv, d, dtype=BF)
    a, b = torch.randn(cu[-1], hv, dtype=BF), torch.randn(cu[-1], hv, dtype=BF)
    A_log, dt_bias = torch.rand(hv) * 0.5, torch.randn(hv, dtype=BF) * 0.5
    g, beta = OPS.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    envelope = torch.randn(5, 2, hv, d, d) * 0.05
    pool, other = envelope[:, 1], envelope[:, 0].clone()
    before = pool.clone()
    idx = [3, PAD, 1]
    out, final = gdn.scan(q, k, v, g, beta, pool, torch.tensor(idx, dtype=torch.int32),
                          torch.tensor(cu, dtype=torch.int32), True, 1e-6, isa=isa)
    given = before[[0, 2, 4]].clone()
    out2, final2 = gdn.scan(q, k, v, g, beta, given, None, torch.tensor(cu, dtype=torch.int32), True, 1e-6, isa=isa)
    assert torch.equal(given, before[[0, 2, 4]]) and torch.equal(envelope[:, 0], other)
    rep = hv // hk
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        for init, o, f in ((before[idx[n]:idx[n] + 1] if idx[n] != PAD else None, out, final),
                           (given[n:n + 1], out2, final2)):
            ref_out, ref_state = tf.torch_recurrent_gated_delta_rule(
                q[:, s:e].repeat_interleave(rep, 2).float(), k[:, s:e].repeat_interleave(rep, 2).float(),
                v[:, s:e].float(), g[:, s:e], beta[:, s:e].float(), initial_state=init, output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            close(o[:, s:e], ref_out)
            close(f[n], ref_state[0], 1e-4)
        if idx[n] != PAD:
            close(pool[idx[n]], final[n], 1e-6) if e > s else torch.testing.assert_close(pool[idx[n]], before[idx[n]])
    assert torch.equal(pool[[0, 2, 4]], before[[0, 2, 4]])


def test_prefill_takes_the_kernel_for_sglang_inputs(monkeypatch):
    """The prefill conv and delta rule take csrc/ops/gdn.cpp for SGLang's inputs: x as the transpose of contiguous
    [tokens, dim] bf16 rows, bf16 conv states; bf16 q / k / v, fp32 g, bf16 beta and an fp32 pool."""
    taken = []

    def spy(fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            taken.append((fn.__name__, out is not None))
            return out
        return call

    monkeypatch.setattr(gdn, "conv_prefill", spy(gdn.conv_prefill))
    monkeypatch.setattr(gdn, "scan", spy(gdn.scan))
    weight, bias, pool = _conv_setup()
    x = torch.randn(9, weight.shape[0], dtype=BF)
    mamba.causal_conv1d_fn_cpu(x.t(), weight, bias, "silu", pool, torch.tensor([True, False]),
                               torch.tensor([2, PAD], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32),
                               [4, 5])
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(9)
    _prefill(q, k, v, a, b, A_log, dt_bias, torch.zeros(3, HV, DK, DV), [0, 4, 9], [2, PAD])
    assert taken == [("conv_prefill", True), ("scan", True)]


def test_prefill_with_bad_sequence_offsets_is_refused_with_nothing_written():
    """cu_seqlens past the tokens, falling, or a slot list of the wrong length: a one-line error before the C++ scan or
    conv reads past its inputs or writes a state."""
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(6)
    g, beta = OPS.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    pool = torch.randn(3, HV, DK, DV)
    kept = pool.clone()
    for cu, idx, match in (([0, 4, 9], [0, 1], "rise from 0 to at most the 6 tokens"),
                           ([0, 4, 2], [0, 1], "rise from 0"), ([0, 6], [0, 1], "2 values for 1 sequences")):
        with pytest.raises(ValueError, match=match):
            gdn.scan(q, k, v, g, beta, pool, torch.tensor(idx, dtype=torch.int32), torch.tensor(cu), True, 1e-6)
    assert torch.equal(pool, kept)
    weight, bias, states = _conv_setup()
    before = states.clone()
    with pytest.raises(ValueError, match="conv prefill: cu_seqlens must rise from 0 to at most the 6 tokens"):
        gdn.conv_prefill(torch.randn(6, weight.shape[0], dtype=BF), states, weight, bias, True,
                         torch.tensor([0, 7]), torch.tensor([1], dtype=torch.int32), torch.tensor([True]))
    assert torch.equal(states, before)
