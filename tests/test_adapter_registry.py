"""The expert-adapter pool (sglang_plugin/adapters/expert_pool.py) on real kernel layers and adapter files on disk:
a KT SFT output loaded into a slot of every MoE layer gives the fp32 reference; a registration is checked against
the layers before anything is written, read one layer at a time, and undone whole when a layer fails on the way;
a name is held once; beyond the budget adapters are registered, made resident per batch and evicted least recently
used, never the batch's own nor pinned ones; a registered file is read again as it was at registration."""

from __future__ import annotations

import json

import pytest
import torch

from kt_serve.formats import (ADAPTER_CONFIG_FILE, FUSED_EXPERT_LORA_FILE, FormatError, fused_key, open_adapter_dir,
                              save_tensors)
from kt_serve.formats.names import KT_TENSOR_NAMES, kt_shapes
from kt_serve.kernel.experts import MoEExperts
from kt_serve.sglang_plugin.adapters.expert_pool import ExpertPool
from kt_serve.sglang_plugin.config import ExpertBudget
from kt_serve.sglang_plugin.adapters.split import AdapterError
from moe_reference import moe_lora_reference

E, H, I, R, T, K = 8, 64, 32, 4, 12, 2
LAYERS = (1, 3)  # MoE layers need not be 0..n-1 (a dense first layer, say)


def base(layer):
    g = torch.Generator().manual_seed(layer)
    return [(torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((E, I, H), (E, I, H), (E, H, I))]


def lora(layer, seed, rank=R, hidden=H):
    g = torch.Generator().manual_seed(1000 * seed + layer)
    return {n: (torch.randn(*s, generator=g) * 0.1).bfloat16() for n, s in kt_shapes(E, hidden, I, rank).items()}


def write(tmp_path, name, experts, rank=R):
    """A KT SFT output's expert half as KT writes it (fused file, no manifest), values unchecked."""
    path = tmp_path / name
    path.mkdir()
    save_tensors(path / FUSED_EXPERT_LORA_FILE,
                 {fused_key(layer, n): t for layer, tensors in experts.items() for n, t in tensors.items()})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["gate_proj", "up_proj",
              "down_proj"], "base_model_name_or_path": "tiny"}
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    return path


def make_pool(budget: ExpertBudget, max_per_batch=None, kernel_slots=None):
    pool = ExpertPool(budget)
    pool.max_per_batch = max_per_batch
    for layer in LAYERS:
        pool.layers[layer] = MoEExperts(*base(layer), max_slots=kernel_slots or budget.kernel_slots)
    return pool


@pytest.fixture
def slots():
    return make_pool(ExpertBudget(slots=2))


def route(seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=g)


def assert_layers_hold(pool, slot, experts_by_layer, rank=R):
    x, ids, w = route()
    for layer in LAYERS:
        ref = moe_lora_reference(x, ids, w, *base(layer), lora={**experts_by_layer[layer], "alpha": 2.0 * rank})
        got = pool.layers[layer].forward_sft(x, ids, w, slots=slot)
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2


def assert_serves(pool, key, experts_by_layer, rank=R):
    """``key`` is resident and its slot computes the reference of its own tensors."""
    assert_layers_hold(pool, pool.slot_of(key), experts_by_layer, rank)


def nothing_loaded(pool, key):
    return key not in pool.entries and not any(m.has_adapter(s) for m in pool.layers.values()
                                                for s in range(m.max_slots))


def adapters(tmp_path, names, rank=R):
    """name -> (path, tensors by layer), seeds from the name's position."""
    out = {}
    for i, name in enumerate(names):
        experts = {layer: lora(layer, seed=20 + i, rank=rank) for layer in LAYERS}
        out[name] = (write(tmp_path, name, experts, rank), experts)
    return out


def test_an_adapter_on_disk_reaches_every_layer_in_its_slot(slots, tmp_path):
    experts = {layer: lora(layer, seed=1) for layer in LAYERS}
    slots.register("a", open_adapter_dir(write(tmp_path, "a", experts)))
    assert slots.slot_of("a") == 0 and slots.slot_of("unknown") == -1 and slots.slot_of(None) == -1
    assert_layers_hold(slots, 0, experts)
    slots.unregister("a")
    assert nothing_loaded(slots, "a")


def test_a_mismatched_adapter_is_refused_before_anything_is_written(slots, tmp_path):
    wide = write(tmp_path, "wide", {layer: lora(layer, seed=2, hidden=H + 8) for layer in LAYERS})
    with pytest.raises(AdapterError, match=rf"^{wide}: layer 1 gate_lora_a has shape \[8, 4, 72\], the model expects "
                                           rf"\[8, 4, 64\] \(E=8, H=64, I=32, r=4\)$"):
        slots.register("wide", open_adapter_dir(wide))
    assert nothing_loaded(slots, "wide")
    extra = write(tmp_path, "extra", {layer: lora(layer, seed=3) for layer in (*LAYERS, 5)})
    with pytest.raises(AdapterError, match=r"expert LoRA for layer\(s\) \[5\], which are not MoE layers of this model "
                                           r"\(MoE layers: \[1, 3\]\)"):
        slots.register("extra", open_adapter_dir(extra))
    short = write(tmp_path, "short", {1: lora(1, seed=4)})
    with pytest.raises(AdapterError, match=r"no expert LoRA for MoE layer 3$"):
        slots.register("short", open_adapter_dir(short))
    assert not slots.entries


@pytest.mark.parametrize("resident", [True, False])
def test_a_load_that_fails_half_way_leaves_nothing_behind(tmp_path, resident):
    """Layer 3's values are bad (the header is fine, so the check before writing passes): layer 1 is already read
    (into its slot, or, with the running batch holding every slot, only checked) when the read of layer 3 fails;
    nothing is registered and the slot is free for the next adapter."""
    pool = make_pool(ExpertBudget(slots=2), max_per_batch=2)
    held = adapters(tmp_path, ["x", "y"])
    for name, (path, _) in held.items():
        pool.register(name, open_adapter_dir(path))
    if resident:
        pool.unregister("y")
    else:
        pool.prepare({"x", "y"})  # the running batch holds both slots
    experts = {layer: lora(layer, seed=6) for layer in LAYERS}
    experts[3]["down_lora_b"][0, 0, 0] = float("nan")
    bad = write(tmp_path, "bad", experts)
    with pytest.raises(FormatError, match="layer 3 down_lora_b holds NaN or Inf values"):
        pool.register("bad", open_adapter_dir(bad))
    assert "bad" not in pool.entries and pool.evictions == 0
    if resident:
        assert not any(m.has_adapter(1) for m in pool.layers.values())
    assert_serves(pool, "x", held["x"][1])


def test_a_name_is_held_once_and_a_budget_too_small_for_a_batch_is_refused(slots, tmp_path):
    first = {layer: lora(layer, seed=8) for layer in LAYERS}
    path = write(tmp_path, "a", first)
    slots.register("a", open_adapter_dir(path))
    with pytest.raises(AdapterError, match="expert adapter a is already loaded"):
        slots.register("a", open_adapter_dir(write(tmp_path, "a2", {layer: lora(layer, seed=9) for layer in LAYERS})))
    assert_layers_hold(slots, 0, first)  # the first one is untouched
    slots.register("b", open_adapter_dir(path))
    # without --max-loras-per-batch every registered adapter may share a batch: a third cannot fit two slots
    with pytest.raises(AdapterError, match=r"cannot register expert adapter c .*a batch of 3 adapters beside 0 pinned "
                                           r"needs 3 resident .*over --kt-max-expert-loras 2 adapters"):
        slots.register("c", open_adapter_dir(path))
    assert set(slots.entries) == {"a", "b"}
    assert sorted(KT_TENSOR_NAMES) == sorted(kt_shapes(E, H, I, R))


def test_least_recently_used_adapters_are_evicted_and_reloaded_per_batch(tmp_path):
    """Two slots, five adapters, batches of up to two: every batch's adapters are resident in the slots the pool
    reports and compute their own reference; the least recently used one is evicted, never one of the batch."""
    pool = make_pool(ExpertBudget(slots=2), max_per_batch=2)
    held = adapters(tmp_path, ["a", "b", "c", "d", "e"])
    for name, (path, _) in held.items():
        pool.register(name, open_adapter_dir(path))
    assert len(pool.resident()) == 2 and len(pool.entries) == 5
    batches = [{"a"}, {"a", "b"}, {"c"}, {"a", "c"}, {"d", "e"}, {"b", None}, {"e", "b"}, {"a"}]
    last_use = {}
    for step, batch in enumerate(batches):
        before = {e.key for e in pool.resident()}
        pool.prepare(batch | {"unregistered"})
        resident = {e.key for e in pool.resident()}
        for key in sorted(batch - {None}):  # marked used in this order: the last one most recently
            last_use[key] = (step, key)
            assert_serves(pool, key, held[key][1])
        evicted = before - resident
        assert not evicted & batch
        # the evicted ones are the least recently used among those not in the batch
        kept_out = sorted((k for k in before - batch), key=lambda k: last_use.get(k, (-1, k)))
        assert evicted == set(kept_out[:len(evicted)]), (step, before, resident)
        assert pool.slot_of(None) == -1 and pool.slot_of("unregistered") == -1
    assert pool.loads >= 8 and pool.evictions == pool.loads - 2


def test_pinned_and_global_adapters_are_never_evicted(tmp_path):
    held = adapters(tmp_path, ["g", "p", "a", "b", "c"])
    pool = ExpertPool(ExpertBudget(slots=4))
    pool.max_per_batch = 2
    pool.load_global(str(held["g"][0]))
    for layer in LAYERS:
        pool.add_layer(layer, MoEExperts(*base(layer), max_slots=4))
    pool.finish_load(available_bytes=2**30)
    pool.register("p", open_adapter_dir(held["p"][0]), pinned=True)
    for name in "abc":
        pool.register(name, open_adapter_dir(held[name][0]))
    for batch in ({"a", "b"}, {"c"}, {"b", "c"}, {"a", None}, {"p", "c"}):
        pool.prepare(batch)
        assert {"g", "p"} <= {e.name for e in pool.resident()} | {"g"} and pool.slot_of(None) == pool.default_slot
        for key in batch - {None}:
            assert_serves(pool, key, held[key][1])
    assert_layers_hold(pool, pool.slot_of(None), held["g"][1])
    assert pool.entries["p"].slot is not None and pool.evictions > 0
    with pytest.raises(AdapterError, match="beside 3 pinned needs 5 resident"):  # g, p and q pinned, 2 per batch
        pool.register("q", open_adapter_dir(held["a"][0]), pinned=True)


def test_a_byte_budget_evicts_until_the_new_adapter_fits(tmp_path):
    """Budget of 3 rank-4 adapters: a rank-8 one (twice the bytes) evicts two."""
    (tmp_path / "small").mkdir()
    small = adapters(tmp_path / "small", ["a", "b", "c"])
    big_experts = {layer: lora(layer, seed=40, rank=2 * R) for layer in LAYERS}
    big = write(tmp_path, "big", big_experts, rank=2 * R)
    probe = make_pool(ExpertBudget(slots=1))
    per_adapter = probe.adapter_bytes(R)
    assert per_adapter == sum(6 * E * R * (H + I) for _ in LAYERS)
    pool = make_pool(ExpertBudget(nbytes=3 * per_adapter), max_per_batch=1)
    for name, (path, _) in small.items():
        pool.register(name, open_adapter_dir(path))
    pool.register("big", open_adapter_dir(big))  # registered; room made by evicting the two oldest
    assert {e.key for e in pool.resident()} == {"c", "big"} and pool.info()["resident_bytes"] == 3 * per_adapter
    assert_serves(pool, "big", big_experts, rank=2 * R)
    pool.prepare({"a"})
    assert {e.key for e in pool.resident()} == {"a", "big"}  # c, used before big, went
    assert pool.info()["resident_bytes"] <= 3 * per_adapter
    assert_serves(pool, "a", small["a"][1])


def test_a_registered_file_is_read_as_it_was_when_its_path_changes(tmp_path):
    """The pool keeps a registered adapter's file open: removed or replaced on disk, a reload after eviction still
    reads the bytes that were checked at registration."""
    pool = make_pool(ExpertBudget(slots=1), max_per_batch=1)
    held = adapters(tmp_path, ["a", "b"])
    for name, (path, _) in held.items():
        pool.register(name, open_adapter_dir(path))
    (held["a"][0] / FUSED_EXPERT_LORA_FILE).unlink()
    fused_b = held["b"][0] / FUSED_EXPERT_LORA_FILE
    replacement = fused_b.with_suffix(".new")
    save_tensors(replacement, {fused_key(layer, n): torch.full_like(t, float("nan"))
                               for layer, tensors in held["b"][1].items() for n, t in tensors.items()})
    replacement.replace(fused_b)
    for key in ("a", "b", "a"):
        pool.prepare({key})
        assert_serves(pool, key, held[key][1])
    pool.unregister("a")
    pool.unregister("b")
    assert not pool.entries


def test_a_replaced_slot_computes_the_new_adapter(tmp_path):
    """set_adapter over an occupied slot (rewritten in place when the rank matches, reallocated when not)."""
    experts = MoEExperts(*base(1), max_slots=1)
    x, ids, w = route()
    from kt_serve.kernel.experts import ExpertLoRA

    for seed, rank in ((1, R), (2, R), (3, 2 * R), (4, 2 * R), (5, R)):
        tensors, alpha = lora(1, seed=seed, rank=rank), float(seed * rank)  # a new scale each time too
        experts.set_adapter(0, ExpertLoRA.from_kt(tensors, alpha))
        ref = moe_lora_reference(x, ids, w, *base(1), lora={**tensors, "alpha": alpha})
        got = experts.forward_sft(x, ids, w, slots=0)
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2, (seed, rank)


def test_first_in_first_out_never_evicts_an_adapter_of_the_batch(tmp_path):
    """--lora-eviction-policy fifo ranks by load order, not use: the oldest resident adapter may be in the batch
    being prepared, and then the next one goes instead."""
    pool = ExpertPool(ExpertBudget(slots=2), eviction_policy="fifo")
    pool.max_per_batch = 2
    for layer in LAYERS:
        pool.layers[layer] = MoEExperts(*base(layer), max_slots=2)
    held = adapters(tmp_path, ["a", "b", "c"])
    for name, (path, _) in held.items():  # c's registration evicts a, the first in
        pool.register(name, open_adapter_dir(path))
    assert {e.key for e in pool.resident()} == {"b", "c"}
    slot_b = pool.slot_of("b")
    pool.prepare({"b", "a"})  # b is now the first in, but the batch needs it: c goes
    assert {e.key for e in pool.resident()} == {"a", "b"} and pool.slot_of("b") == slot_b
    assert pool.evictions == 2  # a at c's registration, then c; b never left
    for key in ("a", "b"):
        assert_serves(pool, key, held[key][1])
