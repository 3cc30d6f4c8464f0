"""The plugin's gate LoRA (router, shared-expert gate, Qwen3.5's in_proj_ba) on stand-in modules, against plain torch
with each token's adapter merged into the weights: mixed batches, requests of one adapter that are not adjacent,
in_proj_b and in_proj_a with their own A, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("sglang")

from kt_serve.formats.sglang_modules import split_gate_modules  # noqa: E402
from kt_serve.sglang_plugin.adapters.gate_lora import GateLoRA, GateLoRAError  # noqa: E402
from kt_serve.sglang_plugin.adapters.registry import AdapterRegistry, get_registry  # noqa: E402

H, E, NV, R, SCALE = 16, 6, 4, 3, 2.0
CPU_ARGS = SimpleNamespace(device="cpu")


class Replicated(nn.Linear):
    """Returns (output, bias) as SGLang's ReplicatedLinear does."""

    def forward(self, x):
        return super().forward(x), None


class MergedColumn(Replicated):
    """in_proj_ba as SGLang builds it: b | a stacked, sizes per output part."""

    def __init__(self):
        super().__init__(H, 2 * NV, bias=False)
        self.output_partition_sizes = [NV, NV]


def tiny_model():
    torch.manual_seed(0)
    layers = nn.ModuleList()
    for _ in range(2):
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.gate = Replicated(H, E, bias=False)
        layer.mlp.shared_expert_gate = nn.Linear(H, 1, bias=False)
        layer.linear_attn = nn.Module()
        layer.linear_attn.in_proj_ba = MergedColumn()
        layers.append(layer)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = layers
    return model


def lora_pair(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, H, generator=g), torch.randn(rows, R, generator=g)


def peft(modules, seed):
    """PEFT keys for {(layer, "mlp.gate"): rows, ...}."""
    out = {}
    for i, ((layer, path), rows) in enumerate(sorted(modules.items())):
        a, b = lora_pair(rows, seed + i)
        prefix = f"base_model.model.model.layers.{layer}.{path}"
        out[f"{prefix}.lora_A.weight"], out[f"{prefix}.lora_B.weight"] = a, b
    return out


def merged_output(model, tensors, layer, path, x):
    """Plain torch: x through the module's weight + s·B·A of every PEFT module it holds (b | a for in_proj_ba)."""
    W = model.model.layers[layer].get_submodule(path).weight.detach().clone()
    for key, a in tensors.items():
        if f"layers.{layer}." not in key or ".lora_A." not in key:
            continue
        leaf_path = key.split(f"layers.{layer}.", 1)[1].split(".lora_A.")[0]
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        if leaf_path == path:
            W += SCALE * b @ a
        elif path == "linear_attn.in_proj_ba" and leaf_path in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
            rows = slice(0, NV) if leaf_path.endswith("_b") else slice(NV, 2 * NV)
            W[rows] += SCALE * b @ a
    return x @ W.T


ADAPTER_1 = {(0, "mlp.gate"): E, (1, "linear_attn.in_proj_b"): NV}
ADAPTER_2 = {(0, "mlp.shared_expert_gate"): 1, (1, "linear_attn.in_proj_b"): NV, (1, "linear_attn.in_proj_a"): NV,
             (1, "mlp.gate"): E}


@pytest.fixture
def served(monkeypatch):
    from kt_serve.sglang_plugin.adapters import registry

    model = tiny_model()
    monkeypatch.setattr(registry, "_registry", AdapterRegistry(1))  # what the fused CPU ops use
    gates = get_registry().gates
    gates.attach(model, CPU_ARGS)
    tensors = {"a1": peft(ADAPTER_1, 10), "a2": peft(ADAPTER_2, 20)}
    for uid, t in tensors.items():
        rest, split = split_gate_modules("adapter", t)
        assert not rest
        gates.load(uid, f"/adapters/{uid}", split, SCALE)
    yield model, gates, tensors


def set_batch(lora_ids, seq_lens):
    """The adapters of the next forward, handed to the registry as SGLang's prepare_lora_batch hook does."""
    get_registry().prepare_batch(lora_ids, seq_lens, layer_lora=False, expert_slots=False)


@pytest.mark.parametrize("path", ["mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_ba"])
@pytest.mark.parametrize("layer", [0, 1])
def test_mixed_batch_matches_merged_weights(served, layer, path):
    model, _, tensors = served
    # requests: a1 (2 tokens), base (1), a2 (2), a1 again (1): a1's tokens are not adjacent
    lora_ids, seq_lens = ["a1", None, "a2", "a1"], [2, 1, 2, 1]
    set_batch(lora_ids, seq_lens)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(layer))
    module = model.model.layers[layer].get_submodule(path)
    with torch.no_grad():
        got = module(x)
        got = got[0] if isinstance(got, tuple) else got
        owners = [uid for uid, n in zip(lora_ids, seq_lens) for _ in range(n)]
        want = torch.stack([merged_output(model, tensors[uid] if uid else {}, layer, path, x[t:t + 1])[0]
                            for t, uid in enumerate(owners)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_no_batch_or_base_requests_leave_the_module_as_it_was(served):
    model, gates, _ = served
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(3, H)
    with torch.no_grad():
        plain = x @ gate.weight.T
        torch.testing.assert_close(gate(x)[0], plain, rtol=0, atol=0)   # no LoRA batch (warm-up, --enable-lora off)
        set_batch([None, "a2"], [2, 1])            # a2 has no LoRA on layer 0's router
        torch.testing.assert_close(gate(x)[0], plain, rtol=0, atol=0)
    gates.unload("a1")
    set_batch(["a1"], [3])
    with torch.no_grad():
        torch.testing.assert_close(gate(x)[0], plain, rtol=0, atol=0)


def test_refusals_name_the_adapter_layer_and_module():
    model = tiny_model()
    gates = GateLoRA(lambda: None)
    gates.attach(model, CPU_ARGS)
    _, wrong_rows = split_gate_modules("a", peft({(0, "mlp.gate"): E + 1}, 0))
    with pytest.raises(GateLoRAError, match=r"^/x: LoRA on layer 0 gate: lora_A \[3, 16\] / lora_B \[7, 3\], the "
                                            r"model's model\.layers\.0\.mlp\.gate expects \[r, 16\] / \[6, r\]$"):
        gates.load("u", "/x", wrong_rows, SCALE)
    _, no_layer = split_gate_modules("a", peft({(5, "mlp.gate"): E}, 0))
    with pytest.raises(GateLoRAError, match=r"^/x: LoRA on layer 5 gate: the model has no mlp\.gate in decoder layer 5$"):
        gates.load("u", "/x", no_layer, SCALE)
    assert not gates.adapters
    graphs = GateLoRA(lambda: None)
    graphs.attach(tiny_model(), SimpleNamespace(device="cuda"))  # no graph config published: SGLang captures
    _, ok = split_gate_modules("a", peft({(0, "mlp.gate"): E}, 0))
    with pytest.raises(GateLoRAError, match="--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled"):
        graphs.load("u", "/x", ok, SCALE)


def test_gate_keys_must_sit_where_the_module_does():
    from kt_serve.formats import FormatError

    a, b = lora_pair(E, 0)
    with pytest.raises(FormatError, match=r"model\.layers\.0\.self_attn\.gate\.lora_A\.weight: LoRA on gate is applied as "
                                          r"mlp\.gate"):
        split_gate_modules("adapter", {"model.layers.0.self_attn.gate.lora_A.weight": a,
                                       "model.layers.0.self_attn.gate.lora_B.weight": b})
    with pytest.raises(FormatError, match="layer 0 gate: LoRA lacks its lora_B"):
        split_gate_modules("adapter", {"model.layers.0.mlp.gate.lora_A.weight": a})


def test_shared_expert_gate_lora_reaches_the_fused_cpu_gate_op(served):
    """SGLang's CPU path gates the shared expert in one fused op given the gate's weight, not the module
    (fused_gate_sigmoid_mul_add); the plugin's op adds the gate LoRA found by that weight."""
    from kt_serve.sglang_plugin.cpu_host.moe_block import gate_sigmoid_mul_add_cpu

    model, _, tensors = served
    gate = model.model.layers[0].mlp.shared_expert_gate
    x, shared = torch.randn(3, H), torch.randn(3, H)
    set_batch(["a2", None], [2, 1])
    final = torch.zeros(3, H)
    with torch.no_grad():
        gate_sigmoid_mul_add_cpu(None, x, gate.weight.squeeze(), shared, final)
        logits = torch.cat([merged_output(model, tensors["a2"], 0, "mlp.shared_expert_gate", x[:2]),
                            merged_output(model, {}, 0, "mlp.shared_expert_gate", x[2:])])
    torch.testing.assert_close(final, torch.sigmoid(logits) * shared, rtol=1e-5, atol=1e-5)


def test_adapter_with_only_gate_lora_gets_an_empty_half_for_sglang(tmp_path, monkeypatch):
    """SGLang's manager knows an adapter by the half it loads: a router-only adapter gets an empty one (no
    tensors, target o_proj: zero LoRA), so a request can name it, and its gate LoRA goes to the plugin."""
    from safetensors.torch import load_file

    from kt_serve.formats import write_peft_adapter
    from kt_serve.sglang_plugin.adapters import split

    adapter = write_peft_adapter(tmp_path / "router_only", peft({(0, "mlp.gate"): E}, 0),
                                 {"r": R, "lora_alpha": 2 * R}, overwrite=True)
    monkeypatch.setattr(split, "_cache_root", lambda: tmp_path / "cache")
    result = split.split_composite(str(adapter))
    half = json.loads((Path(result.sglang_path) / "adapter_config.json").read_text())
    assert half["target_modules"] == ["o_proj"] and half["r"] == R
    assert load_file(Path(result.sglang_path) / "adapter_model.safetensors") == {}
    assert list(result.gates) and result.experts is None
