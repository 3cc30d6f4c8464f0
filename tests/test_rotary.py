"""kt_serve.kernel.rotary.rotary_embedding (one C++ pass) against an fp32 torch rotary embedding written out here (neox
and GPT-J pairing, partial rotary_dim, GQA head counts, q / k as strided views into a fused qkv row, rotated in place),
and against SGLang's own RotaryEmbedding.forward_native within its bf16 rounding."""

from __future__ import annotations

import math

import pytest
import torch

from kt_serve.kernel.rotary import rotary_embedding


def cache(max_pos, rotary_dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat([ang.cos(), ang.sin()], -1).float()


def reference(pos, x, head_size, cos_sin, neox, rotary_dim):
    """fp32: each head's first rotary_dim values rotated pairwise by the angle of its position."""
    T = pos.shape[0]
    h = x.float().reshape(T, -1, head_size).clone()
    half = rotary_dim // 2
    cos, sin = cos_sin[pos, :half][:, None], cos_sin[pos, half:][:, None]
    idx = torch.arange(half)
    a, b = (idx, idx + half) if neox else (2 * idx, 2 * idx + 1)
    x1, x2 = h[..., a].clone(), h[..., b].clone()
    h[..., a], h[..., b] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return h.reshape(x.shape)


def rotary_case(seed, T, hq, hk, head_size, rotary_dim, scale):
    """(generator, fp32 cache of 4096 positions, T random positions, bf16 qkv rows [T, (hq + 2 hk) * head_size])."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4096, (T,), generator=g)
    return g, cache(4096, rotary_dim), pos, (torch.randn(T, (hq + 2 * hk) * head_size, generator=g) * scale).bfloat16()


def ulps(a, b):  # bf16 steps between a and b, per element, relative to the larger of |b| and 1
    return ((a.float() - b.float()).abs() / (b.float().abs().clamp_min(1.0) * 2**-7)).amax().item()


@pytest.mark.parametrize("T, hq, hk, head_size, rotary_dim", [
    (1, 32, 4, 128, 128), (7, 4, 2, 64, 32), (3, 5, 5, 48, 48), (512, 8, 1, 256, 64), (2, 3, 1, 20, 10)])
@pytest.mark.parametrize("neox", [True, False])
def test_matches_fp32_reference(T, hq, hk, head_size, rotary_dim, neox):
    _, cs, pos, qkv = rotary_case(T * 131 + head_size, T, hq, hk, head_size, rotary_dim, 2)
    q, k, _ = qkv.split([hq * head_size, hk * head_size, hk * head_size], dim=-1)  # strided views, as in SGLang
    qkv0 = qkv.clone()
    q0, k0, v0 = qkv0.split([hq * head_size, hk * head_size, hk * head_size], dim=-1)
    got_q, got_k = rotary_embedding(pos, q, k, head_size, cs, neox, rotary_dim)
    assert got_q is q and got_k is k  # in place
    for got, x in ((got_q, q0), (got_k, k0)):
        want = reference(pos, x, head_size, cs, neox, rotary_dim)
        assert ulps(got, want) <= 1.0  # fp32 math, one rounding
        tail = got.reshape(T, -1, head_size)[..., rotary_dim:]
        assert torch.equal(tail, x.reshape(T, -1, head_size)[..., rotary_dim:])  # not rotated: left as it was
    assert torch.equal(qkv[:, (hq + hk) * head_size:], v0)  # v, beside q and k in the row, untouched


def test_matches_sglang_forward_native():
    """SGLang's op-by-op version rounds to bf16 after each product; ours within a few of its steps."""
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    torch.manual_seed(0)
    rope = RotaryEmbedding(128, 128, 4096, 1000000.0, True, torch.bfloat16)
    T = 9
    pos = torch.randint(0, 4096, (T,))
    q, k = torch.randn(T, 32 * 128).bfloat16(), torch.randn(T, 4 * 128).bfloat16()
    exact = reference(pos, q, 128, cache(4096, 128, 1000000.0), True, 128)
    want_q, want_k = RotaryEmbedding.forward_native(rope, pos, q.clone(), k.clone())
    got_q, got_k = rotary_embedding(pos, q, k, 128, cache(4096, 128, 1000000.0), True, 128)
    assert ulps(got_q, want_q) <= 4 and ulps(got_k, want_k) <= 4
    assert (got_q.float() - exact).abs().mean() <= (want_q.float() - exact).abs().mean()  # ours is closer to fp32


def test_positions_zero_is_identity_and_no_tokens():
    cs = cache(16, 8)
    q, k = torch.randn(2, 16).bfloat16(), torch.randn(2, 8).bfloat16()
    q0, k0 = q.clone(), k.clone()
    got_q, got_k = rotary_embedding(torch.zeros(2, dtype=torch.int64), q, k, 8, cs, False, 8)
    assert torch.equal(got_q, q0) and torch.equal(got_k, k0)  # angle 0: cos 1, sin 0
    e_q, e_k = rotary_embedding(torch.zeros(0, dtype=torch.int64), q[:0], k[:0], 8, cs, True, 8)
    assert e_q.shape == (0, 16) and e_k.shape == (0, 8)
    assert math.isclose(float(cs[3, 0]), math.cos(3.0), rel_tol=1e-6)  # the reference cache itself


def test_bad_arguments_raise_clear_errors():
    cs = cache(16, 8)
    q, k = torch.zeros(2, 16).bfloat16(), torch.zeros(2, 8).bfloat16()
    pos = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="outside the cache's \\[0, 16\\)"):
        rotary_embedding(torch.tensor([0, 16]), q, k, 8, cs, True, 8)
    with pytest.raises(ValueError, match="heads of a token must be dense"):
        rotary_embedding(pos, torch.zeros(2, 16, 2).bfloat16()[..., 0], k, 8, cs, True, 8)
    with pytest.raises(ValueError, match="cos_sin_cache must be"):
        rotary_embedding(pos, q, k, 8, cs.bfloat16(), True, 8)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        rotary_embedding(pos, q, k, 8, cs, True, 7)
    with pytest.raises(ValueError, match="query must be a CPU bf16"):
        rotary_embedding(pos, q.float(), k, 8, cs, True, 8)
    with pytest.raises(ValueError, match=r"key of shape \(2, 7\) is not \[2, heads \* 8\]"):
        rotary_embedding(pos, q, torch.zeros(2, 7).bfloat16(), 8, cs, True, 8)


def test_plugin_hook_takes_the_plain_case_only():
    """sglang_plugin.cpu_host.rotary: SGLang's forward_native for anything but bf16 q / k with the fp32 cache."""
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    from kt_serve.sglang_plugin.cpu_host.rotary import rotary_forward_native

    rope = RotaryEmbedding(64, 32, 256, 10000.0, False, torch.bfloat16)
    calls = []

    def original(*args):
        calls.append(args)
        return "sglang"

    pos, q, k = torch.tensor([3, 200]), torch.randn(2, 4 * 64).bfloat16(), torch.randn(2, 64).bfloat16()
    want_q, want_k = (reference(pos, x, 64, cache(256, 32), False, 32) for x in (q, k))
    got_q, got_k = rotary_forward_native(original, rope, pos, q, k)
    assert not calls
    assert rope.cos_sin_cache.dtype == torch.bfloat16  # SGLang's on a CPU host; the hook computes an fp32 one
    assert ulps(got_q, want_q) <= 1.0 and ulps(got_k, want_k) <= 1.0
    assert rotary_forward_native(original, rope, pos, q, k, offsets=torch.tensor([1, 1])) == "sglang"
    assert rotary_forward_native(original, rope, pos, q.float(), k.float()) == "sglang"
    assert len(calls) == 2


def rms_norm_heads_reference(x, T, head_size, w, eps):
    """fp32 RMSNorm of every head, rounded to bf16 as SGLang's RMSNorm returns it."""
    h = x.float().reshape(T, -1, head_size)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()).bfloat16().reshape(x.shape)


@pytest.mark.parametrize("T, hq, hk, head_size, rotary_dim", [(1, 32, 4, 128, 128), (9, 8, 1, 64, 32),
                                                            (300, 4, 4, 48, 48)])
@pytest.mark.parametrize("neox", [True, False])
def test_qk_norm_rope_matches_norm_then_rotary_reference(T, hq, hk, head_size, rotary_dim, neox):
    from kt_serve.kernel.rotary import qk_norm_rope

    g, cs, pos, qkv = rotary_case(T * 7 + hq, T, hq, hk, head_size, rotary_dim, 3)
    qw, kw = ((torch.rand(head_size, generator=g) + 0.5).bfloat16() for _ in range(2))
    q0, k0, v0 = (t.clone() for t in qkv.split([hq * head_size, hk * head_size, hk * head_size], dim=-1))
    q, k, v = qk_norm_rope(qkv, pos, hq, hk, head_size, qw, kw, 1e-6, 1e-5, cs, neox, rotary_dim)
    assert q.data_ptr() == qkv.data_ptr()  # views of qkv, written in place
    for got, x, w, eps in ((q, q0, qw, 1e-6), (k, k0, kw, 1e-5)):
        want = reference(pos, rms_norm_heads_reference(x, T, head_size, w, eps), head_size, cs, neox, rotary_dim)
        assert ulps(got, want) <= 2.0  # the norm's rounding (a sum order apart) and the rotary's
    assert torch.equal(v, v0)


def qwen3_attention_stub(head_size=64, hq=4, hk=2, norm_cls=None):
    """What Qwen3MoeAttention.apply_qk_norm_rope reads of its module, built from SGLang's own layers."""
    from types import SimpleNamespace

    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    norm_cls = norm_cls or RMSNorm
    q_norm, k_norm = norm_cls(head_size, eps=1e-6), norm_cls(head_size, eps=1e-6)
    g = torch.Generator().manual_seed(5)
    for n in (q_norm, k_norm):
        n.weight.data = (torch.rand(head_size, generator=g) + 0.5).bfloat16()
    return SimpleNamespace(q_norm=q_norm, k_norm=k_norm, rotary_emb=RotaryEmbedding(head_size, head_size, 256, 1e6,
                                                                                    True, torch.bfloat16),
                           head_dim=head_size, num_heads=hq, num_kv_heads=hk, use_fused_qk_norm_rope=False,
                           use_fused_qk_norm_rope_cpu=False, compatible_with_fused_kv_buffer=False)


def test_qk_norm_rope_hook_matches_sglangs_norm_and_rotary_modules():
    """sglang_plugin.cpu_host.rotary.apply_qk_norm_rope against SGLang's split, RMSNorm.forward_native per head and
    RotaryEmbedding.forward_native (the unfused CPU path; no hooks installed in this process)."""
    from kt_serve.sglang_plugin.cpu_host.rotary import apply_qk_norm_rope

    attn = qwen3_attention_stub()
    T, D = 5, attn.head_dim
    qkv = (torch.randn(T, (attn.num_heads + 2 * attn.num_kv_heads) * D) * 2).bfloat16()
    pos = torch.tensor([0, 7, 100, 3, 255])
    q, k, v = qkv.clone().split([attn.num_heads * D, attn.num_kv_heads * D, attn.num_kv_heads * D], dim=-1)
    q = attn.q_norm.forward_native(q.reshape(-1, D)).reshape(T, -1)
    k = attn.k_norm.forward_native(k.reshape(-1, D)).reshape(T, -1)
    want_q, want_k = attn.rotary_emb.forward_native(pos, q, k)
    calls = []
    got_q, got_k, got_v = apply_qk_norm_rope(lambda *a: calls.append(a), attn, qkv, pos, None)
    assert not calls and attn._used_fused_qk_norm_rope_last_call is False
    # SGLang rounds to bf16 after each multiply of its bf16 cos/sin cache; ours is fp32 math, one rounding
    assert ulps(got_q, want_q.reshape(T, -1)) <= 4.0 and ulps(got_k, want_k.reshape(T, -1)) <= 4.0
    assert torch.equal(got_v, v)
    assert ulps(got_q, reference(pos, q, D, cache(256, D, 1e6), True, D)) <= 1.0  # and against the fp32 rotation


def test_qk_norm_rope_hook_leaves_other_norms_to_sglang():
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    from kt_serve.sglang_plugin.cpu_host.rotary import apply_qk_norm_rope

    attn = qwen3_attention_stub(norm_cls=GemmaRMSNorm)
    qkv, pos = torch.zeros(1, 8 * 64).bfloat16(), torch.tensor([1])
    assert apply_qk_norm_rope(lambda *a: "sglang", attn, qkv, pos, None) == "sglang"
    attn = qwen3_attention_stub()
    assert apply_qk_norm_rope(lambda *a: "sglang", attn, qkv.float(), pos, None) == "sglang"
