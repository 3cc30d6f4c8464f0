"""The adapter registry's expert slots (sglang_plugin/adapters/registry.py) on real kernel layers and adapter files
on disk: a KT SFT output loaded into a slot of every MoE layer gives the fp32 reference; a load is checked against
the layers before anything is written, read one layer at a time, and undone whole when a layer fails on the way;
a name is held once."""

from __future__ import annotations

import json

import pytest
import torch

from kt_serve.formats import (ADAPTER_CONFIG_FILE, FUSED_EXPERT_LORA_FILE, FormatError, fused_key, open_adapter_dir,
                              save_tensors)
from kt_serve.formats.names import KT_TENSOR_NAMES, kt_shapes
from kt_serve.kernel.experts import MoEExperts
from kt_serve.sglang_plugin.adapters.registry import ExpertSlots
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


@pytest.fixture
def slots():
    s = ExpertSlots(max_slots=2)
    for layer in LAYERS:
        s.layers[layer] = MoEExperts(*base(layer), max_slots=2)
    return s


def route(seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=g)


def assert_layers_hold(slots, slot, experts_by_layer):
    x, ids, w = route()
    for layer in LAYERS:
        ref = moe_lora_reference(x, ids, w, *base(layer), lora={**experts_by_layer[layer], "alpha": 2.0 * R})
        got = slots.layers[layer].forward_sft(x, ids, w, slots=slot)
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2


def nothing_loaded(slots, key):
    return key not in slots.slots and not any(m.has_adapter(s) for m in slots.layers.values() for s in range(2))


def test_an_adapter_on_disk_reaches_every_layer_in_its_slot(slots, tmp_path):
    experts = {layer: lora(layer, seed=1) for layer in LAYERS}
    slots.load("a", open_adapter_dir(write(tmp_path, "a", experts)))
    assert slots.slot_of("a") == 0 and slots.slot_of("unknown") == -1
    assert_layers_hold(slots, 0, experts)
    slots.unload("a")
    assert nothing_loaded(slots, "a")


def test_a_mismatched_adapter_is_refused_before_anything_is_written(slots, tmp_path):
    wide = write(tmp_path, "wide", {layer: lora(layer, seed=2, hidden=H + 8) for layer in LAYERS})
    with pytest.raises(AdapterError, match=rf"^{wide}: layer 1 gate_lora_a has shape \[8, 4, 72\], the model expects "
                                           rf"\[8, 4, 64\] \(E=8, H=64, I=32, r=4\)$"):
        slots.load("wide", open_adapter_dir(wide))
    assert nothing_loaded(slots, "wide")
    extra = write(tmp_path, "extra", {layer: lora(layer, seed=3) for layer in (*LAYERS, 5)})
    with pytest.raises(AdapterError, match=r"expert LoRA for layer\(s\) \[5\], which are not MoE layers of this model "
                                           r"\(MoE layers: \[1, 3\]\)"):
        slots.load("extra", open_adapter_dir(extra))
    short = write(tmp_path, "short", {1: lora(1, seed=4)})
    with pytest.raises(AdapterError, match=r"no expert LoRA for MoE layer 3$"):
        slots.load("short", open_adapter_dir(short))
    assert not slots.slots


def test_a_load_that_fails_half_way_leaves_nothing_behind(slots, tmp_path):
    """Layer 3's values are bad (the header is fine, so the check before writing passes): layer 1 is already in its
    slot when the read of layer 3 fails; the load is undone and the slot is free for the next adapter."""
    experts = {layer: lora(layer, seed=6) for layer in LAYERS}
    experts[3]["down_lora_b"][0, 0, 0] = float("nan")
    bad = write(tmp_path, "bad", experts)
    with pytest.raises(FormatError, match="layer 3 down_lora_b holds NaN or Inf values"):
        slots.load("bad", open_adapter_dir(bad))
    assert nothing_loaded(slots, "bad")
    good = {layer: lora(layer, seed=7) for layer in LAYERS}
    slots.load("good", open_adapter_dir(write(tmp_path, "good", good)))
    assert slots.slot_of("good") == 0
    assert_layers_hold(slots, 0, good)


def test_a_name_is_held_once_and_slots_run_out_with_a_clear_error(slots, tmp_path):
    first = {layer: lora(layer, seed=8) for layer in LAYERS}
    path = write(tmp_path, "a", first)
    slots.load("a", open_adapter_dir(path))
    with pytest.raises(AdapterError, match="expert adapter a is already loaded"):
        slots.load("a", open_adapter_dir(write(tmp_path, "a2", {layer: lora(layer, seed=9) for layer in LAYERS})))
    assert_layers_hold(slots, 0, first)  # the first one is untouched
    slots.load("b", open_adapter_dir(path))
    with pytest.raises(AdapterError, match=r"all 2 expert slots are in use \(raise --kt-max-expert-loras"):
        slots.load("c", open_adapter_dir(path))
    assert "c" not in slots.slots and set(slots.slots) == {"a", "b"}
    assert sorted(KT_TENSOR_NAMES) == sorted(kt_shapes(E, H, I, R))
