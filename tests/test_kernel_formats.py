"""Quantized base-weight formats of the kernel (csrc/weights/weight_format.h) against independent torch references.

1. Quantization: ``MoEExperts(...).dequantized()`` against the rules of csrc/weights/packed_weights.cpp restated in
   plain torch by tests/quant_reference.py (int8 per row, int4 asymmetric per row and K group, fp8 per 64 rows × K group from bf16), and
   against ``w · scale`` of an FP8 checkpoint's e4m3 bytes and block scales. Exact (int4: one fp32 rounding).
2. Compute: forward and every gradient of each format on every kernel table (ISAS) against tests/moe_reference.py
   run on the dequantized weights, at the rel-L2 1e-2 of tests/test_kernel.py: decode (1-3 rows per expert, the
   register-decoding microkernels), a hot expert (> 16 rows: fp8 decoded to bf16 + the bf16 GEMM; int8 / int4 stay
   in registers but on AMX tables), T = 512, skipped
   ids, mixed adapter slots. The weights carry 1% spikes (12x) so that every quantized format moves the output
   by well over that tolerance (checked): a kernel computing with the unquantized weights fails.
3. The fp8 decoders: the AVX512-VBMI byte lookup and the shift decoder that KT_SERVE_AVX512_VBMI=0 forces give
   the same bits; subnormal e4m3 codes keep their value when the calling thread flushes fp32 denormals.
4. The ValueErrors of bad format arguments.
"""

import pytest
import torch

from kt_serve import _kernel
from kt_serve.formats.names import KT_TENSOR_NAMES
from kt_serve.kernel.experts import ExpertLoRA, MoEExperts
from kt_serve.kernel.threads import num_threads, set_num_threads
from kt_serve.train.expert_autograd import MoELoRAExperts
from moe_reference import moe_lora_reference
from quant_reference import FP8, ref_fp8, ref_int4, ref_int8, ref_quantize
from test_kernel import (ISAS, TOL, assert_backward_matches, make_lora, module_forward_backward, reference_grads,
                         rel_l2, routing)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The references are tiny: torch's intra-op threads only contend with the kernel's pool (on a loaded
    2-core machine that made this file ~30x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _ceil(a, b):
    return -(-a // b)


def expand_blocks(scale, bn, bk, N, K):
    """[.., ceil(N/bn), ceil(K/bk)] -> [.., N, K]: each element's block scale."""
    return scale.repeat_interleave(bn, dim=-2)[..., :N, :].repeat_interleave(bk, dim=-1)[..., :K]


def test_references_round_half_to_even_and_keep_flat_ranges():
    """The references themselves on hand-made values: ties to even, s = 1 for a flat range, padding excluded."""
    # int8: amax 127/128 gives s = 1/128 exactly, so v/s = 2.5, 3.5, -2.5, 0.5 are exact ties
    row = torch.tensor([[[127, 2.5, 3.5, -2.5, 0.5, -0.5, 1.5]]]) / 128
    assert torch.equal(ref_int8(row), torch.tensor([[[127, 2, 4, -2, 0, -0, 2]]]) / 128)
    assert torch.equal(ref_int8(torch.zeros(1, 1, 5)), torch.zeros(1, 1, 5))
    # int4: lo 0, hi 15/16 gives s = 1/16; a 2-value last group keeps its own range; a flat group is itself
    row = torch.tensor([[[0, 15, 2.5, 3.5, 1.5, 7, 7]]]) / 16
    got = ref_int4(row, 5)
    assert torch.equal(got[..., :5], torch.tensor([[[0, 15, 2, 4, 2]]]) / 16)
    assert torch.equal(got[..., 5:], row[..., 5:])
    # fp8: amax 7 gives s = 1/64; 1.0625 and 1.1875 are ties between e4m3 neighbours, 2^-10 and 3·2^-10 ties
    # around the subnormals 0, 2^-9, 2^-8; 300 lies between 288 and 320
    blk = torch.zeros(1, 2, 7)
    blk[0, 0, 0] = 7
    blk[0, 1] = torch.tensor([1.0625, 1.1875, -1.0625, 2**-10, 3 * 2**-10, 300, -448]) / 64
    got = ref_fp8(blk, 64)
    assert torch.equal(got[0, 0], blk[0, 0])
    assert torch.equal(got[0, 1], torch.tensor([1.0, 1.25, -1.0, 0, 2**-8, 288, -448]) / 64)


# ---------------------------------------------------------------------------------------------------------------
# Test weights


def make_weights(E, H, I, seed=0):
    """bf16 gate, up [E, I, H] and down [E, H, I]: gaussian (std 0.1) with 1% of the values 12x larger, so the
    quantization of every format changes the output by several times the tolerance."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*s):
        w = torch.randn(*s, generator=g) * 0.1
        return torch.where(torch.rand(*s, generator=g) < 0.01, 12 * w, w).to(torch.bfloat16)

    return rnd(E, I, H), rnd(E, I, H), rnd(E, H, I)


def with_edge_cases(w):
    """Hand-made rows on top of random bf16 weights [E, N, K] (E >= 3, N >= 2, K >= 128): exact rounding ties of
    each rule, a zero row, a zero fp8 block, a flat int4 group."""
    w = w.clone()
    K = w.shape[-1]
    # int8 ties (expert 0, row 1): amax 127/128 -> s = 1/128
    w[0, 1] = 0
    w[0, 1, :7] = torch.tensor([127, 2.5, 3.5, -2.5, 0.5, -0.5, 1.5]) / 128
    # int4 ties (expert 1, row 1, the first 128 K values = group 0 for group sizes 64 and 128): s = 1/16
    w[1, 1, :128] = 0
    w[1, 1, :6] = torch.tensor([0, 15, 2.5, 3.5, 1.5, 14.5]) / 16
    w[1, 1, 64:70] = torch.tensor([0, 15, 0.5, 4.5, 5.5, 13.5]) / 16
    # fp8 ties (expert 2, rows 0-63, K 0-127: one block for groups 64 and 128): amax 7 -> s = 1/64
    w[2, :64, :128] = w[2, :64, :128].clamp(-1, 1)
    w[2, 0, :2] = torch.tensor([7, -7])
    w[2, 0, 64:66] = torch.tensor([-7, 7])
    w[2, 1, :6] = torch.tensor([1.0625, 1.1875, -1.0625, 2**-10, 3 * 2**-10, -(2**-10)]) / 64
    w[2, 1, 64:70] = torch.tensor([1.0625, 1.1875, -1.0625, 2**-10, 3 * 2**-10, -(2**-10)]) / 64
    # a zero row; a zero 64 × 128 block; flat groups (int4 s = 1) in another row
    w[0, 0] = 0
    w[0, 64:128, 128:256] = 0
    w[1, 0, :64] = 0.375
    w[1, 0, 64:128] = -0.25
    assert K >= 128
    return w.to(torch.bfloat16)


def make_fp8_checkpoint(E, N, K, block, seed=0):
    """An FP8 checkpoint matrix: e4m3 [E, N, K] and fp32 scale_inv [E, ceil(N/bn), ceil(K/bk)]. Gaussian weights
    quantized per block, then 5% of the codes replaced by uniformly random non-NaN codes, so every code (both
    signs, the subnormals 0x01-0x07, the extremes ±448) occurs."""
    bn, bk = block
    g = torch.Generator().manual_seed(seed)
    scale = (torch.rand(E, _ceil(N, bn), _ceil(K, bk), generator=g) + 0.5) * 1e-3
    w = torch.randn(E, N, K, generator=g) * 0.1
    bits = (w / expand_blocks(scale, bn, bk, N, K)).clamp(-448, 448).to(FP8).view(torch.uint8).clone()
    mask = torch.rand(E, N, K, generator=g) < 0.05
    rnd = torch.randint(0, 256, (E, N, K), generator=g, dtype=torch.uint8)
    rnd = torch.where((rnd & 0x7F) == 0x7F, rnd - 1, rnd)  # 0x7f / 0xff are NaN
    bits = torch.where(mask, rnd, bits)
    return bits.view(FP8), scale


# ---------------------------------------------------------------------------------------------------------------
# 1. Quantization


@pytest.mark.parametrize("E,H,I", [(3, 300, 130), (3, 200, 130), (3, 136, 20)])
@pytest.mark.parametrize(
    "fmt,group",
    [("bf16", 128), ("int8", 128), ("int4", 64), ("int4", 128), ("int4", 192), ("int4", 512), ("fp8", 64), ("fp8", 128),
     ("fp8", 192)],
)
def test_dequantized_follows_the_quantization_rules(fmt, group, E, H, I):
    gate, up, down = make_weights(E, H, I, seed=1)
    gate, down = with_edge_cases(gate), with_edge_cases(down) if I >= 128 else down
    m = MoEExperts(gate, up, down, weight_format=fmt, group_size=group, isa="portable")
    assert m.weight_format == fmt
    d = m.dequantized()
    for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        ref = ref_quantize(w.float(), fmt, group)
        got = d[name]
        assert got.shape == w.shape and got.dtype == torch.float32
        if fmt == "int4":
            # W = q·s + lo: two fp32 roundings in either order (or one, fused): within an ulp of the larger term
            # (a code off by one is off by s, ~2^-4 of the group's range)
            torch.testing.assert_close(got, ref, rtol=2**-22, atol=2**-22 * w.float().abs().max().item(), msg=name)
        else:
            # one product of an exact code and an exact scale: bit for bit
            torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=name)
        if fmt != "bf16":
            assert rel_l2(got, w) > 1e-3, name  # it was quantized
    if fmt == "int8":
        assert torch.equal(d["gate_proj"][0, 1, :7], torch.tensor([127, 2, 4, -2, 0, 0, 2]) / 128)
    if fmt == "int4" and group in (64, 128):
        assert torch.equal(d["gate_proj"][1, 1, :6], torch.tensor([0, 15, 2, 4, 2, 14]) / 16)
    if fmt == "int4" and group == 64:
        assert torch.equal(d["gate_proj"][1, 0, :128], torch.tensor([0.375] * 64 + [-0.25] * 64))
    if fmt == "fp8":
        assert torch.equal(d["gate_proj"][2, 1, :6], torch.tensor([1.0, 1.25, -1.0, 0, 2**-8, 0]) / 64)
    assert torch.count_nonzero(d["gate_proj"][0, 0]) == 0
    if I >= 128 and H >= 256 and (fmt not in ("int4", "fp8") or group in (64, 128)):  # the zero block is its groups
        assert torch.count_nonzero(d["gate_proj"][0, 64:128, 128:256]) == 0


def test_quantization_is_per_expert_and_ignores_other_experts_ranges():
    """Scales are per expert: an expert of huge weights next to one of tiny weights leaves the tiny one as
    precise as alone."""
    E, H, I = 2, 96, 70
    gate, up, down = make_weights(E, H, I, seed=2)
    big = [t.clone() for t in (gate, up, down)]
    for t in big:
        t[1] *= 1000
    for fmt, group in (("int8", 128), ("int4", 64), ("fp8", 128)):
        alone = MoEExperts(gate[:1], up[:1], down[:1], weight_format=fmt, group_size=group).dequantized()
        mixed = MoEExperts(*big, weight_format=fmt, group_size=group).dequantized()
        for name in alone:
            assert torch.equal(mixed[name][:1], alone[name]), (fmt, name)


# FP8 checkpoints: e4m3 bytes and block scales


FP8_BLOCKS = [(128, 128), (64, 128), (48, 192)]


@pytest.mark.parametrize("block", FP8_BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_fp8_checkpoint_is_kept_exactly(block):
    E, H, I = 2, 300, 130  # neither a multiple of the blocks: partial edge blocks in both directions
    bn, bk = block
    (gw, gs), (uw, us), (dw, ds) = (make_fp8_checkpoint(E, n, k, block, seed=s)
                                    for s, (n, k) in enumerate([(I, H), (I, H), (H, I)]))
    assert gw.view(torch.uint8).unique().numel() == 254  # every non-NaN code, subnormals and negatives included
    m = MoEExperts(gw, uw, dw, gate_scale_inv=gs, up_scale_inv=us, down_scale_inv=ds, weight_block_size=list(block),
                   weight_format="fp8", group_size=64)  # group_size is the checkpoint's bk for fp8 as it is
    assert m.weight_format == "fp8"
    d = m.dequantized()
    # packed copies: the caller's tensors may be overwritten (or freed) afterwards
    given = [t.clone() for t in (gw, uw, dw, gs, us, ds)]
    for t in (gw, uw, dw, gs, us, ds):
        t.view(torch.uint8).fill_(0x38)  # e4m3 1.0; scales 0x38383838
    assert all(torch.equal(a, b) for a, b in zip(m.dequantized().values(), d.values()))
    gw, uw, dw, gs, us, ds = given
    for name, (w, s) in (("gate_proj", (gw, gs)), ("up_proj", (uw, us)), ("down_proj", (dw, ds))):
        N, K = w.shape[1:]
        ref = w.float() * expand_blocks(s, bn, bk, N, K)
        torch.testing.assert_close(d[name], ref, rtol=0, atol=0, msg=name)
    # the subnormal codes read m · 2^-9 · s
    sub = (gw.view(torch.uint8) & 0x78) == 0
    codes = gw.view(torch.uint8)[sub].int()
    vals = torch.where(codes >= 128, -(codes & 7).float(), (codes & 7).float()) * 2**-9
    assert torch.equal(d["gate_proj"][sub], vals * expand_blocks(gs, bn, bk, I, H)[sub])


@pytest.mark.parametrize("block", [(128, 128), (64, 128)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_fp8_checkpoint_fused_gate_up(block):
    E, H, I = 2, 200, 128  # the fused scales split between gate and up: I a multiple of the block rows
    bn, bk = block
    guw, gus = make_fp8_checkpoint(E, 2 * I, H, block, seed=3)
    dw, ds = make_fp8_checkpoint(E, H, I, block, seed=4)
    m = MoEExperts(gate_up_proj=guw, down_proj=dw, gate_up_scale_inv=gus, down_scale_inv=ds,
                   weight_block_size=block, weight_format="fp8")
    d = m.dequantized()
    full = guw.float() * expand_blocks(gus, bn, bk, 2 * I, H)
    torch.testing.assert_close(d["gate_proj"], full[:, :I], rtol=0, atol=0)
    torch.testing.assert_close(d["up_proj"], full[:, I:], rtol=0, atol=0)
    torch.testing.assert_close(d["down_proj"], dw.float() * expand_blocks(ds, bn, bk, H, I), rtol=0, atol=0)
    # the same tensors given separately pack to the same weights
    rows = I // bn
    sep = MoEExperts(guw[:, :I].contiguous(), guw[:, I:].contiguous(), dw, gate_scale_inv=gus[:, :rows].contiguous(),
                     up_scale_inv=gus[:, rows:].contiguous(), down_scale_inv=ds, weight_block_size=block,
                     weight_format="fp8").dequantized()
    for name in d:
        assert torch.equal(sep[name], d[name]), name


@pytest.mark.parametrize("fmt,group", [("bf16", 128), ("int8", 128), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("block", [(128, 128), (64, 96), (100, 32)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_fp8_checkpoint_requantized(fmt, group, block):
    """FP8 checkpoint packed in another format: its fp32 values w · scale quantized by that format's rule (K
    blocks that are not a multiple of 64 are fine here)."""
    E, H, I = 2, 200, 130
    bn, bk = block
    (gw, gs), (uw, us), (dw, ds) = (make_fp8_checkpoint(E, n, k, block, seed=10 + s)
                                    for s, (n, k) in enumerate([(I, H), (I, H), (H, I)]))
    d = MoEExperts(gw, uw, dw, gate_scale_inv=gs, up_scale_inv=us, down_scale_inv=ds, weight_block_size=block,
                   weight_format=fmt, group_size=group).dequantized()
    for name, (w, s) in (("gate_proj", (gw, gs)), ("up_proj", (uw, us)), ("down_proj", (dw, ds))):
        src = w.float() * expand_blocks(s, bn, bk, *w.shape[1:])
        ref = ref_quantize(src, fmt, group)
        if fmt == "int4":
            torch.testing.assert_close(d[name], ref, rtol=2**-22, atol=2**-22 * src.abs().max().item(), msg=name)
        else:
            torch.testing.assert_close(d[name], ref, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------------------------
# 2. Compute: forward and gradients on the dequantized weights

# (weight_format, group_size, FP8 checkpoint block or None for bf16 weights quantized at pack)
CASES = [
    ("bf16", 128, None), ("int8", 128, None), ("int4", 128, None), ("int4", 64, None), ("fp8", 128, None),
    ("fp8", 64, None), ("int4", 192, None), ("fp8", 128, (128, 128)), ("fp8", 128, (64, 128)), ("fp8", 128, (48, 192)),
    ("int4", 64, (128, 128)),
]
CASE_IDS = [f"{f}-g{g}" + (f"-ckpt{b[0]}x{b[1]}" if b else "") for f, g, b in CASES]


def base_weights(case, E, H, I, seed):
    """(MoEExperts weight kwargs, the unquantized fp32 weights (gate, up, down), whether packing quantizes)."""
    fmt, group, block = case
    if block is None:
        gate, up, down = make_weights(E, H, I, seed=seed)
        kw = dict(gate_proj=gate, up_proj=up, down_proj=down)
        src = (gate.float(), up.float(), down.float())
        return kw, src, fmt != "bf16"
    ck = [make_fp8_checkpoint(E, n, k, block, seed=seed + s) for s, (n, k) in enumerate([(I, H), (I, H), (H, I)])]
    kw = dict(gate_proj=ck[0][0], up_proj=ck[1][0], down_proj=ck[2][0], gate_scale_inv=ck[0][1],
              up_scale_inv=ck[1][1], down_scale_inv=ck[2][1], weight_block_size=list(block))
    src = tuple(w.float() * expand_blocks(s, *block, *w.shape[1:]) for w, s in ck)
    return kw, src, fmt in ("int8", "int4")


def experts(case, E, H, I, isa, seed=0, **extra):
    kw, src, quantizes = base_weights(case, E, H, I, seed)
    m = MoEExperts(**kw, weight_format=case[0], group_size=case[1], isa=isa, **extra)
    assert m.isa == isa and m.weight_format == case[0]
    d = m.dequantized()
    return m, (d["gate_proj"], d["up_proj"], d["down_proj"]), src, quantizes


def check_forward(y, x, ids, w, deq, src, quantizes, per_token=False, **lora):
    ref = moe_lora_reference(x, ids, w, *deq, **lora)
    assert rel_l2(y, ref) <= TOL
    if per_token:  # a wrong row cannot hide in the batch norm
        for t in range(y.shape[0]):
            if ref[t].norm() > 0:
                assert rel_l2(y[t], ref[t]) <= TOL, t
            else:
                assert torch.count_nonzero(y[t]) == 0, t
    if quantizes:  # the quantized weights matter: computing with the unquantized ones would fail the check above
        assert rel_l2(moe_lora_reference(x, ids, w, *src, **lora), ref) > 2 * TOL
    return ref


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("isa", ISAS)
def test_decode_forward(isa, case):
    """T = 0, 1 and 7 tokens: 1-3 rows per expert (register-decoding microkernels, the paired blocks), skipped
    ids, two adapters and base-only tokens in one batch."""
    E, H, I = 8, 300, 130
    m, deq, src, quantizes = experts(case, E, H, I, isa, max_slots=8)
    lo_a, lo_b = make_lora(E, H, I, 4, seed=21), make_lora(E, H, I, 8, seed=22)
    m.set_adapter(0, ExpertLoRA.from_kt(lo_a, lo_a["alpha"]))
    m.set_adapter(5, ExpertLoRA.from_kt(lo_b, lo_b["alpha"]))
    assert m.forward_sft(torch.zeros(0, H, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.int64),
                         torch.zeros(0, 2), slots=0).shape == (0, H)
    x = torch.randn(8, H).to(torch.bfloat16)
    ids, w = routing(8, 3, E, seed=23)
    # one token, three experts; base and with an adapter
    check_forward(m.forward_sft(x[:1], ids[:1], w[:1]), x[:1], ids[:1], w[:1], deq, src, quantizes)
    check_forward(m.forward_sft(x[:1], ids[:1], w[:1], slots=5), x[:1], ids[:1], w[:1], deq, src, quantizes, lora=lo_b)
    # seven tokens, skipped ids, mixed slots
    x7, ids7, w7 = x[1:], ids[1:].clone().to(torch.int32), w[1:]
    ids7[1, 0] = -1
    ids7[4, 2] = E + 3
    slots = torch.tensor([0, -1, 5, 0, 5, -1, 0], dtype=torch.int32)
    y = m.forward_sft(x7, ids7, w7, slots=slots)
    check_forward(y, x7, ids7, w7, deq, src, quantizes, per_token=True, slots=slots, loras={0: lo_a, 5: lo_b})


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("isa", ISAS)
def test_hot_expert_and_uneven_experts(isa, case):
    """One expert takes every token (40 rows) and another 17 (> 16: decoded to bf16 once, the bf16 GEMM), the
    rest 12, 5, 3, 2, 1 rows (register decoding, paired and single); K = 300 > 256 (two int8 chunks)."""
    E, H, I, T = 8, 300, 130, 40
    m, deq, src, quantizes = experts(case, E, H, I, isa, seed=30, max_slots=2)
    lo = make_lora(E, H, I, 4, seed=31)
    m.set_adapter(1, ExpertLoRA.from_kt(lo, lo["alpha"]))
    g = torch.Generator().manual_seed(32)
    counts = {0: 1, 1: 2, 2: 3, 4: 17, 5: 5, 7: 12}
    col1 = torch.tensor([e for e, n in counts.items() for _ in range(n)])[torch.randperm(T, generator=g)]
    col2 = torch.full((T,), -1)
    col2[[3, 9, 20]] = torch.tensor([6, 6, 0])
    ids = torch.stack([torch.full((T,), 3), col1, col2], dim=1)
    w = torch.rand(T, 3, generator=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    slots = torch.tensor([(1, -1)[t % 2] for t in range(T)], dtype=torch.int32)
    y = m.forward_sft(x, ids, w, slots=slots)
    check_forward(y, x, ids, w, deq, src, quantizes, per_token=True, slots=slots, loras={1: lo})
    for slot, lora in ((-1, None), (1, lo)):  # every token alone (one row per expert) gives the same
        for t in (0, 1, 2, 17):
            one = slice(t, t + 1)
            alone = m.forward_sft(x[one], ids[one], w[one], slots=slot)
            assert rel_l2(alone, moe_lora_reference(x[one], ids[one], w[one], *deq, lora=lora)) <= TOL, (slot, t)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("isa", ISAS)
def test_forward_512_tokens(isa, case):
    E, H, I, T, k = 16, 130, 66, 512, 4
    m, deq, src, quantizes = experts(case, E, H, I, isa, seed=40, max_slots=1)
    lo = make_lora(E, H, I, 8, seed=41)
    m.set_adapter(0, ExpertLoRA.from_kt(lo, lo["alpha"]))
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = routing(T, k, E, seed=42)
    check_forward(m.forward_sft(x, ids, w), x, ids, w, deq, src, quantizes)
    check_forward(m.forward_sft(x, ids, w, slots=0), x, ids, w, deq, src, quantizes, lora=lo)


@pytest.mark.parametrize("group", [256, 512])
@pytest.mark.parametrize("isa", ISAS)
def test_int4_largest_sums(isa, group):
    """int4 products summed in int32 at their bound: every input at its row's largest magnitude (int16 32767),
    every weight its group's maximum (code 15) but the group's first (the minimum, code 0), K = 1024: a group of
    512 must be summed in chunks (256 K values of 32767 · 16 · 15, as the AVX512 and AVX2 kernels multiply nibble 1, are
    just below 2^31). One token (codes in registers) and 40 (decoded to bf16)."""
    E, H, I = 1, 1024, 64
    def weights(n, k):
        w = torch.full((E, n, k), 0.01)
        w[..., ::group] = -0.01
        return w.to(torch.bfloat16)
    gate, up, down = weights(I, H), weights(I, H), weights(H, I)
    m = MoEExperts(gate, up, down, weight_format="int4", group_size=group, isa=isa, max_tokens=40)
    d = m.dequantized()
    for T in (1, 40):
        x = torch.full((T, H), 1.0).to(torch.bfloat16)
        ids, w = torch.zeros(T, 1, dtype=torch.int64), torch.ones(T, 1)
        ref = moe_lora_reference(x, ids, w, d["gate_proj"], d["up_proj"], d["down_proj"])
        assert rel_l2(m.forward_sft(x, ids, w), ref) <= TOL, T


def runs_routing(seed):
    """160 tokens, top-2: expert 0 takes 70 rows (one GEMM run: up to 80 rows go in one), 1 takes 81 (a run of 64,
    then 17), 2 takes 9 and 3 every token (runs of 64, 64 and 32)."""
    g = torch.Generator().manual_seed(seed)
    col1 = torch.tensor([0] * 70 + [1] * 81 + [2] * 9)[torch.randperm(160, generator=g)]
    ids = torch.stack([col1, torch.full((160,), 3)], dim=1)
    return ids, torch.rand(160, 2, generator=g)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("isa", ISAS)
def test_forward_row_runs(isa, case):
    E, H, I = 4, 130, 66
    m, deq, src, quantizes = experts(case, E, H, I, isa, seed=45, max_slots=1)
    lo = make_lora(E, H, I, 4, seed=46)
    m.set_adapter(0, ExpertLoRA.from_kt(lo, lo["alpha"]))
    ids, w = runs_routing(47)
    x = torch.randn(160, H).to(torch.bfloat16)
    check_forward(m.forward_sft(x, ids, w, slots=0), x, ids, w, deq, src, quantizes, per_token=True, lora=lo)


def module_for(case, E, H, I, r, alpha, isa, seed):
    kw, src, quantizes = base_weights(case, E, H, I, seed)
    mod = MoELoRAExperts(**kw, rank=r, alpha=alpha, isa=isa, weight_format=case[0], group_size=case[1])
    assert f"weight_format={case[0]}" in repr(mod)
    d = mod._experts.dequantized()
    return mod, (d["gate_proj"], d["up_proj"], d["down_proj"]), src, quantizes


def check_backward(case, isa, E, H, I, r, T, k, seed, route=None):
    mod, deq, src, quantizes = module_for(case, E, H, I, r, 2.0 * r, isa, seed)
    lo = make_lora(E, H, I, r, seed=seed + 1, scale=0.2)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = route if route is not None else routing(T, k, E, seed=seed + 2)
    if T > 1:
        ids[0, 0] = -1  # a skipped pair gets grad_w 0
    grad_out = torch.randn(T, H).to(torch.bfloat16)
    reference = reference_grads(x, ids, w, *deq, lo, grad_out)
    assert_backward_matches(mod, *module_forward_backward(mod, lo, x, ids, w, grad_out), reference, skipped_first=T > 1)
    gx_ref = reference[1]
    if quantizes:  # the gradients too come from the quantized weights
        _, gx_src, _, _ = reference_grads(x, ids, w, *src, lo, grad_out)
        assert rel_l2(gx_src, gx_ref) > 1.5 * TOL


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T", [1, 7])
def test_backward(isa, case, T):
    check_backward(case, isa, E=6, H=200, I=130, r=4, T=T, k=3, seed=50)


@pytest.mark.parametrize("case", CASES[1:], ids=CASE_IDS[1:])  # the quantized ones (bf16: tests/test_kernel.py)
def test_backward_512_tokens(case):
    check_backward(case, ISAS[-1], E=16, H=130, I=66, r=8, T=512, k=4, seed=60)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backward_row_runs(case):
    check_backward(case, ISAS[-1], E=4, H=130, I=66, r=4, T=160, k=2, seed=65, route=runs_routing(66))


@pytest.mark.parametrize("isa", ISAS)
def test_backward_no_tokens(isa):
    mod, _, _, _ = module_for(("int4", 64, None), 4, 70, 40, 2, 4.0, isa, seed=70)
    lo = make_lora(4, 70, 40, 2, seed=71)
    ids, w = routing(0, 2, 4)
    y, xs, ws = module_forward_backward(mod, lo, torch.zeros(0, 70, dtype=torch.bfloat16), ids, w,
                                        torch.zeros(0, 70, dtype=torch.bfloat16))
    assert y.shape == xs.grad.shape == (0, 70) and ws.grad.shape == (0, 2)
    for n in KT_TENSOR_NAMES:
        assert torch.count_nonzero(getattr(mod, n).grad) == 0, n


# ---------------------------------------------------------------------------------------------------------------
# 3. The fp8 decoders


@pytest.mark.parametrize("decoder", ["lanes", "lookup"])
@pytest.mark.parametrize("isa", ISAS)
def test_fp8_vbmi_and_shift_decoders(isa, decoder, monkeypatch):
    """On AVX512 CPUs with VBMI the fp8 rows are decoded by one of two VBMI decoders (KT_SERVE_FP8_DECODER: byte
    lookups, or shifts with lookups for exponent-0 codes and in-lane unpacks) unless KT_SERVE_AVX512_VBMI=0 (both
    read when a MoEExperts is made) keeps the shift decoder; all decode exactly, so all give the reference and the
    same bits: 7 tokens (1-3 rows per expert, decoded in registers) and 40 with a hot expert (decoded to bf16
    rows). The checkpoint holds every non-NaN e4m3 code. (Without AVX512 the variables change nothing, and the
    same holds.)"""
    monkeypatch.setenv("KT_SERVE_FP8_DECODER", decoder)
    E, H, I = 8, 300, 130
    kw, _, _ = base_weights(("fp8", 128, (128, 128)), E, H, I, seed=80)
    assert kw["gate_proj"].view(torch.uint8).unique().numel() == 254
    lo = make_lora(E, H, I, 4, seed=81)
    x = torch.randn(40, H).to(torch.bfloat16)
    ids, w = routing(40, 2, E, seed=82)
    ids[7:, 0] = 3  # tokens 7.. make expert 3 hot
    outs = []
    for env in ("0", None):
        if env is None:
            monkeypatch.delenv("KT_SERVE_AVX512_VBMI", raising=False)
        else:
            monkeypatch.setenv("KT_SERVE_AVX512_VBMI", env)
        m = MoEExperts(**kw, weight_format="fp8", isa=isa)
        m.set_adapter(0, ExpertLoRA.from_kt(lo, lo["alpha"]))
        d = m.dequantized()
        deq = (d["gate_proj"], d["up_proj"], d["down_proj"])
        for T in (7, 40):
            for slots, lora in ((None, None), (0, lo)):
                y = m.forward_sft(x[:T], ids[:T], w[:T], slots=slots)
                ref = moe_lora_reference(x[:T], ids[:T], w[:T], *deq, lora=lora)
                for t in range(T):
                    assert rel_l2(y[t], ref[t]) <= TOL, (env, T, t)
                outs.append(y)
    assert all(torch.equal(a, b) for a, b in zip(outs[:4], outs[4:]))


@pytest.mark.parametrize("isa", ISAS)
def test_fp8_large_and_small_activations(isa):
    """fp8 tables may carry a power of two of the weights' scale in the input rows (the AVX2 table moves the e4m3
    exponent bias there, lowering it where inputs are large): rows from ~1e-3 to ~3e4 in one batch (and the
    large expert outputs they give the down projection) stay finite and match the reference row by row."""
    E, H, I = 8, 300, 130
    kw, _, _ = base_weights(("fp8", 128, (128, 128)), E, H, I, seed=90)
    m = MoEExperts(**kw, weight_format="fp8", isa=isa)
    d = m.dequantized()
    deq = (d["gate_proj"], d["up_proj"], d["down_proj"])
    magnitudes = torch.tensor([1e-3, 1.0, 300.0, 3e4, 1.0, 5e3, 2e-2])[:, None]
    x = (torch.randn(7, H) * magnitudes).to(torch.bfloat16)
    ids, w = routing(7, 2, E, seed=91)
    for rows in ([0], [3], list(range(7))):  # alone (one row per call) and together
        y = m.forward_sft(x[rows], ids[rows], w[rows])
        ref = moe_lora_reference(x[rows], ids[rows], w[rows], *deq)
        assert torch.isfinite(y).all()
        for t in range(len(rows)):
            assert rel_l2(y[t], ref[t]) <= TOL, (rows, t)


def test_fp8_nan_codes_are_refused_and_the_decoder_setting_checked(monkeypatch):
    """A NaN code (0x7f / 0xff) in an FP8 checkpoint's experts is a corrupt file: refused at packing, naming the
    matrix, the expert and its rows, whichever format it is packed in. A bad decoder name is refused too."""
    E, H, I = 2, 256, 128
    (gw, gs), (uw, us), (dw, ds) = (make_fp8_checkpoint(E, n, k, (128, 128), seed=s)
                                    for s, (n, k) in enumerate([(I, H), (I, H), (H, I)]))
    kw = dict(gate_scale_inv=gs, up_scale_inv=us, down_scale_inv=ds, weight_block_size=[128, 128], group_size=128)
    bad = uw.view(torch.uint8).clone()
    bad[1, 70, 3] = 0xFF
    with pytest.raises(ValueError, match=r"up_proj of expert 1: e4m3 NaN codes \(0x7f / 0xff\) in output rows 64-127"):
        MoEExperts(gw, bad.view(FP8), dw, weight_format="fp8", **kw)
    if _kernel.has_avx512_bf16():  # elsewhere no table reads the setting
        monkeypatch.setenv("KT_SERVE_FP8_DECODER", "fast")
        with pytest.raises(ValueError, match="KT_SERVE_FP8_DECODER: expected lanes or lookup, got 'fast'"):
            MoEExperts(gw, uw, dw, weight_format="fp8", isa="avx512_bf16", **kw)


@pytest.mark.parametrize("vbmi", ["0", "default"], ids=["vbmi0", "vbmi-default"])
@pytest.mark.parametrize("T", [3, 40], ids=["register-decode", "decode-to-bf16"])
@pytest.mark.parametrize("isa", ISAS)
def test_fp8_subnormal_codes_with_flush_denormal(isa, T, vbmi, monkeypatch):
    """Subnormal e4m3 codes (m · 2^-9: normal numbers in fp32 and bf16) keep their values when the calling thread
    flushes fp32 denormals (torch.set_flush_denormal(True): FTZ/DAZ in its MXCSR; libraries built with
    -ffast-math set the same at load). Decoding must not pass through an fp32 denormal. One kernel thread, so the
    calling thread does all the work; every weight a subnormal code, so a decoder that flushes them outputs 0."""
    if vbmi == "0":
        monkeypatch.setenv("KT_SERVE_AVX512_VBMI", "0")
    else:
        monkeypatch.delenv("KT_SERVE_AVX512_VBMI", raising=False)
    E, H, I = 4, 128, 64
    g = torch.Generator().manual_seed(90)

    def subnormal(N, K):
        bits = torch.randint(1, 8, (E, N, K), generator=g, dtype=torch.uint8)
        bits |= torch.randint(0, 2, (E, N, K), generator=g, dtype=torch.uint8) << 7
        return bits.view(FP8), torch.full((E, _ceil(N, 128), _ceil(K, 128)), 64.0)

    (gw, gs), (uw, us), (dw, ds) = subnormal(I, H), subnormal(I, H), subnormal(H, I)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.full((T,), 1), torch.arange(T) % E], dim=1)  # T = 40: expert 1 takes 40 rows
    w = torch.rand(T, 2, generator=g)
    m = MoEExperts(gw, uw, dw, gate_scale_inv=gs, up_scale_inv=us, down_scale_inv=ds, weight_format="fp8", isa=isa)
    d = m.dequantized()
    ref = moe_lora_reference(x, ids, w, d["gate_proj"], d["up_proj"], d["down_proj"])
    assert rel_l2(m.forward_sft(x, ids, w), ref) <= TOL  # without flushing
    threads = num_threads()
    set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        y = m.forward_sft(x, ids, w)
    finally:
        torch.set_flush_denormal(False)
        set_num_threads(threads)
    assert rel_l2(y, ref) <= TOL


# ---------------------------------------------------------------------------------------------------------------
# 4. Bad inputs


def test_bad_format_arguments_raise_clear_errors():
    E, H, I = 2, 64, 32
    gate, up, down = make_weights(E, H, I)
    with pytest.raises(ValueError, match=r"weight_format must be one of bf16, fp8, int8, int4, got 'nf4'"):
        MoEExperts(gate, up, down, weight_format="nf4")
    for bad in (96, 32, 0, -64, 100, 64.0, True):
        with pytest.raises(ValueError, match="group_size must be a positive multiple of 64"):
            MoEExperts(gate, up, down, weight_format="int4", group_size=bad)
    (gw, gs), (uw, us), (dw, ds) = (make_fp8_checkpoint(E, n, k, (128, 128)) for n, k in [(I, H), (I, H), (H, I)])
    fp8 = dict(gate_proj=gw, up_proj=uw, down_proj=dw)
    scales = dict(gate_scale_inv=gs, up_scale_inv=us, down_scale_inv=ds)
    with pytest.raises(ValueError, match=r"gate_proj is FP8: its weight_scale_inv \(2, 1, 1\) is required"):
        MoEExperts(**fp8, weight_format="fp8")
    with pytest.raises(ValueError, match=r"down_proj is FP8: its weight_scale_inv \(2, 1, 1\) is required"):
        MoEExperts(**fp8, gate_scale_inv=gs, up_scale_inv=us)
    with pytest.raises(ValueError, match=r"up_proj scale_inv has shape \(2, 2, 1\), expected \(2, 1, 1\)"):
        MoEExperts(**fp8, **{**scales, "up_scale_inv": torch.ones(2, 2, 1)})
    with pytest.raises(ValueError, match=r"gate_proj scale_inv has shape \(2, 1, 1\), expected \(2, 1, 2\)"):
        MoEExperts(**fp8, **scales, weight_block_size=[128, 32], weight_format="int8")  # H = 64: two K blocks
    with pytest.raises(ValueError, match=r"down_proj scale_inv must be torch.float32"):
        MoEExperts(**fp8, **{**scales, "down_scale_inv": ds.to(torch.bfloat16)})
    with pytest.raises(ValueError, match="all expert weights must be FP8 or all floating point"):
        MoEExperts(gw, up, dw, **scales)
    with pytest.raises(ValueError, match="all expert weights must be FP8 or all floating point"):
        MoEExperts(gate, up, dw, **scales)
    with pytest.raises(ValueError, match="all expert weights must be FP8 or all floating point"):
        MoEExperts(gw, uw, down, **scales)
    k32 = dict(gate_scale_inv=torch.ones(E, 1, 2), up_scale_inv=torch.ones(E, 1, 2), down_scale_inv=torch.ones(E, 1, 1))
    with pytest.raises(ValueError, match=r"weight_block_size \[128, 32\]: .*multiple of 64"):
        MoEExperts(**fp8, **k32, weight_block_size=[128, 32], weight_format="fp8")
    # the same checkpoint requantized is fine
    assert MoEExperts(**fp8, **k32, weight_block_size=[128, 32], weight_format="int8").weight_format == "int8"
    with pytest.raises(ValueError, match=r"weight_block_size must be \[rows, cols\]"):
        MoEExperts(**fp8, **scales, weight_block_size=128)
    with pytest.raises(ValueError, match="weight_block_size must be positive"):
        MoEExperts(**fp8, **scales, weight_block_size=[0, 128])
    guw, gus = make_fp8_checkpoint(E, 2 * 96, H, (64, 64))
    with pytest.raises(ValueError, match="intermediate size 96 must be a multiple of the FP8 block rows 64"):
        MoEExperts(gate_up_proj=guw, down_proj=make_fp8_checkpoint(E, H, 96, (64, 64))[0], gate_up_scale_inv=gus,
                   down_scale_inv=torch.ones(E, 1, 2), weight_block_size=[64, 64], weight_format="fp8")
    with pytest.raises(TypeError, match="unexpected argument"):
        MoEExperts(gate, up, down, gate_scale=gs)


def test_expert_memory_per_format_from_a_config():
    """python -m kt_serve.kernel.weights: Qwen3-30B-A3B's routed experts, counted by hand (48 layers x 128 experts x
    gate, up [768, 2048] and down [2048, 768]): bf16 2 bytes a weight; int8 1 plus one fp32 scale per row;
    int4 half a byte plus a bf16 scale and a bf16 minimum per 128 K values; fp8 1 plus a scale per 128 K values."""
    from kt_serve.kernel.weights import expert_memory

    config = {"num_experts": 128, "hidden_size": 2048, "moe_intermediate_size": 768, "num_hidden_layers": 48}
    weights = 48 * 128 * 3 * 2048 * 768
    rows = 48 * 128 * (2 * 768 + 2048)  # gate and up have 768 rows of K = 2048, down 2048 rows of K = 768
    mem = expert_memory(config)
    assert mem["bf16"] == 2 * weights
    assert mem["int8"] == pytest.approx(weights + 4 * rows, rel=1e-12)
    assert mem["int4"] == pytest.approx(weights / 2 + 4 * weights / 128, rel=1e-12)
    assert mem["fp8"] == pytest.approx(weights + 4 * weights / 128, rel=1e-12)
    deepseek = {"n_routed_experts": 256, "hidden_size": 7168, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                "first_k_dense_replace": 3}
    assert expert_memory(deepseek)["bf16"] == 58 * 256 * 3 * 7168 * 2048 * 2


@pytest.mark.parametrize("N, K, block", [(256, 384, (128, 128)), (200, 333, (128, 128)), (64, 96, (32, 64))])
def test_fp8_to_bf16_is_the_blockwise_product_rounded_to_nearest_even(N, K, block):
    """The kernel's FP8 -> bf16 dequantization (a CPU host's dense FP8 linears) against torch written from the
    definition: each e4m3 value times its block's scale_inv in fp32, then rounded to bf16."""
    from kt_serve.kernel.weights import fp8_to_bf16

    g = torch.Generator().manual_seed(N + K)
    codes = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    w = codes.view(torch.float8_e4m3fn)
    bn, bk = block
    scale = torch.rand((-(-N // bn), -(-K // bk)), generator=g) * 4 + 0.01
    rows = torch.arange(N) // bn
    cols = torch.arange(K) // bk
    want = (w.float() * scale[rows][:, cols]).to(torch.bfloat16)
    assert torch.equal(fp8_to_bf16(w, scale, block), want)
