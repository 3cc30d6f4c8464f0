"""A Qwen3-MoE decoder stack's decode step in one call (kt_serve/kernel/decode_stack.py, csrc/ops/decode_stack.cpp)
against a plain fp32 torch reference of the same step: RMSNorm with the residual stream, qkv projection, per-head q / k
RMSNorm, rotary (neox and GPT-J pairing, partial rotary dims), attention over a paged cache holding earlier tokens
plus this step's, o projection, softmax top-k routing and SwiGLU experts with per-request expert LoRA, final norm.

Every kernel table this CPU has runs. Tolerance rel-L2 1e-2 (measured 5-6e-3): the kernel rounds every intermediate (normed rows,
qkv, attention, projections) to bf16 as SGLang does, across two layers; a wrong slot, head, rotary pairing, a
skipped residual or a lost adapter moves the output by tenths. The routing's top-k margins are checked so that
those roundings cannot flip an expert choice.
"""

import math

import pytest
import torch

from kt_serve.kernel.decode_stack import DecodeStack, MoEBlock
from kt_serve.kernel.linear import PackedLinear
from kt_serve.kernel.experts import ExpertLoRA, MoEExperts
from moe_reference import moe_lora_reference
from test_kernel import ISAS

H, HQ, HKV, D, E, I, TOP_K, R = 64, 4, 2, 16, 8, 32, 2, 4
EPS = 1e-6


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rope_cache(max_position, rotary_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()


def rotate(x, pos, cache, rotary_dim, neox):  # x [heads, D] fp32
    half = rotary_dim // 2
    cos, sin = cache[pos, :half], cache[pos, half:]
    r, rest = x[:, :rotary_dim], x[:, rotary_dim:]
    if neox:
        a, b = r[:, :half], r[:, half:]
        r = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = r[:, 0::2], r[:, 1::2]
        r = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(1)
    return torch.cat([r, rest], dim=-1)


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float()


def make_layer(g):
    def w(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).bfloat16()

    lora_shapes = [(E, R, H), (E, I, R), (E, R, H), (E, I, R), (E, R, I), (E, H, R)]
    return dict(
        input_norm=(1 + 0.1 * torch.randn(H, generator=g)).bfloat16(),
        post_norm=(1 + 0.1 * torch.randn(H, generator=g)).bfloat16(),
        q_norm=(1 + 0.1 * torch.randn(D, generator=g)).bfloat16(),
        k_norm=(1 + 0.1 * torch.randn(D, generator=g)).bfloat16(),
        qkv=w((HQ + 2 * HKV) * D, H, scale=H ** -0.5), o=w(H, HQ * D, scale=(HQ * D) ** -0.5),
        router=w(E, H, scale=4 * H ** -0.5),  # logits of std ~4: top-k margins well above bf16 rounding
        gate=w(E, I, H, scale=H ** -0.5), up=w(E, I, H, scale=H ** -0.5), down=w(E, H, I, scale=I ** -0.5),
        lora=[w(*s, scale=0.3) for s in lora_shapes])


def dense_lora(x, lora, adapter, ranks, scalings):
    """fp32 LoRA of one projection in SGLang's buffer layout for rows x, row t using adapter[t] (-1: none)."""
    a, b, off = lora
    out = torch.zeros(x.shape[0], off[-1])
    for t, ad in enumerate(adapter.tolist()):
        r = int(ranks[ad]) if ad >= 0 else 0
        for s in range(len(off) - 1):
            if r:
                shrunk = scalings[ad] * (x[t] @ a[ad, s * r:(s + 1) * r].float().T)  # slices of r rows each
                out[t, off[s]:off[s + 1]] = shrunk @ b[ad, off[s]:off[s + 1], :r].float().T
    return out


def reference(layers, final_norm, x, positions, k_cache, v_cache, req_to_token, idx, lens, loc, slots, cache,
              rotary_dim, neox, dense=None):
    """fp32: the final hidden rows, each layer's new K and V rows, and the smallest top-k routing margin. dense:
    (per layer {"qkv": (A, B, offsets), "o": ...}, adapter per request, ranks, scalings) for the dense LoRA."""
    k_cache, v_cache = k_cache.clone().float(), v_cache.clone().float()  # [layers, slots, Hkv, D]
    residual, hidden = x.float(), None
    new_kv, margin = [], math.inf
    scale = D ** -0.5
    for li, L in enumerate(layers):
        if hidden is not None:
            residual = residual + hidden
        h = rms(residual, L["input_norm"])
        qkv = h @ L["qkv"].float().T
        if dense is not None:
            qkv = qkv + dense_lora(h, dense[0][li]["qkv"], *dense[1:])
        q = qkv[:, :HQ * D].reshape(-1, HQ, D)
        k = qkv[:, HQ * D:(HQ + HKV) * D].reshape(-1, HKV, D)
        v = qkv[:, (HQ + HKV) * D:].reshape(-1, HKV, D)
        q, k = rms(q, L["q_norm"]), rms(k, L["k_norm"])
        q = torch.stack([rotate(q[b], positions[b], cache, rotary_dim, neox) for b in range(len(q))])
        k = torch.stack([rotate(k[b], positions[b], cache, rotary_dim, neox) for b in range(len(k))])
        k_cache[li, loc], v_cache[li, loc] = k, v
        new_kv.append((k, v))
        attn = torch.zeros(len(q), HQ, D)
        for b in range(len(q)):
            s = req_to_token[idx[b], :lens[b]].long()
            K = k_cache[li, s].repeat_interleave(HQ // HKV, dim=1)
            V = v_cache[li, s].repeat_interleave(HQ // HKV, dim=1)
            p = (torch.einsum("hd,nhd->hn", q[b], K) * scale).softmax(-1)
            attn[b] = torch.einsum("hn,nhd->hd", p, V)
        o = attn.reshape(len(q), -1) @ L["o"].float().T
        if dense is not None:
            o = o + dense_lora(attn.reshape(len(q), -1), dense[0][li]["o"], *dense[1:])
        residual = residual + o
        h = rms(residual, L["post_norm"])
        logits = h @ L["router"].float().T
        top = logits.topk(TOP_K + 1, dim=-1)
        margin = min(margin, (top.values[:, TOP_K - 1] - top.values[:, TOP_K]).min().item())
        w = torch.gather(logits.softmax(-1), 1, top.indices[:, :TOP_K])
        w = w / w.sum(-1, keepdim=True)
        lora = dict(zip(["gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b"],
                        [t.float() for t in L["lora"]]), alpha=8.0)
        hidden = moe_lora_reference(h, top.indices[:, :TOP_K], w, L["gate"], L["up"], L["down"], slots=slots,
                                    loras={0: lora})
    return rms(residual + hidden, final_norm), new_kv, margin


def build(layers, final_norm, k_cache, v_cache, cache, rotary_dim, neox, isa):
    stack = DecodeStack(H, final_norm, EPS, isa=isa)
    for li, L in enumerate(layers):
        experts = MoEExperts(L["gate"], L["up"], L["down"], max_tokens=16, max_slots=1, isa=isa)
        experts.set_adapter(0, ExpertLoRA(*L["lora"], alpha=8.0))
        stack.add_attention_layer(input_norm=L["input_norm"], input_eps=EPS, qkv=PackedLinear(L["qkv"], isa=isa),
                                  q_heads=HQ, kv_heads=HKV, head_dim=D, q_norm=L["q_norm"], q_eps=EPS,
                                  k_norm=L["k_norm"], k_eps=EPS, cos_sin=cache, rotary_dim=rotary_dim, neox=neox,
                                  k_cache=k_cache[li], v_cache=v_cache[li], scale=D ** -0.5,
                                  o_proj=PackedLinear(L["o"], isa=isa), post_norm=L["post_norm"], post_eps=EPS,
                                  moe=MoEBlock(PackedLinear(L["router"], isa=isa), experts, TOP_K, True))
    return stack


def batch(g, lengths, slots_in_pool=64, reqs=6):
    """Requests placed in random rows of req_to_token, their earlier tokens' K / V scattered over the pool, this
    step's token at a free slot (the last of each context)."""
    n_layers = 2
    k_cache = torch.randn(n_layers, slots_in_pool, HKV, D, generator=g).bfloat16()
    v_cache = torch.randn(n_layers, slots_in_pool, HKV, D, generator=g).bfloat16()
    req_to_token = torch.zeros(reqs, max(lengths) + 3, dtype=torch.int32)
    perm = torch.randperm(slots_in_pool, generator=g)
    idx = torch.randperm(reqs, generator=g)[:len(lengths)]
    at = 0
    for r, n in zip(idx.tolist(), lengths):
        req_to_token[r, :n] = perm[at:at + n].int()
        at += n
    lens = torch.tensor(lengths, dtype=torch.int64)
    loc = torch.stack([req_to_token[r, n - 1].long() for r, n in zip(idx.tolist(), lengths)])
    positions = lens - 1
    return k_cache, v_cache, req_to_token, idx.long().contiguous(), lens, loc.contiguous(), positions.contiguous()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rotary_dim,neox", [(D, True), (D // 2, False)])
def test_decode_step_matches_fp32_reference(isa, rotary_dim, neox):
    g = torch.Generator().manual_seed(11 + rotary_dim)
    layers = [make_layer(g) for _ in range(2)]
    final_norm = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    cache = rope_cache(64, rotary_dim)
    lengths = [5, 1, 12, 30]
    k_cache, v_cache, req_to_token, idx, lens, loc, positions = batch(g, lengths)
    x = torch.randn(len(lengths), H, generator=g).bfloat16()
    slots = torch.tensor([0, -1, 0, -1], dtype=torch.int32)
    ref, new_kv, margin = reference(layers, final_norm, x, positions, k_cache, v_cache, req_to_token, idx, lens,
                                    loc, slots, cache, rotary_dim, neox)
    assert margin > 0.05, "the test's premise: no routing near-tie that bf16 roundings could flip"
    before_k, before_v = k_cache.clone(), v_cache.clone()
    stack = build(layers, final_norm, k_cache, v_cache, cache, rotary_dim, neox, isa)
    out = stack.forward(x.clone(), positions, req_to_token, idx, lens, loc, slots=slots)
    assert rel_l2(out, ref) < 1e-2
    for li, (k, v) in enumerate(new_kv):  # the step's K (normed, rotated) and V rows stored at their slots
        assert rel_l2(k_cache[li, loc], k) < 1e-2 and rel_l2(v_cache[li, loc], v) < 1e-2
    others = torch.ones(k_cache.shape[1], dtype=torch.bool)
    others[loc] = False
    assert torch.equal(k_cache[:, others], before_k[:, others]) and torch.equal(v_cache[:, others], before_v[:, others])
    # the adapter matters: without it the adapted requests' outputs move well past the tolerance
    k_cache.copy_(before_k), v_cache.copy_(before_v)
    base = stack.forward(x.clone(), positions, req_to_token, idx, lens, loc, slots=-1)
    assert rel_l2(base[slots == 0], ref[slots == 0]) > 0.1
    assert rel_l2(base[slots == -1], ref[slots == -1]) < 1e-2


def test_bad_requests_are_refused_before_anything_is_written():
    g = torch.Generator().manual_seed(3)
    layers = [make_layer(g) for _ in range(2)]
    final_norm = torch.ones(H).bfloat16()
    cache = rope_cache(64, D)
    k_cache, v_cache, req_to_token, idx, lens, loc, positions = batch(g, [4, 9])
    stack = build(layers, final_norm, k_cache, v_cache, cache, D, True, "auto")
    before = k_cache.clone()
    x = torch.randn(2, H, generator=g).bfloat16()
    x0 = x.clone()
    too_long = lens.clone()
    too_long[1] = req_to_token.shape[1] + 1
    with pytest.raises(ValueError, match=r"request 1 \(row .*, length .*\) outside req_to_token"):
        stack.forward(x, positions, req_to_token, idx, too_long, loc, slots=-1)
    bad_row = idx.clone()
    bad_row[0] = req_to_token.shape[0]
    with pytest.raises(ValueError, match="request 0"):
        stack.forward(x, positions, req_to_token, bad_row, lens, loc, slots=-1)
    bad_loc = loc.clone()
    bad_loc[1] = k_cache.shape[1]
    with pytest.raises(IndexError, match="cache slot 64 of request 1 is outside the pool's 64 slots"):
        stack.forward(x, positions, req_to_token, idx, lens, bad_loc, slots=-1)
    assert torch.equal(k_cache, before) and torch.equal(x, x0)
    with pytest.raises(ValueError, match="positions must be a contiguous CPU torch.int64 tensor"):
        stack.forward(x, positions.int(), req_to_token, idx, lens, loc, slots=-1)


def test_a_layer_of_other_shapes_is_refused_naming_the_part():
    g = torch.Generator().manual_seed(5)
    L = make_layer(g)
    cache = rope_cache(64, D)
    stack = DecodeStack(H, torch.ones(H).bfloat16(), EPS)
    k_cache = torch.zeros(8, HKV, D).bfloat16()
    experts = MoEExperts(L["gate"], L["up"], L["down"], max_tokens=16)
    moe = MoEBlock(PackedLinear(L["router"]), experts, TOP_K, True)
    args = dict(input_norm=L["input_norm"], input_eps=EPS, q_heads=HQ, kv_heads=HKV, head_dim=D, q_norm=L["q_norm"],
                q_eps=EPS, k_norm=L["k_norm"], k_eps=EPS, cos_sin=cache, rotary_dim=D, neox=True, k_cache=k_cache,
                v_cache=k_cache.clone(), scale=1.0, o_proj=PackedLinear(L["o"]), post_norm=L["post_norm"],
                post_eps=EPS, moe=moe)
    with pytest.raises(ValueError, match="layer 0: qkv projection is not"):
        stack.add_attention_layer(qkv=PackedLinear(L["qkv"][:-D]), **args)
    with pytest.raises(ValueError, match="layer 0: qkv projection is not"):  # no room for the output gate
        stack.add_attention_layer(qkv=PackedLinear(L["qkv"]), output_gate=True, **args)
    with pytest.raises(ValueError, match="router gate is not"):
        stack.add_attention_layer(qkv=PackedLinear(L["qkv"]),
                                  **{**args, "moe": MoEBlock(PackedLinear(L["router"][:-1]), experts, TOP_K, True)})
    with pytest.raises(ValueError, match=r"k_cache must be a CPU bf16 tensor \[slots, 2, 16\]"):
        stack.add_attention_layer(qkv=PackedLinear(L["qkv"]),
                                  **{**args, "k_cache": torch.zeros(8, HKV, D + 1).bfloat16()})
    stack.add_attention_layer(qkv=PackedLinear(L["qkv"]), **args)
    assert stack.num_layers == 1


def test_dense_lora_of_sglangs_segments_on_qkv_and_o():
    """SGLang's LoRA batch (segments of requests sharing an adapter, per-adapter rank and scaling, q/k/v as three
    slices of one buffer) applied to each layer's projections inside the step, as its LoRA wrappers add it."""
    g = torch.Generator().manual_seed(23)
    layers = [make_layer(g) for _ in range(2)]
    final_norm = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    cache = rope_cache(64, D)
    lengths = [5, 9, 12, 3, 7]
    k_cache, v_cache, req_to_token, idx, lens, loc, positions = batch(g, lengths)
    x = torch.randn(len(lengths), H, generator=g).bfloat16()
    max_rank, adapters = 8, 3
    qkv_off = [0, HQ * D, (HQ + HKV) * D, (HQ + 2 * HKV) * D]

    def buffers(slices, k, n):
        return ((torch.randn(adapters, slices * max_rank, k, generator=g) * 0.3).bfloat16(),
                (torch.randn(adapters, n, max_rank, generator=g) * 0.3).bfloat16())
    per_layer = [{"qkv": (*buffers(3, H, qkv_off[-1]), qkv_off), "o": (*buffers(1, HQ * D, H), [0, H])}
                 for _ in layers]
    # segments: requests 0-1 adapter 2 (rank 8), request 2 adapter 0 (rank 0: none), 3-4 adapter 1 (rank 4)
    seg_lens = torch.tensor([2, 1, 2], dtype=torch.int32)
    weight_indices = torch.tensor([2, 0, 1], dtype=torch.int32)
    ranks = torch.tensor([0, 4, 8], dtype=torch.int32)
    scalings = torch.tensor([1.0, 2.0, 0.5])
    adapter = torch.tensor([2, 2, 0, 1, 1])
    ref, _, margin = reference(layers, final_norm, x, positions, k_cache, v_cache, req_to_token, idx, lens, loc,
                               torch.full((5,), -1, dtype=torch.int32), cache, D, True,
                               dense=(per_layer, adapter, ranks, scalings))
    plain, _, margin_plain = reference(layers, final_norm, x, positions, k_cache, v_cache, req_to_token, idx, lens,
                                       loc, torch.full((5,), -1, dtype=torch.int32), cache, D, True)
    assert min(margin, margin_plain) > 0.05, "the test's premise: no routing near-tie"
    before_k, before_v = k_cache.clone(), v_cache.clone()
    stack = build(layers, final_norm, k_cache, v_cache, cache, D, True, "auto")
    for li, lo in enumerate(per_layer):
        stack.set_lora(li, "qkv", lo["qkv"])
        stack.set_lora(li, "o", lo["o"])
    out = stack.forward(x.clone(), positions, req_to_token, idx, lens, loc, slots=-1,
                            lora=(seg_lens, weight_indices, ranks, scalings))
    assert rel_l2(out, ref) < 1e-2
    with_lora = adapter != 0
    assert rel_l2(plain[with_lora], ref[with_lora]) > 0.1  # the LoRA moves the adapted requests well past it
    k_cache.copy_(before_k), v_cache.copy_(before_v)
    out_plain = stack.forward(x.clone(), positions, req_to_token, idx, lens, loc, slots=-1)  # no segments: no LoRA
    assert rel_l2(out_plain, plain) < 1e-2
    with pytest.raises(ValueError, match="layer 0 o LoRA: A holds 3 adapters, B 2"):
        stack.set_lora(0, "o", (per_layer[0]["o"][0], per_layer[0]["o"][1][:2], [0, H]))
    with pytest.raises(ValueError, match="o LoRA B rows must lie within the projection's output"):
        stack.set_lora(0, "o", (per_layer[0]["o"][0], per_layer[0]["o"][1], [0, H + 1]))
    with pytest.raises(ValueError, match="no projection out_proj in this layer"):
        stack.set_lora(0, "out_proj", per_layer[0]["o"])
