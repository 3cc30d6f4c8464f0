"""The accelerator host's code path, emulated on CPU: stock SGLang + the plugin with KT_SERVE_EMULATE_ACCELERATOR=1
(accelerator.py) serve tiny models through what a GPU host runs around our layer — the GPU host's hook set (no
CPU-host fast paths, no decode stack), the experts through ``_forward_offload``, LoRA Experts in torch, and, after
load, the model files' accelerator switches on: DeepSeek-V2 leaves ``routed_scaling_factor`` (2.0 here) to the MoE
method and computes its router in fp32 as on CUDA. Against the same fp32 references as the CPU serving tests: base
and composite adapters (router LoRA, shared expert, LoRA on linear attention, LoRA Experts), per request and mixed in
one batch. One server per family: DeepSeek-V2, Qwen3-MoE, Qwen3.5-MoE.
"""

from __future__ import annotations

import json

import pytest

from kt_serve.harness.server import SGLangServer
from kt_serve.harness.tiny_model import build_tiny_moe
from qwen35_adapters import write_qwen35_adapter
from serving_reference import HFReference, write_kt_adapter
from test_serving import LORA_ARGS, MIN_EFFECT, assert_matches_reference, complete, concurrent_equals_sequential
from test_serving import pick_prompts
from test_serving_deepseek import DEEPSEEK_SERVING_CONFIG, TIE_MARGIN as DS_TIE_MARGIN, mla_adapter, write_adapter
import test_serving_qwen35 as q35

EMULATE = {"KT_SERVE_EMULATE_ACCELERATOR": "1"}


def served(model, name):
    return str(model) if name is None else f"{model}:{name}"


def mixed_batch_matches_reference(server, model, ref, jobs, adapters, complete_fn, matches_fn):
    """Every (adapter name, prompt) alone and all at once in one batch: equal, and within TOL of the reference."""
    def run(job):
        name, prompt = job
        return complete_fn(server, served(model, name), list(prompt))

    for (name, prompt), (ids, logprobs) in concurrent_equals_sequential(run, jobs).items():
        matches_fn(ref, list(prompt), ids, logprobs, [] if name is None else [adapters[name]])


# -- DeepSeek-V2: routed_scaling_factor 2.0 left to the MoE method ------------------------------------------------
@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("accelerator_deepseek")
    model = build_tiny_moe(workdir / "model", "deepseek_v2", **DEEPSEEK_SERVING_CONFIG)
    adapters = {"both": write_adapter(workdir / "both", model, *mla_adapter(model, 11, shared_expert=True,
                                                                                gates=True)),
                "experts": write_adapter(workdir / "experts", model, {}, mla_adapter(model, 12)[1])}
    ref = HFReference(model)
    prompts = pick_prompts(ref, [[], [adapters["both"]], [adapters["experts"]]], n=2, tie_margin=DS_TIE_MARGIN)
    return model, adapters, ref, prompts


@pytest.fixture(scope="module")
def server_deepseek(deepseek):
    model, adapters, _, _ = deepseek
    with SGLangServer(model, LORA_ARGS + ["--lora-paths", *(f"{n}={p}" for n, p in adapters.items())],
                      env=EMULATE) as server:
        yield server


def ds_matches(ref, prompt, ids, logprobs, dirs):
    return assert_matches_reference(ref, prompt, ids, logprobs, dirs, tie_margin=DS_TIE_MARGIN)


def test_deepseek_routed_scaling_is_applied_where_the_model_leaves_it(server_deepseek, deepseek):
    """The model takes its CUDA branch (no multiply after the experts): the method applies the factor, and base, the
    composite adapter (MLA, shared expert, router, experts) and an expert-only adapter match the fp32 reference."""
    model, adapters, ref, prompts = deepseek
    log = server_deepseek.log_path.read_text()
    assert "KT_SERVE_EMULATE_ACCELERATOR=1: serving through the accelerator host's code" in log
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert f"routed_scaling_factor 2 applied by the kernel's MoE method in {layers} layers" in log
    for prompt in prompts:
        for name in (None, "both", "experts"):
            ids, logprobs = complete(server_deepseek, served(model, name), prompt)
            keep = ds_matches(ref, prompt, ids, logprobs, [] if name is None else [adapters[name]])
            if name is not None:
                base = ref.logprobs(prompt + ids, len(prompt), [])
                assert max(abs(logprobs[i] - base[i]) for i in keep) > MIN_EFFECT


def test_deepseek_mixed_batch(server_deepseek, deepseek):
    model, adapters, ref, prompts = deepseek
    jobs = [(name, tuple(p)) for p in prompts for name in (None, "both", "experts")]
    mixed_batch_matches_reference(server_deepseek, model, ref, jobs, adapters, complete, ds_matches)


# -- Qwen3-MoE: composite adapters, router LoRA, LoRA Experts in torch ---------------------------------------------
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("accelerator_qwen3")
    model = build_tiny_moe(workdir / "qwen3", "qwen3_moe")
    adapters = {"both": write_kt_adapter(workdir / "both", model, seed=1),
                "router": write_kt_adapter(workdir / "router", model, seed=3, gates=True),
                "lora_experts": write_kt_adapter(workdir / "lora_experts", model, seed=5, lora_experts=2)}
    ref = HFReference(model)
    prompts = pick_prompts(ref, [[]] + [[d] for d in adapters.values()], n=2)
    return model, adapters, ref, prompts


@pytest.fixture(scope="module")
def server_qwen3(qwen3):
    model, adapters, _, _ = qwen3
    with SGLangServer(model, LORA_ARGS + ["--lora-paths", *(f"{n}={p}" for n, p in adapters.items())],
                      env=EMULATE) as server:
        yield server


def test_qwen3_adapters_per_request_and_mixed(server_qwen3, qwen3):
    model, adapters, ref, prompts = qwen3
    for name in (None, *adapters):
        ids, logprobs = complete(server_qwen3, served(model, name), prompts[0])
        assert_matches_reference(ref, prompts[0], ids, logprobs, [] if name is None else [adapters[name]])
    jobs = [(name, tuple(p)) for p in prompts for name in (None, *adapters)]
    mixed_batch_matches_reference(server_qwen3, model, ref, jobs, adapters,
                                  complete, assert_matches_reference)


# -- Qwen3.5-MoE: Gated DeltaNet, LoRA on linear attention, shared expert with its gate ------------------------------
@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("accelerator_qwen35")
    model = build_tiny_moe(workdir / "qwen35", "qwen3_5_moe")
    adapters = {"both": write_qwen35_adapter(workdir / "both", model, seed=1)}
    ref = HFReference(model)
    return model, adapters, ref, q35.pick_prompts(ref, {None: [], "both": [adapters["both"]]})


@pytest.fixture(scope="module")
def server_qwen35(qwen35):
    model, adapters, _, _ = qwen35
    with SGLangServer(model, q35.ARGS + ["--lora-paths", f"both={adapters['both']}"], env=EMULATE) as server:
        yield server


def test_qwen35_base_and_composite_per_request_and_mixed(server_qwen35, qwen35):
    model, adapters, ref, prompts = qwen35
    for name in (None, "both"):
        for prompt in prompts[name]:
            ids, logprobs = q35.complete(server_qwen35, served(model, name), prompt)
            q35.assert_matches(ref, prompt, ids, logprobs, [] if name is None else [adapters[name]])
    jobs = [(name, tuple(p)) for name in (None, "both") for p in prompts[name]]
    mixed_batch_matches_reference(server_qwen35, model, ref, jobs, adapters, q35.complete, q35.assert_matches)
