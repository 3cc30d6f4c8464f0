"""The C++ MoE-LoRA kernel against an independent fp32 PyTorch reference (tests/moe_reference.py).

Every kernel table this CPU supports runs: the portable C++ reference path and, where the CPU has them,
AVX512-BF16 and AMX-BF16 (the AMX GEMM takes blocks of >= 8 rows: the T=512 and hot-expert cases). Tolerance:
rel-L2 ≤ 1e-2, which bf16 inputs/intermediates (≈2⁻⁸ relative rounding) meet with a wide margin while a
wrong index, transpose or missing term lands far above it (the LoRA terms below change outputs by >20%).
"""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kt_serve import _kernel
from kt_serve.formats.names import KT_TENSOR_NAMES, kt_shapes
from kt_serve.kernel.experts import ExpertLoRA, MoEExperts
from kt_serve.kernel.threads import num_threads, set_idle_spin_us, set_num_threads
from kt_serve.train.expert_autograd import MoELoRAExperts
from moe_reference import moe_lora_reference

ISAS = (["portable"] + (["avx2"] if _kernel.has_avx2() else [])
        + (["avx512_bf16"] if _kernel.has_avx512_bf16() else []) + (["amx_bf16"] if _kernel.has_amx_bf16() else []))
TOL = 1e-2


def module_forward_backward(mod, lo, x, ids, w, grad_out):
    """The training module with the LoRA ``lo`` loaded, one forward and backward: (y, x leaf, weights leaf)."""
    with torch.no_grad():
        for n in KT_TENSOR_NAMES:
            getattr(mod, n).copy_(lo[n].float())
    xs = x.float().clone().requires_grad_(True)
    ws = w.clone().requires_grad_(True)
    y = mod(xs, ids, ws)
    y.backward(grad_out.float())
    return y, xs, ws


@pytest.fixture(autouse=True)
def _seeded():
    """Inputs drawn from torch's global generator are the same every run (torch seeds it randomly per process)."""
    torch.manual_seed(0)


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_weights(E, H, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(torch.bfloat16)  # noqa: E731
    return rnd(E, I, H), rnd(E, I, H), rnd(E, H, I)


def make_lora(E, H, I, r, seed=1, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    shapes = [(E, r, H), (E, I, r), (E, r, H), (E, I, r), (E, r, I), (E, H, r)]
    t = {n: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16) for n, s in zip(KT_TENSOR_NAMES, shapes)}
    t["alpha"] = 2.0 * r
    return t


def routing(T, k, E, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(T, k, generator=g)
    return ids, w


# (E, H, I, r, T, k): odd sizes (H, I not multiples of 16/32), T ∈ {0, 1, 7, 512}, ranks 1 and 64.
SHAPES = [
    (4, 40, 24, 3, 7, 2),
    (8, 70, 45, 1, 1, 3),
    (6, 96, 80, 64, 7, 2),
    (16, 130, 66, 8, 512, 4),
    (4, 32, 16, 4, 0, 2),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("E,H,I,r,T,k", SHAPES)
def test_forward_matches_reference(isa, E, H, I, r, T, k):
    gate, up, down = make_weights(E, H, I)
    lo = make_lora(E, H, I, r)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = routing(T, k, E)
    m = MoEExperts(gate, up, down, isa=isa)
    assert m.isa == isa
    m.set_adapter(0, ExpertLoRA.from_kt(lo, lo["alpha"]))
    base, with_lora = m.forward_sft(x, ids, w), m.forward_sft(x, ids, w, slots=0)
    assert base.shape == with_lora.shape == (T, H) and base.dtype == torch.bfloat16
    if T == 0:
        return
    ref_base = moe_lora_reference(x, ids, w, gate, up, down)
    ref_lora = moe_lora_reference(x, ids, w, gate, up, down, lora=lo)
    assert rel_l2(ref_lora, ref_base) > 0.1  # the LoRA term matters at this scale
    assert rel_l2(base, ref_base) <= TOL
    assert rel_l2(with_lora, ref_lora) <= TOL


@pytest.mark.parametrize("isa", ISAS)
def test_skipped_repeated_and_hot_expert(isa):
    E, H, I, r, T, k = 8, 72, 40, 4, 33, 4
    gate, up, down = make_weights(E, H, I, seed=5)
    lo = make_lora(E, H, I, r, seed=6)
    x = torch.randn(T, H).to(torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    ids[:, 0] = 3  # expert 3 gets every token
    ids[::3, 1] = -1  # skipped
    ids[1::5, 2] = E + 5  # out of range: skipped
    ids[2::4, 3] = ids[2::4, 0]  # the same expert twice for one token
    w = torch.rand(T, k, generator=g)
    m = MoEExperts(gate, up, down, isa=isa)
    m.set_adapter(2, ExpertLoRA.from_kt(lo, lo["alpha"]))
    y = m.forward_sft(x, ids, w, slots=2)
    ref = moe_lora_reference(x, ids, w, gate, up, down, lora=lo)
    assert rel_l2(y, ref) <= TOL
    # int64 ids give the same result as int32
    assert torch.equal(m.forward_sft(x, ids.long(), w, slots=2), y)
    # a token whose every id is skipped gets zeros
    ids_none = torch.full((2, k), -1, dtype=torch.int32)
    assert torch.count_nonzero(m.forward_sft(x[:2], ids_none, w[:2], slots=2)) == 0


@pytest.mark.parametrize("isa", ISAS)
def test_decode_batch_with_uneven_small_experts(isa):
    # Decode-sized batches stream two weight blocks side by side (gate with up; neighbouring experts' down
    # blocks). Row counts 1..7 per expert, neighbours unequal, so the paired rows and the leftover rows of the
    # longer expert are both exercised; partial column blocks too (H, I not multiples of 64).
    E, H, I, r, T, k = 10, 200, 136, 4, 9, 3
    counts = [1, 3, 2, 2, 5, 1, 4, 0, 2, 7]
    g = torch.Generator().manual_seed(13)
    flat = torch.tensor([e for e, n in enumerate(counts) for _ in range(n)])
    ids = flat[torch.randperm(T * k, generator=g)].reshape(T, k)
    w = torch.rand(T, k, generator=g)
    gate, up, down = make_weights(E, H, I, seed=12)
    lo = make_lora(E, H, I, r, seed=14)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    m = MoEExperts(gate, up, down, isa=isa)
    m.set_adapter(0, ExpertLoRA.from_kt(lo, lo["alpha"]))
    for slots, lora in ((None, None), (0, lo)):
        y = m.forward_sft(x, ids, w, slots=slots)
        ref = moe_lora_reference(x, ids, w, gate, up, down, lora=lora)
        for t in range(T):  # every token, so one wrong row cannot hide in the batch norm
            assert rel_l2(y[t], ref[t]) <= TOL, t


@pytest.mark.parametrize("threads", [1, 3, 5])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_decode_task_spans_for_any_thread_count(fmt, threads):
    # Decode-sized calls give a task runs of consecutive column blocks (and the down projection groups of two
    # experts); how long depends on the thread count. 7 column blocks of H and 5 of I, cut into uneven spans,
    # an odd number of active experts (a group of one), one expert with more rows than the pair tiles take.
    E, H, I, r, T, k = 13, 64 * 6 + 33, 64 * 4 + 10, 4, 5, 3
    g = torch.Generator().manual_seed(21)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[:, 0] = 4  # every token: 5 rows for expert 4
    w = torch.rand(T, k, generator=g)
    gate, up, down = make_weights(E, H, I, seed=22)
    lo = make_lora(E, H, I, r, seed=23)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    before = num_threads()
    set_num_threads(threads)
    try:
        m = MoEExperts(gate, up, down, weight_format=fmt)
        m.set_adapter(0, ExpertLoRA.from_kt(lo, lo["alpha"]))
        q = m.dequantized()  # fp32; for int4 the reference takes the weights the kernel serves
        y = m.forward_sft(x, ids, w, slots=0)
    finally:
        set_num_threads(before)
    ref = moe_lora_reference(x, ids, w, q["gate_proj"], q["up_proj"], q["down_proj"], lora=lo)
    for t in range(T):
        assert rel_l2(y[t], ref[t]) <= TOL, t


@pytest.mark.parametrize("isa", ISAS)
def test_fused_gate_up_equals_separate(isa):
    E, H, I = 4, 48, 20
    gate, up, down = make_weights(E, H, I, seed=9)
    x = torch.randn(9, H).to(torch.bfloat16)
    ids, w = routing(9, 2, E)
    a = MoEExperts(gate, up, down, isa=isa).forward_sft(x, ids, w)
    b = MoEExperts(gate_up_proj=torch.cat([gate, up], dim=1), down_proj=down, isa=isa).forward_sft(x, ids, w)
    assert torch.equal(a, b)
    assert rel_l2(a, moe_lora_reference(x, ids, w, gate, up, down)) <= TOL


@pytest.mark.parametrize("isa", ISAS)
def test_mixed_adapters_and_base_in_one_batch(isa):
    E, H, I, T, k = 8, 66, 34, 40, 2
    gate, up, down = make_weights(E, H, I, seed=11)
    lo_a, lo_b = make_lora(E, H, I, 4, seed=12), make_lora(E, H, I, 16, seed=13)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = routing(T, k, E, seed=14)
    slots = torch.tensor([(-1, 0, 5)[t % 3] for t in range(T)], dtype=torch.int32)
    m = MoEExperts(gate, up, down, max_slots=8, isa=isa)
    m.set_adapter(0, ExpertLoRA.from_kt(lo_a, lo_a["alpha"]))
    m.set_adapter(5, ExpertLoRA.from_kt(lo_b, lo_b["alpha"]))
    mixed = m.forward_sft(x, ids, w, slots=slots)
    ref = moe_lora_reference(x, ids, w, gate, up, down, slots=slots, loras={0: lo_a, 5: lo_b})
    assert rel_l2(mixed, ref) <= TOL
    for t in range(T):  # each token equals running it alone with its adapter
        alone = m.forward_sft(x[t : t + 1], ids[t : t + 1], w[t : t + 1], slots=int(slots[t]))
        assert torch.equal(alone[0], mixed[t])


def test_portable_and_fast_paths_agree():
    if len(ISAS) == 1:
        pytest.skip("this CPU has no AVX2 or AVX512-BF16: only the portable path exists here")
    E, H, I, r, T = 8, 100, 52, 8, 65
    gate, up, down = make_weights(E, H, I, seed=20)
    lo = make_lora(E, H, I, r, seed=21)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = routing(T, 2, E, seed=22)
    outs = []
    for isa in ISAS:
        m = MoEExperts(gate, up, down, isa=isa)
        m.set_adapter(0, ExpertLoRA.from_kt(lo, lo["alpha"]))
        outs.append(m.forward_sft(x, ids, w, slots=0))
    for o in outs[1:]:
        assert rel_l2(o, outs[0]) <= 5e-3


def test_env_var_forces_portable(monkeypatch):
    monkeypatch.setenv("KT_SERVE_ISA", "portable")
    gate, up, down = make_weights(2, 16, 8)
    assert MoEExperts(gate, up, down).isa == "portable"
    assert _kernel.cpu_isa() == "portable"


# ---------------------------------------------------------------------------------------------------------------
# Backward


def reference_grads(x, ids, w, gate, up, down, lo, grad_out):
    xs = x.float().clone().requires_grad_(True)
    ws = w.float().clone().requires_grad_(True)
    params = {n: lo[n].float().clone().requires_grad_(True) for n in KT_TENSOR_NAMES}
    params["alpha"] = lo["alpha"]
    y = moe_lora_reference(xs, ids, ws, gate, up, down, lora=params)
    y.backward(grad_out.float())
    return y, xs.grad, ws.grad, {n: params[n].grad for n in KT_TENSOR_NAMES}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("E,H,I,r,T,k", [(4, 40, 24, 3, 7, 2), (8, 70, 45, 1, 1, 3), (6, 96, 80, 64, 7, 2), (16, 130, 66, 8, 512, 4)])
def test_backward_matches_autograd(isa, E, H, I, r, T, k):
    gate, up, down = make_weights(E, H, I, seed=30)
    lo = make_lora(E, H, I, r, seed=31, scale=0.2)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = routing(T, k, E, seed=32)
    if T > 1:
        ids[0, 0] = -1  # a skipped pair gets grad_w 0
    grad_out = torch.randn(T, H).to(torch.bfloat16)
    y_ref, gx_ref, gw_ref, glora_ref = reference_grads(x, ids, w, gate, up, down, lo, grad_out)

    mod = MoELoRAExperts(gate, up, down, rank=r, alpha=lo["alpha"], isa=isa)
    assert_backward_matches(mod, *module_forward_backward(mod, lo, x, ids, w, grad_out),
                            (y_ref, gx_ref, gw_ref, glora_ref), skipped_first=T > 1)


def assert_backward_matches(mod, y, xs, ws, reference, skipped_first):
    """The module's output and every gradient (x, routing weights, the six LoRA tensors) within TOL of the
    reference's (y, grad x, grad w, {KT name: grad}); a skipped first pair gets grad_w 0."""
    y_ref, gx_ref, gw_ref, glora_ref = reference
    assert rel_l2(y, y_ref) <= TOL
    assert rel_l2(xs.grad, gx_ref) <= TOL
    assert rel_l2(ws.grad, gw_ref) <= TOL
    if skipped_first:
        assert ws.grad[0, 0] == 0
    for n in KT_TENSOR_NAMES:
        assert rel_l2(getattr(mod, n).grad, glora_ref[n]) <= TOL, n


@pytest.mark.parametrize("isa", ISAS)
def test_lora_grads_accumulate_across_calls(isa):
    E, H, I, r, T = 4, 36, 20, 2, 6
    gate, up, down = make_weights(E, H, I, seed=40)
    lo = make_lora(E, H, I, r, seed=41, scale=0.2)
    m = MoEExperts(gate, up, down, isa=isa)
    m.set_adapter(0, ExpertLoRA.from_kt(lo, lo["alpha"]))
    grads = ExpertLoRA(*(torch.zeros(t.shape) for t in ExpertLoRA.from_kt(lo, 1).tensors()), alpha=1.0)
    m.set_grad_buffers(0, grads)
    total = {n: 0 for n in KT_TENSOR_NAMES}
    for step in range(2):
        x = torch.randn(T, H).to(torch.bfloat16)
        ids, w = routing(T, 2, E, seed=50 + step)
        go = torch.randn(T, H).to(torch.bfloat16)
        m.forward_sft(x, ids, w, save_for_backward=True, slots=0)
        m.backward(go)
        _, _, _, g = reference_grads(x, ids, w, gate, up, down, lo, go)
        total = {n: total[n] + g[n] for n in KT_TENSOR_NAMES}
    for n, f in zip(KT_TENSOR_NAMES, ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")):
        assert rel_l2(getattr(grads, f), total[n]) <= TOL, n


def test_training_module_learns_a_target():
    """A few SGD steps on the LoRA alone reduce a regression loss (gradients point the right way)."""
    E, H, I, T = 4, 32, 16, 64
    gate, up, down = make_weights(E, H, I, seed=60)
    mod = MoELoRAExperts(gate, up, down, rank=4, alpha=8.0)
    x = torch.randn(T, H)
    ids, w = routing(T, 2, E, seed=61)
    target = torch.randn(T, H) * 0.05
    opt = torch.optim.Adam(mod.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = ((mod(x, ids, w) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


# ---------------------------------------------------------------------------------------------------------------
# Slots under concurrency, errors


def test_replacing_a_slot_does_not_disturb_other_slots_in_flight():
    E, H, I, T = 8, 64, 32, 48
    gate, up, down = make_weights(E, H, I, seed=70)
    lo_a, lo_b = make_lora(E, H, I, 4, seed=71), make_lora(E, H, I, 4, seed=72)
    m = MoEExperts(gate, up, down, max_slots=4)
    m.set_adapter(0, ExpertLoRA.from_kt(lo_a, lo_a["alpha"]))
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = routing(T, 2, E, seed=73)
    expected = m.forward_sft(x, ids, w, slots=0)
    errors, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            if not torch.equal(m.forward_sft(x, ids, w, slots=0), expected):
                errors.append("slot 0 output changed")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(20):
        lo = lo_b if i % 2 else lo_a
        m.set_adapter(1, ExpertLoRA.from_kt(lo, lo["alpha"]))
        m.remove_adapter(1)
    stop.set()
    for t in threads:
        t.join()
    assert not errors


def test_an_adapter_is_held_once_by_the_kernel():
    """After set_adapter the kernel's packed copy is the only one: no tensor on the caller's memory, nor a Python-side
    copy, stays alive once the caller drops its own; the output still has the adapter. The grad buffers a training slot registers are still checked against the adapter's rank."""
    import gc

    E, H, I, r, T = 16, 256, 128, 8, 6
    gate, up, down = make_weights(E, H, I, seed=80)
    lo = make_lora(E, H, I, r, seed=81)
    m = MoEExperts(gate, up, down, max_slots=2)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = routing(T, 2, E, seed=82)
    lora = ExpertLoRA.from_kt(lo, lo["alpha"])
    m.set_adapter(1, lora)
    ptrs = {t.data_ptr() for t in lora.tensors()}
    del lora
    lo = {n: lo[n].clone() for n in KT_TENSOR_NAMES} | {"alpha": lo["alpha"]}  # the reference keeps its own copy
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.data_ptr() in ptrs]
    assert not alive, f"{len(alive)} tensor(s) still hold the adapter's bytes outside the kernel"
    ref = moe_lora_reference(x, ids, w, gate, up, down, lora=lo)
    assert rel_l2(m.forward_sft(x, ids, w, slots=1), ref) <= TOL
    with pytest.raises(ValueError, match=r"grads\.gate_a has shape \(16, 4, 256\), expected \(16, 8, 256\)"):
        wrong = [torch.zeros(s) for s in kt_shapes(E, H, I, 4).values()]
        m.set_grad_buffers(1, ExpertLoRA(*wrong, alpha=1.0))
    with pytest.raises(ValueError, match="slot 0: load an adapter before registering its gradient buffers"):
        m.set_grad_buffers(0, ExpertLoRA(*(torch.zeros(s) for s in kt_shapes(E, H, I, r).values()), alpha=1.0))
    m.remove_adapter(1)
    assert not m.has_adapter(1)
    with pytest.raises(ValueError, match="slot 1: load an adapter before registering its gradient buffers"):
        m.set_grad_buffers(1, ExpertLoRA(*(torch.zeros(s) for s in kt_shapes(E, H, I, r).values()), alpha=1.0))


@pytest.mark.parametrize("idle_spin_us", [0, 1000])
def test_workers_that_sleep_or_poll_between_calls_give_the_reference(idle_spin_us):
    """0: workers sleep as soon as a call ends and each call wakes them; 1000: they poll for the next call. Calls
    2 ms apart (past the poll, so polling workers fall asleep too) and back to back."""
    E, H, I, r, T, k = 8, 130, 66, 4, 7, 3
    gate, up, down = make_weights(E, H, I, seed=80)
    lo = make_lora(E, H, I, r, seed=81)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = routing(T, k, E, seed=82)
    ref = moe_lora_reference(x, ids, w, gate, up, down, lora=lo)
    m = MoEExperts(gate, up, down)
    m.set_adapter(0, ExpertLoRA.from_kt(lo, lo["alpha"]))
    before = _kernel.idle_spin_us()
    set_idle_spin_us(idle_spin_us)
    try:
        assert _kernel.idle_spin_us() == idle_spin_us
        for i in range(12):
            if i % 2:
                time.sleep(0.002)
            assert rel_l2(m.forward_sft(x, ids, w, slots=0), ref) <= TOL
    finally:
        set_idle_spin_us(before)


def test_idle_spin_setting_is_checked():
    with pytest.raises(ValueError, match="idle spin: expected microseconds in 0..1000000"):
        set_idle_spin_us(-1)
    bad = subprocess.run([sys.executable, "-c", "import kt_serve._kernel as k; k.num_threads()"],
                         env={**os.environ, "KT_SERVE_IDLE_SPIN_US": "fast"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "KT_SERVE_IDLE_SPIN_US: expected microseconds in 0..1000000, got 'fast'" in bad.stderr
    ok = subprocess.run([sys.executable, "-c", "import kt_serve._kernel as k; print(k.idle_spin_us())"],
                        env={**os.environ, "KT_SERVE_IDLE_SPIN_US": "250"}, capture_output=True, text=True, check=True)
    assert ok.stdout.strip() == "250"


def test_bad_inputs_raise_clear_errors():
    E, H, I = 4, 32, 16
    gate, up, down = make_weights(E, H, I)
    m = MoEExperts(gate, up, down, max_tokens=8, max_slots=2)
    x = torch.randn(3, H).to(torch.bfloat16)
    ids, w = routing(3, 2, E)
    with pytest.raises(ValueError, match="x must be torch.bfloat16"):
        m.forward_sft(x.float(), ids, w)
    with pytest.raises(ValueError, match=r"x has shape \(3, 31\)"):
        m.forward_sft(x[:, :31].contiguous(), ids, w)
    with pytest.raises(ValueError, match="x must be contiguous"):
        m.forward_sft(torch.randn(H, 3).to(torch.bfloat16).t(), ids, w)
    with pytest.raises(ValueError, match="topk_ids must be torch.int32 or torch.int64"):
        m.forward_sft(x, ids.float(), w)
    with pytest.raises(ValueError, match="topk_weights must be torch.float32"):
        m.forward_sft(x, ids, w.double())
    with pytest.raises(ValueError, match=r"topk_weights has shape \(3, 3\)"):
        m.forward_sft(x, ids, torch.rand(3, 3))
    with pytest.raises(ValueError, match="max_tokens=8"):
        m.forward_sft(torch.randn(9, H).to(torch.bfloat16), *routing(9, 2, E))
    with pytest.raises(ValueError, match="no adapter loaded in that slot"):
        m.forward_sft(x, ids, w, slots=1)
    with pytest.raises(ValueError, match=r"slot must be an int in 0\.\.1"):
        m.forward_sft(x, ids, w, slots=7)
    with pytest.raises(ValueError, match=r"slots\[0\] = 9: expected -1 or 0\.\.1"):
        m.forward_sft(x, ids, w, slots=torch.tensor([9, 0, 0], dtype=torch.int32))
    lo = make_lora(E, H, I, 4)
    bad = ExpertLoRA.from_kt(lo, 8.0)
    bad.down_b = torch.zeros(E, H, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"down_b has shape \(4, 32, 3\), expected \(4, 32, 4\).*one rank"):
        m.set_adapter(0, bad)
    with pytest.raises(ValueError, match="backward\\(\\) needs a preceding forward_sft"):
        m.backward(torch.zeros(3, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"gate_proj has shape"):
        MoEExperts(gate[:, :5], up, down)
    with pytest.raises(ValueError, match="unknown isa"):
        MoEExperts(gate, up, down, isa="sse9")
