"""Segmented LoRA (csrc/ops/lora_segments.cpp, kt_serve/kernel/lora_segments.py) against an fp32 per-segment loop in
plain torch, and against SGLang's torch_native ops (sglang.srt.lora.torch_ops.lora_ops), whose semantics it takes
over."""

import pytest
import torch

from kt_serve import _kernel
from kt_serve.kernel.lora_segments import lora_expand, lora_shrink

ISAS = (["portable"] + (["avx2"] if _kernel.has_avx2() else [])
        + (["avx512_bf16"] if _kernel.has_avx512_bf16() else []))


def batch(seed, seg_lens, weight_indices, ranks, K=96, slices=3, max_rank=8, outs=(40, 24, 24)):
    g = torch.Generator().manual_seed(seed)
    A = len(ranks)
    return dict(
        x=torch.randn(sum(seg_lens), K, generator=g).bfloat16(),
        wa=(torch.randn(A, slices * max_rank, K, generator=g) * 0.1).bfloat16(),
        wb=(torch.randn(A, sum(outs), max_rank, generator=g) * 0.1).bfloat16(),
        base=torch.randn(sum(seg_lens), sum(outs), generator=g).bfloat16(),
        seg_lens=torch.tensor(seg_lens, dtype=torch.int32), weight_indices=torch.tensor(weight_indices, dtype=torch.int32),
        ranks=torch.tensor(ranks, dtype=torch.int32), scalings=torch.tensor([0.5 + a for a in range(A)]),
        off=torch.tensor([0, *torch.tensor(outs).cumsum(0).tolist()]), slices=slices)


def reference(b):
    """fp32: each segment's tokens through its adapter's A (the first slices·r rows) and, slice by slice, its B."""
    x, out = b["x"].float(), b["base"].float().clone()
    shrink = torch.zeros(x.shape[0], b["wa"].shape[1])
    t = 0
    for n, a in zip(b["seg_lens"].tolist(), b["weight_indices"].tolist()):
        r, s = int(b["ranks"][a]), float(b["scalings"][a])
        if r:
            shrink[t:t + n, :b["slices"] * r] = s * x[t:t + n] @ b["wa"][a, :b["slices"] * r].float().T
            for i in range(b["slices"]):
                lo, hi = int(b["off"][i]), int(b["off"][i + 1])
                out[t:t + n, lo:hi] += shrink[t:t + n, i * r:(i + 1) * r].bfloat16().float() @ \
                    b["wb"][a, lo:hi, :r].float().T
        t += n
    return shrink, out


CASES = [  # (segment lengths, adapter of each, ranks per adapter)
    ([1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 2, 1, 0, 2, 2, 1], [8, 8, 8]),   # decode, mixed adapters
    ([3, 40, 1], [1, 0, 1], [0, 8, 8]),                                # prefill chunks, one base segment (rank 0)
    ([5, 7], [0, 1], [4, 8]),                                          # a lower-rank adapter in a rank-8 pool
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES)
def test_shrink_and_expand_match_fp32_reference(isa, case):
    b = batch(len(case[0]), *case)
    a = lora_shrink(b["x"], b["wa"], b["seg_lens"], b["weight_indices"], b["ranks"], b["scalings"], b["slices"], isa)
    y = lora_expand(a, b["wb"], b["seg_lens"], b["weight_indices"], b["ranks"], b["off"], b["base"].clone(), isa)
    want_a, want_y = reference(b)
    torch.testing.assert_close(a.float(), want_a, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y.float(), want_y, rtol=1e-2, atol=2e-2)
    assert (y.float() - b["base"].float()).abs().max() > 0.1  # the LoRA moved the outputs well past the tolerance


@pytest.mark.parametrize("case", CASES)
def test_matches_sglangs_torch_native_ops(case):
    from sglang.srt.lora.torch_ops.lora_ops import sgemm_lora_a_fwd, sgemm_lora_b_fwd

    b = batch(7, *case)
    args = (b["weight_indices"], b["seg_lens"], b["ranks"])
    want_a = sgemm_lora_a_fwd(b["x"], b["wa"], *args, b["scalings"], b["slices"])
    want_y = sgemm_lora_b_fwd(want_a, b["wb"], *args, b["off"], b["base"].clone())
    a = lora_shrink(b["x"], b["wa"], b["seg_lens"], b["weight_indices"], b["ranks"], b["scalings"], b["slices"])
    y = lora_expand(a, b["wb"], b["seg_lens"], b["weight_indices"], b["ranks"], b["off"], b["base"].clone())
    torch.testing.assert_close(a, want_a, rtol=2 ** -7, atol=1e-3)  # one bf16 rounding apart at most
    torch.testing.assert_close(y, want_y, rtol=2 ** -7, atol=2e-2)


def test_bad_segments_are_refused_naming_the_field():
    b = batch(1, [2, 2], [0, 3], [8, 8])
    with pytest.raises(ValueError, match=r"weight_indices\[1\] = 3, expected 0..1"):
        lora_shrink(b["x"], b["wa"], b["seg_lens"], b["weight_indices"], b["ranks"], b["scalings"], 3)
    b = batch(1, [2, 2], [0, 1], [8, 16])
    with pytest.raises(ValueError, match=r"ranks\[1\] = 16, the weights hold rank 8"):
        lora_shrink(b["x"], b["wa"], b["seg_lens"], b["weight_indices"], b["ranks"], b["scalings"], 3)
    b = batch(1, [2, 2], [0, 1], [8, 8])
    with pytest.raises(ValueError, match="seg_lens add up to more than the 3 tokens"):
        lora_shrink(b["x"][:3], b["wa"], b["seg_lens"], b["weight_indices"], b["ranks"], b["scalings"], 3)
    with pytest.raises(ValueError, match="seg_lens must be a contiguous CPU torch.int32 vector"):
        lora_shrink(b["x"], b["wa"], b["seg_lens"].long(), b["weight_indices"], b["ranks"], b["scalings"], 3)
