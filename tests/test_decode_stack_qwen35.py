"""Qwen3.5-MoE decode steps in one call (kt_serve/kernel/decode_stack.py: Gated DeltaNet and gated-attention layers,
Gemma norms, the gated shared expert) against a plain fp32 torch reference written from the math, over three steps:
Gemma RMSNorm (1 + w) with the residual stream; the Gated DeltaNet's in_proj_qkvz / in_proj_ba, causal conv with
SiLU on the request's conv state, l2-normalised q / k, gates g = -e^A_log softplus(a + dt_bias) and beta =
sigmoid(b), the delta rule on the request's recurrent state, gated RMSNorm with SiLU(z), out_proj; the attention
layer's per-head [q | gate] rows, Gemma q / k norms, partial neox rotary, paged attention, sigmoid(gate) on its
output, o_proj; softmax top-k experts with per-request expert LoRA plus the shared SwiGLU expert times
sigmoid(x · shared_expert_gate); SGLang's segmented LoRA on every projection, requests on different adapters mixed.

The states carried between steps are the check that matters: each step's conv window and recurrent state feed the
next, so a state written to the wrong slot, shifted the wrong way or decayed twice moves the third step's output by
tenths (TOL below says why the tolerance is what it is). The recurrent states themselves match to 0.4%.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kt_serve.kernel.decode_stack import DecodeStack, MoEBlock
from kt_serve.kernel.experts import ExpertLoRA, MoEExperts
from kt_serve.kernel.linear import PackedLinear
from moe_reference import moe_lora_reference
from test_decode_stack import dense_lora, rel_l2, rope_cache, rotate
from test_kernel import ISAS

H, E, I, TOP_K, SHARED_I, R = 64, 8, 32, 2, 48, 4
HK, HV, DK, DV, CONV_K = 2, 4, 16, 16, 4  # Gated DeltaNet
HQ, HKV, D, ROT = 4, 2, 16, 8  # gated attention, partial rotary
EPS = 1e-6
KEY, VALUE = HK * DK, HV * DV
CONV_DIM = 2 * KEY + VALUE
KINDS = ["gdn", "attention"]
STATE_SLOTS, KV_SLOTS = 7, 96
# rel-L2 per step (measured 0.6-2%): the kernel rounds every intermediate to bf16 as SGLang does, and this tiny random
# model amplifies that: moving the inputs by 0.2% moves its outputs by 1-5% (routing weights, gated norms of small
# values). A wrong state slot, a state not carried or a lost adapter moves them by tenths.
TOL = 3e-2


def w(g, *shape, scale):
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def make_layer(g, kind):
    L = dict(kind=kind, input_norm=0.1 * torch.randn(H, generator=g), post_norm=0.1 * torch.randn(H, generator=g),
             router=w(g, E, H, scale=H ** -0.5), gate=w(g, E, I, H, scale=H ** -0.5),
             up=w(g, E, I, H, scale=H ** -0.5), down=w(g, E, H, I, scale=I ** -0.5),
             expert_lora=[w(g, *s, scale=0.3) for s in [(E, R, H), (E, I, R), (E, R, H), (E, I, R), (E, R, I),
                                                         (E, H, R)]],
             shared_gate_up=w(g, 2 * SHARED_I, H, scale=H ** -0.5), shared_down=w(g, H, SHARED_I, scale=SHARED_I ** -0.5),
             shared_expert_gate=w(g, H, scale=H ** -0.5))
    if kind == "gdn":
        L.update(qkvz=w(g, CONV_DIM + VALUE, H, scale=H ** -0.5), ba=w(g, 2 * HV, H, scale=H ** -0.5),
                 out=w(g, H, VALUE, scale=VALUE ** -0.5), conv=w(g, CONV_DIM, CONV_K, scale=0.5),
                 A_log=torch.randn(HV, generator=g) * 0.5, dt_bias=(torch.randn(HV, generator=g) * 0.5).bfloat16(),
                 norm=1 + 0.1 * torch.randn(DV, generator=g))
    else:
        L.update(qkv=w(g, (2 * HQ + 2 * HKV) * D, H, scale=H ** -0.5), o=w(g, H, HQ * D, scale=(HQ * D) ** -0.5),
                 q_norm=0.1 * torch.randn(D, generator=g), k_norm=0.1 * torch.randn(D, generator=g))
    return L


def gemma(x, weight):  # fp32 x, Gemma's 1 + weight
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (1 + weight.float())


def l2(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def lora_offsets():
    return {"in_proj_qkvz": [0, KEY, 2 * KEY, CONV_DIM, CONV_DIM + VALUE], "out_proj": [0, H],
            "qkv": [0, 2 * HQ * D, (2 * HQ + HKV) * D, (2 * HQ + 2 * HKV) * D], "o": [0, H],
            "shared_gate_up": [0, SHARED_I, 2 * SHARED_I], "shared_down": [0, H]}


def make_lora(g, layers, adapters, max_rank):
    inputs = {"in_proj_qkvz": H, "out_proj": VALUE, "qkv": H, "o": HQ * D, "shared_gate_up": H,
              "shared_down": SHARED_I}
    out = []
    for L in layers:
        names = ["in_proj_qkvz", "out_proj"] if L["kind"] == "gdn" else ["qkv", "o"]
        per = {}
        for name in names + ["shared_gate_up", "shared_down"]:
            off = lora_offsets()[name]
            slices = len(off) - 1
            per[name] = (w(g, adapters, slices * max_rank, inputs[name], scale=0.3),
                         w(g, adapters, off[-1], max_rank, scale=0.3), off)
        out.append(per)
    return out


class Reference:
    """fp32 model state: per request its conv / recurrent states of every GDN layer and the attention cache."""

    def __init__(self, layers, final_norm, conv_states, ssm_states, k_cache, v_cache):
        self.layers, self.final_norm = layers, final_norm
        self.conv = conv_states.float().clone()  # [gdn layers, slots, CONV_DIM, K-1]
        self.ssm = ssm_states.clone()  # [gdn layers, slots, HV, DK, DV]
        self.k, self.v = k_cache.float().clone(), v_cache.float().clone()  # [attention layers, slots, HKV, D]
        self.margin = math.inf

    def step(self, x, positions, req_to_token, idx, lens, loc, state_slots, expert_slots, dense):
        def proj(li, name, weight, h):
            y = h @ weight.float().T
            if dense is not None:
                y = y + dense_lora(h, dense[0][li][name], *dense[1:])
            return y

        residual, hidden = x.float(), None
        gi = ai = 0
        B = x.shape[0]
        for li, L in enumerate(self.layers):
            if hidden is not None:
                residual = residual + hidden
            h = gemma(residual, L["input_norm"])
            if L["kind"] == "gdn":
                qkvz, ba = proj(li, "in_proj_qkvz", L["qkvz"], h), h @ L["ba"].float().T
                mixed = torch.zeros(B, VALUE)
                for b in range(B):
                    s = int(state_slots[b])
                    window = torch.cat([self.conv[gi, s], qkvz[b, :CONV_DIM, None]], dim=1)  # [C, K]
                    conv = F.silu((window * L["conv"].float()).sum(-1))
                    self.conv[gi, s] = window[:, 1:]
                    q = l2(conv[:KEY].view(HK, DK)) * DK ** -0.5
                    k = l2(conv[KEY:2 * KEY].view(HK, DK))
                    v = conv[2 * KEY:].view(HV, DV)
                    q, k = q.repeat_interleave(HV // HK, 0), k.repeat_interleave(HV // HK, 0)
                    bb, a = ba[b, :HV], ba[b, HV:]
                    decay = torch.exp(-torch.exp(L["A_log"]) * F.softplus(a + L["dt_bias"].float()))
                    S = self.ssm[gi, s] * decay[:, None, None]  # [HV, DK, DV], S[k][v]
                    delta = torch.sigmoid(bb)[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
                    S = S + k[:, :, None] * delta[:, None, :]
                    self.ssm[gi, s] = S
                    o = torch.einsum("hkv,hk->hv", S, q)
                    z = qkvz[b, CONV_DIM:].view(HV, DV)
                    mixed[b] = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS) * L["norm"] * F.silu(z)).flatten()
                out = proj(li, "out_proj", L["out"], mixed)
                gi += 1
            else:
                qkv = proj(li, "qkv", L["qkv"], h)
                qg = qkv[:, :2 * HQ * D].view(B, HQ, 2, D)
                q, gate = gemma(qg[:, :, 0], L["q_norm"]), qg[:, :, 1]
                k = gemma(qkv[:, 2 * HQ * D:(2 * HQ + HKV) * D].view(B, HKV, D), L["k_norm"])
                v = qkv[:, (2 * HQ + HKV) * D:].view(B, HKV, D)
                q = torch.stack([rotate(q[b], positions[b], self.cos_sin, ROT, True) for b in range(B)])
                k = torch.stack([rotate(k[b], positions[b], self.cos_sin, ROT, True) for b in range(B)])
                self.k[ai, loc], self.v[ai, loc] = k, v
                attn = torch.zeros(B, HQ, D)
                for b in range(B):
                    s = req_to_token[idx[b], :lens[b]].long()
                    K = self.k[ai, s].repeat_interleave(HQ // HKV, dim=1)
                    V = self.v[ai, s].repeat_interleave(HQ // HKV, dim=1)
                    p = (torch.einsum("hd,nhd->hn", q[b], K) * D ** -0.5).softmax(-1)
                    attn[b] = torch.einsum("hn,nhd->hd", p, V)
                attn = (attn * torch.sigmoid(gate)).reshape(B, -1)
                out = proj(li, "o", L["o"], attn)
                ai += 1
            residual = residual + out
            h = gemma(residual, L["post_norm"])
            logits = h @ L["router"].float().T
            top = logits.topk(TOP_K + 1, dim=-1)
            self.margin = min(self.margin, (top.values[:, TOP_K - 1] - top.values[:, TOP_K]).min().item())
            wts = torch.gather(logits.softmax(-1), 1, top.indices[:, :TOP_K])
            wts = wts / wts.sum(-1, keepdim=True)
            lora = dict(zip(["gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b"],
                            [t.float() for t in L["expert_lora"]]), alpha=8.0)
            routed = moe_lora_reference(h, top.indices[:, :TOP_K], wts, L["gate"], L["up"], L["down"],
                                        slots=expert_slots, loras={0: lora})
            gu = proj(li, "shared_gate_up", L["shared_gate_up"], h)
            shared = proj(li, "shared_down", L["shared_down"], F.silu(gu[:, :SHARED_I]) * gu[:, SHARED_I:])
            hidden = routed + torch.sigmoid(h @ L["shared_expert_gate"].float())[:, None] * shared
        return gemma(residual + hidden, self.final_norm)


def build(layers, final_norm, conv_states, ssm_states, k_cache, v_cache, cos_sin, isa, dense=None):
    stack = DecodeStack(H, 1 + final_norm.float(), EPS, isa=isa)
    gi = ai = 0
    for li, L in enumerate(layers):
        experts = MoEExperts(L["gate"], L["up"], L["down"], max_tokens=16, max_slots=1, isa=isa)
        experts.set_adapter(0, ExpertLoRA(*L["expert_lora"], alpha=8.0))
        moe = MoEBlock(PackedLinear(L["router"], isa=isa), experts, TOP_K, True,
                       PackedLinear(L["shared_gate_up"], isa=isa), PackedLinear(L["shared_down"], isa=isa),
                       L["shared_expert_gate"])
        norms = dict(input_norm=1 + L["input_norm"].float(), input_eps=EPS, post_norm=1 + L["post_norm"].float(),
                     post_eps=EPS)
        if L["kind"] == "gdn":
            stack.add_gdn_layer(**norms, in_proj_qkvz=PackedLinear(L["qkvz"], isa=isa),
                                in_proj_ba=PackedLinear(L["ba"], isa=isa), out_proj=PackedLinear(L["out"], isa=isa),
                                key_heads=HK, value_heads=HV, key_dim=DK, value_dim=DV, conv_weight=L["conv"],
                                conv_bias=None, conv_silu=True, conv_states=conv_states[gi], ssm_states=ssm_states[gi],
                                A_log=L["A_log"], dt_bias=L["dt_bias"], norm_weight=L["norm"],
                                norm_eps=EPS, sigmoid_gate=False, moe=moe)
            gi += 1
        else:
            stack.add_attention_layer(**norms, qkv=PackedLinear(L["qkv"], isa=isa), o_proj=PackedLinear(L["o"], isa=isa),
                                      q_heads=HQ, kv_heads=HKV, head_dim=D, output_gate=True,
                                      q_norm=1 + L["q_norm"].float(), q_eps=EPS, k_norm=1 + L["k_norm"].float(),
                                      k_eps=EPS, cos_sin=cos_sin, rotary_dim=ROT, neox=True, k_cache=k_cache[ai],
                                      v_cache=v_cache[ai], scale=D ** -0.5, moe=moe)
            ai += 1
        if dense is not None:
            for name, lora in dense[li].items():
                stack.set_lora(li, name, lora)
    return stack


def setup(g, lengths):
    n_gdn, n_attn = KINDS.count("gdn"), KINDS.count("attention")
    conv_states = (torch.randn(n_gdn, STATE_SLOTS, CONV_DIM, CONV_K - 1, generator=g) * 0.5).bfloat16()
    ssm_states = torch.randn(n_gdn, STATE_SLOTS, HV, DK, DV, generator=g) * 0.1
    k_cache = torch.randn(n_attn, KV_SLOTS, HKV, D, generator=g).bfloat16()
    v_cache = torch.randn(n_attn, KV_SLOTS, HKV, D, generator=g).bfloat16()
    reqs, steps = len(lengths) + 2, 3
    req_to_token = torch.zeros(reqs, max(lengths) + steps, dtype=torch.int32)
    perm = torch.randperm(KV_SLOTS, generator=g)
    idx = torch.randperm(reqs, generator=g)[:len(lengths)]
    at = 0
    for r, n in zip(idx.tolist(), lengths):
        req_to_token[r, :n + steps] = perm[at:at + n + steps].int()
        at += n + steps
    state_slots = torch.randperm(STATE_SLOTS, generator=g)[:len(lengths)].int()
    return conv_states, ssm_states, k_cache, v_cache, req_to_token, idx.long(), state_slots


def run_steps(g, isa, dense_lora_args=None):
    layers = [make_layer(g, kind) for kind in KINDS]
    final_norm = 0.1 * torch.randn(H, generator=g)
    lengths = [3, 1, 11, 6]
    conv_states, ssm_states, k_cache, v_cache, req_to_token, idx, state_slots = setup(g, lengths)
    cos_sin = rope_cache(64, ROT)
    per_layer = make_lora(g, layers, adapters=3, max_rank=8)  # drawn either way: the same inputs with and without
    dense = None if dense_lora_args is None else (per_layer, *dense_lora_args[:3])
    ref = Reference(layers, final_norm, conv_states, ssm_states, k_cache, v_cache)
    ref.cos_sin = cos_sin
    stack = build(layers, final_norm, conv_states, ssm_states, k_cache, v_cache, cos_sin, isa,
                  None if dense is None else dense[0])
    expert_slots = torch.tensor([0, -1, 0, -1], dtype=torch.int32)
    results = []
    for step in range(3):
        lens = torch.tensor(lengths, dtype=torch.int64) + step
        positions = (lens - 1).contiguous()
        loc = torch.stack([req_to_token[r, n - 1].long() for r, n in zip(idx.tolist(), lens.tolist())])
        x = torch.randn(len(lengths), H, generator=g).bfloat16()
        want = ref.step(x, positions, req_to_token, idx, lens, loc, state_slots, expert_slots,
                        None if dense is None else dense)
        got = stack.forward(x.clone(), positions, req_to_token, idx.contiguous(), lens, loc.contiguous(),
                            state_slots, expert_slots, None if dense is None else dense_lora_args[3])
        results.append((got.clone(), want))
    return results, ref, (conv_states, ssm_states, k_cache, v_cache, state_slots)


@pytest.mark.parametrize("isa", ISAS)
def test_three_decode_steps_carry_gdn_states_as_the_reference(isa):
    results, ref, (conv_states, ssm_states, _, _, state_slots) = run_steps(torch.Generator().manual_seed(2), isa)
    assert ref.margin > 0.02, "the test's premise: no routing near-tie that bf16 roundings could flip"
    for got, want in results:
        assert rel_l2(got, want) < TOL
    # the states the stack left in the pools are the reference's (the conv window holds bf16 inputs)
    slots = state_slots.long()
    assert rel_l2(ssm_states[:, slots], ref.ssm[:, slots]) < TOL
    assert rel_l2(conv_states[:, slots], ref.conv[:, slots]) < TOL
    others = torch.ones(STATE_SLOTS, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(ssm_states[:, others], ref.ssm[:, others])  # no other request's state was touched


def test_sglang_lora_on_every_projection_mixed_in_one_batch():
    """Segments: request 0 on adapter 2 (rank 8), 1 on adapter 0 (rank 0: none), 2-3 on adapter 1 (rank 4)."""
    segments = (torch.tensor([1, 1, 2], dtype=torch.int32), torch.tensor([2, 0, 1], dtype=torch.int32),
                torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([1.0, 2.0, 0.5]))
    adapter = torch.tensor([2, 0, 1, 1])
    args = (adapter, segments[2], segments[3], segments)
    results, ref, _ = run_steps(torch.Generator().manual_seed(8), "auto", args)
    assert ref.margin > 0.02, "the test's premise: no routing near-tie"
    for got, want in results:
        assert rel_l2(got, want) < TOL
    plain, _, _ = run_steps(torch.Generator().manual_seed(8), "auto")  # the same weights, inputs, states
    with_lora = adapter != 0
    for (got, _), (base, _) in zip(results, plain):
        assert rel_l2(base[with_lora], got[with_lora]) > 0.1  # the LoRA matters on the adapted requests
        assert rel_l2(base[~with_lora], got[~with_lora]) < TOL


def test_a_state_slot_outside_the_pools_is_refused_before_anything_is_written():
    g = torch.Generator().manual_seed(3)
    layers = [make_layer(g, kind) for kind in KINDS]
    conv_states, ssm_states, k_cache, v_cache, req_to_token, idx, state_slots = setup(g, [4, 2])
    stack = build(layers, torch.zeros(H), conv_states, ssm_states, k_cache, v_cache, rope_cache(64, ROT), "auto")
    before = [t.clone() for t in (conv_states, ssm_states, k_cache)]
    lens = torch.tensor([4, 2])
    loc = torch.stack([req_to_token[r, n - 1].long() for r, n in zip(idx.tolist(), lens.tolist())])
    x = torch.randn(2, H, generator=g).bfloat16()
    bad = state_slots.clone()
    bad[1] = STATE_SLOTS
    with pytest.raises(ValueError, match=f"request 1's state slot {STATE_SLOTS} is outside the GDN state pools"):
        stack.forward(x, lens - 1, req_to_token, idx, lens, loc, bad, -1)
    with pytest.raises(ValueError, match="needs each request's state_slots"):
        stack.forward(x, lens - 1, req_to_token, idx, lens, loc, None, -1)
    assert all(torch.equal(a, b) for a, b in zip(before, (conv_states, ssm_states, k_cache)))


def test_elementwise_steps_match_their_fp32_formulas():
    """The activation ops both the stack and SGLang's layer loop (through the plugin's hooks) run, with SGLang's
    roundings (the gate's dot product at most one bf16 step apart: its fp32 sum runs in another order)."""
    from kt_serve.kernel.activation import shared_expert_gate_add, sigmoid_mul, silu_mul

    g = torch.Generator().manual_seed(9)
    x, gate = torch.randn(5, 48, generator=g).bfloat16(), torch.randn(5, 48, generator=g).bfloat16()
    want = (x.float() * torch.sigmoid(gate.float())).bfloat16()
    assert torch.equal(sigmoid_mul(x.clone(), gate), want)
    gu = torch.randn(5, 2 * 24, generator=g).bfloat16()
    want = (F.silu(gu[:, :24].float()).bfloat16().float() * gu[:, 24:].float()).bfloat16()  # SGLang's roundings
    assert torch.equal(silu_mul(gu), want)
    h, w_gate = torch.randn(5, 48, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    shared, out = torch.randn(5, 48, generator=g).bfloat16(), torch.randn(5, 48, generator=g).bfloat16()
    delta = torch.randn(5, generator=g)
    sig = torch.sigmoid(h.float() @ w_gate.float() + delta)[:, None]
    want = (out.float() + (sig * shared.float()).bfloat16().float()).bfloat16()
    got = out.clone()
    assert shared_expert_gate_add(h, w_gate, shared, got, delta)
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7
