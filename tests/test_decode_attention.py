"""Decode attention over a paged KV cache (kt_serve/kernel/attention.py, csrc/ops/attention.cpp) against a plain fp32
torch reference: each request's slots gathered, K/V heads repeated for GQA, softmax(q Kᵀ · scale) V.

Every kernel table this CPU has runs. Tolerance 1e-2 absolute and relative: the output is rounded to bf16 (2⁻⁹
relative) while a wrong slot, head or a lost slice moves outputs by tenths.
"""

import pytest
import torch

from kt_serve.kernel.attention import decode_attention
from test_kernel import ISAS


def reference(q, k, v, req_to_token, idx, lens, scale):
    G = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2])
    for b in range(q.shape[0]):
        slots = req_to_token[idx[b], :lens[b]].long()
        K = k[slots].float().repeat_interleave(G, dim=1)  # [n, Hq, D]
        V = v[slots].float().repeat_interleave(G, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[b].float(), K) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", p, V)
    return out


def paged_cache(lengths, Hkv, D, Dv, *, slots=None, reqs=None, gen):
    """A pool with the requests' slots scattered at random (as after many allocations and frees), requests placed
    in random rows of req_to_token."""
    slots = slots or sum(lengths) + 17
    reqs = reqs or len(lengths) + 3
    k = torch.randn(slots, Hkv, D, generator=gen).bfloat16()
    v = torch.randn(slots, Hkv, Dv, generator=gen).bfloat16()
    width = max(lengths) + 5
    req_to_token = torch.zeros(reqs, width, dtype=torch.int32)
    perm = torch.randperm(slots, generator=gen).int()
    idx = torch.randperm(reqs, generator=gen)[:len(lengths)]
    at = 0
    for r, n in zip(idx.tolist(), lengths):
        req_to_token[r, :n] = perm[at:at + n]
        at += n
    return k, v, req_to_token, idx, torch.tensor(lengths)


CASES = [  # (lengths of the batch's requests, Hq, Hkv, D, Dv)
    ([1], 8, 8, 64, 64),                             # one token of context, MHA (GQA ratio 1)
    ([5, 1, 37, 200], 16, 8, 128, 128),              # ratio 2, requests of different lengths
    ([300, 17, 64], 32, 8, 96, 96),                  # ratio 4
    ([4096], 32, 4, 128, 128),                       # ratio 8 (Qwen3-30B-A3B), a 4k context split over threads
    ([1000, 3, 2500, 77, 640, 9, 1500, 31], 32, 4, 128, 128),  # a decode batch of 8
    ([129, 50], 7, 1, 33, 33),                       # MQA, odd head dim
    ([70, 700], 6, 2, 80, 48),                       # V head dim other than K's
    ([2049], 2, 1, 256, 256),                        # Qwen3.5's head dim
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("lengths,Hq,Hkv,D,Dv", CASES)
def test_matches_fp32_reference(isa, lengths, Hq, Hkv, D, Dv):
    gen = torch.Generator().manual_seed(len(lengths) * 1000 + D)
    k, v, req_to_token, idx, lens = paged_cache(lengths, Hkv, D, Dv, gen=gen)
    q = (2 * torch.randn(len(lengths), Hq, D, generator=gen)).bfloat16()  # sharp enough to make softmax peaky
    scale = D ** -0.5
    got = decode_attention(q, k, v, req_to_token, idx, lens, scale, isa=isa)
    torch.testing.assert_close(got.float(), reference(q, k, v, req_to_token, idx, lens, scale), atol=1e-2, rtol=1e-2)


def test_writes_into_a_strided_output_and_reads_strided_query_rows():
    gen = torch.Generator().manual_seed(7)
    k, v, req_to_token, idx, lens = paged_cache([40, 9], 2, 64, 64, gen=gen)
    qkv = torch.randn(2, 8 * 64 + 2 * 2 * 64, generator=gen).bfloat16()  # q as a view into a fused qkv row
    q = qkv[:, :8 * 64].view(2, 8, 64)
    out_rows = torch.full((2, 8 * 64 + 3), 7.0).bfloat16()
    out = out_rows[:, :8 * 64].view(2, 8, 64)
    decode_attention(q, k, v, req_to_token, idx, lens, 0.125, out)
    torch.testing.assert_close(out.float(), reference(q, k, v, req_to_token, idx, lens, 0.125), atol=1e-2, rtol=1e-2)
    assert (out_rows[:, 8 * 64:] == 7).all()  # nothing written past each row's output


@pytest.mark.parametrize("isa", ISAS)
def test_the_steps_own_rows_are_stored_at_their_slots_then_attended(isa):
    """The serving backend hands the step's K and V rows to the call (new_k, new_v, cache_loc) instead of SGLang's
    set_kv_buffer: each row lands at its slot bit for bit, no other slot changes, and the new token (the last of
    each request's context, as SGLang's req_to_token has it at decode) is attended to: the reference runs on a
    cache written by plain indexing. Rows come as views into a fused qkv output (strided, as in serving)."""
    gen = torch.Generator().manual_seed(5)
    lengths, Hq, Hkv, D = [1, 33, 400], 16, 4, 64
    k, v, req_to_token, idx, lens = paged_cache(lengths, Hkv, D, D, gen=gen)
    loc = torch.stack([req_to_token[r, n - 1].long() for r, n in zip(idx.tolist(), lengths)])
    qkv = torch.randn(len(lengths), (Hq + 2 * Hkv) * D, generator=gen).bfloat16()
    q = qkv[:, :Hq * D].view(-1, Hq, D)
    new_k = qkv[:, Hq * D:(Hq + Hkv) * D].view(-1, Hkv, D)
    new_v = qkv[:, (Hq + Hkv) * D:].view(-1, Hkv, D)
    want_k, want_v = k.clone(), v.clone()
    want_k[loc], want_v[loc] = new_k, new_v
    got = decode_attention(q, k, v, req_to_token, idx, lens, D ** -0.5, new_k=new_k, new_v=new_v, cache_loc=loc,
                           isa=isa)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    torch.testing.assert_close(got.float(), reference(q, want_k, want_v, req_to_token, idx, lens, D ** -0.5),
                               atol=1e-2, rtol=1e-2)


def test_a_slot_outside_the_pool_raises_and_stores_nothing():
    gen = torch.Generator().manual_seed(6)
    k, v, req_to_token, idx, lens = paged_cache([3, 5], 2, 16, 16, gen=gen)
    before_k, before_v = k.clone(), v.clone()
    rows = torch.randn(2, 2, 16, generator=gen).bfloat16()
    q = torch.randn(2, 4, 16, generator=gen).bfloat16()
    for bad in (k.shape[0], -1):
        with pytest.raises(IndexError, match=f"cache slot {bad} of request 1 is outside the pool's {k.shape[0]} slots"):
            decode_attention(q, k, v, req_to_token, idx, lens, 0.25, new_k=rows, new_v=rows,
                             cache_loc=torch.tensor([0, bad]))
        assert torch.equal(k, before_k) and torch.equal(v, before_v)
    with pytest.raises(ValueError, match="come together"):
        decode_attention(q, k, v, req_to_token, idx, lens, 0.25, new_k=rows)
    with pytest.raises(ValueError, match=r"cache_loc must be an int32 or int64 tensor \[2\], got list"):
        decode_attention(q, k, v, req_to_token, idx, lens, 0.25, new_k=rows, new_v=rows, cache_loc=[0, 1])
    with pytest.raises(ValueError, match=r"new_k \(2, 2, 16\) and new_v \(2, 2, 8\) must be"):
        decode_attention(q, k, v, req_to_token, idx, lens, 0.25, new_k=rows, new_v=rows[..., :8],
                         cache_loc=torch.tensor([0, 1]))
    assert torch.equal(k, before_k) and torch.equal(v, before_v)


def test_bad_input_is_refused_with_the_field_named():
    gen = torch.Generator().manual_seed(1)
    k, v, req_to_token, idx, lens = paged_cache([4], 2, 16, 16, gen=gen)
    q = torch.randn(1, 3, 16).bfloat16()
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(q, k, v, req_to_token, idx, lens, 0.25)
    with pytest.raises(ValueError, match="k_cache must be a CPU torch.bfloat16"):
        decode_attention(q[:, :2], k.float(), v, req_to_token, idx, lens, 0.25)
    with pytest.raises(ValueError, match="out of req_to_token"):
        decode_attention(q[:, :2], k, v, req_to_token, idx, lens + 100, 0.25)


@pytest.mark.parametrize("isa", ISAS)
def test_a_request_gets_the_same_bits_whatever_it_is_batched_with(isa):
    """Greedy serving must not depend on batching: the context slices the work is split into follow each request's
    own length, so its output is bit-identical alone (one short request: the calling thread only) and in a batch
    (threads, other requests' slices)."""
    gen = torch.Generator().manual_seed(11)
    lengths = [45, 3000, 700, 1, 129]
    k, v, req_to_token, idx, lens = paged_cache(lengths, 4, 128, 128, gen=gen)
    q = torch.randn(len(lengths), 32, 128, generator=gen).bfloat16()
    together = decode_attention(q, k, v, req_to_token, idx, lens, 128 ** -0.5, isa=isa)
    for b in range(len(lengths)):
        alone = decode_attention(q[b:b + 1], k, v, req_to_token, idx[b:b + 1], lens[b:b + 1], 128 ** -0.5, isa=isa)
        assert torch.equal(alone[0], together[b]), b


def test_an_mla_model_is_refused_with_the_backend_to_use():
    """kt_cpu reads per-head K/V pools; an MLA latent cache would be misread, so the backend refuses it at start."""
    from types import SimpleNamespace

    from kt_serve.sglang_plugin.cpu_host.attention import create_backend

    with pytest.raises(ValueError, match="MLA latent cache is served with --attention-backend torch_native"):
        create_backend(SimpleNamespace(use_mla_backend=True))
