"""End-to-end: a tiny DeepSeek-V2 served by stock SGLang + the kt_serve plugin on CPU, against fp32 HF.

DeepSeek differs from Qwen where the plugin could go wrong: grouped top-k routing, shared experts beside the routed
ones (kept out of the routed FusedMoE), routed_scaling_factor applied by the model after the experts, and MLA
attention. One server; a composite adapter (o_proj + shared-expert LoRA + routed-expert LoRA) per request.
"""

from __future__ import annotations

import pytest

from kt_serve.formats import write_kt_sft_output
from kt_serve.server import SGLangServer
from kt_serve.tiny_model import build_tiny_moe
from serving_reference import HFReference, random_adapter
from test_serving import LORA_ARGS, MIN_EFFECT, assert_matches_reference, complete, pick_prompts

# What SGLang's DeepSeek-V2 needs beyond transformers' DeepseekV2Config defaults (real DeepSeek-V2 configs have
# them): yarn RoPE (its CPU rotary embedding is deepseek_yarn only), moe_layer_freq and scoring_func.
DEEPSEEK_SERVING_CONFIG = dict(
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 0.707, "mscale_all_dim": 0.707},
    moe_layer_freq=1, scoring_func="softmax")


def write_adapter(out_dir, model, nonexpert, experts):
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[1] for k in nonexpert} |
                     ({"gate_proj", "up_proj", "down_proj"} if experts else set()))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": targets, "lora_dropout": 0.0,
              "bias": "none", "task_type": "CAUSAL_LM"}
    return write_kt_sft_output(out_dir, nonexpert=nonexpert, experts=experts, adapter_config=config,
                               base_model_name_or_path=str(model), overwrite=True)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serving_deepseek")
    model = build_tiny_moe(workdir / "deepseek_v2", "deepseek_v2", **DEEPSEEK_SERVING_CONFIG)
    nonexpert, experts = random_adapter(model, seed=11, rank=4, shared_expert=True)
    adapters = {
        "both": write_adapter(workdir / "both", model, nonexpert, experts),
        # references for the sanity checks only: the same adapter without one of its parts
        "no_experts": write_adapter(workdir / "no_experts", model, nonexpert, {}),
        "no_shared": write_adapter(workdir / "no_shared", model,
                                   {k: v for k, v in nonexpert.items() if ".shared_experts." not in k}, experts),
    }
    ref = HFReference(model)
    return str(model), adapters, ref, pick_prompts(ref, [[], [adapters["both"]]], n=2)


@pytest.fixture(scope="module")
def server_ds(deepseek):
    model, adapters, _, _ = deepseek
    with SGLangServer(model, LORA_ARGS + ["--lora-paths", f"both={adapters['both']}"]) as server:
        yield server


@pytest.mark.parametrize("name", [None, "both"])
def test_deepseek_v2_matches_reference(server_ds, deepseek, name):
    model, adapters, ref, prompts = deepseek
    for prompt in prompts:
        ids, logprobs = complete(server_ds, model if name is None else f"{model}:{name}", prompt)
        assert_matches_reference(ref, prompt, ids, logprobs, [] if name is None else [adapters["both"]])
        if name is None:
            continue
        # each part of the adapter moves the served logprobs, so matching the full reference shows all applied
        for part in ([], [adapters["no_experts"]], [adapters["no_shared"]]):
            without = ref.logprobs(prompt + ids, len(prompt), part)
            assert max(abs(a - b) for a, b in zip(logprobs, without)) > MIN_EFFECT, part
