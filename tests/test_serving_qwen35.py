"""End-to-end: a tiny Qwen3.5-MoE (3 Gated DeltaNet layers + 1 gated full-attention layer, shared expert) served
by stock SGLang + the kt_serve plugin on CPU, against HF transformers fp32 (its pure-torch GDN path) with the LoRA
merged in plain torch (serving_reference.HFReference).

Three servers: the official layout (per-expert keys, as transformers saves it) with composite adapters per request;
the fused-expert layout (``mlp.experts.gate_up_proj [E, 2I, H]``) with a global ``--kt-expert-lora-path``; and
``--kt-moe off`` (SGLang's own MoE path: the CPU GDN ops on their own). Prompts are longer than
``--chunked-prefill-size`` and decode many tokens, so chunked prefill, the conv / delta-rule state carried between
chunks and the recurrent decode step are all compared.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from kt_serve.server import SGLangServer
from kt_serve.tiny_model import build_tiny_moe
from qwen35_adapters import text_config, write_qwen35_adapter
from serving_reference import HFReference

TOL = 0.02
MIN_EFFECT = 5 * TOL
PROMPT_LEN, MAX_TOKENS, CHUNK = 20, 12, 8
ARGS = ["--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", "4", "--max-running-requests", "8",
        "--chunked-prefill-size", str(CHUNK)]


def fuse_experts(model_dir):
    """Rewrite the checkpoint's per-expert keys as the fused gate_up_proj / down_proj of the official files."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    E = text_config(model_dir)["num_experts"]
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    layers = sorted({k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k})
    for prefix in layers:
        e = f"{prefix}.mlp.experts"
        out[f"{e}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{e}.{i}.gate_proj.weight"],
                                                           tensors[f"{e}.{i}.up_proj.weight"]]) for i in range(E)])
        out[f"{e}.down_proj"] = torch.stack([tensors[f"{e}.{i}.down_proj.weight"] for i in range(E)])
    save_file(out, str(path), metadata={"format": "pt"})
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    return model_dir


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serving_qwen35")
    model = build_tiny_moe(workdir / "qwen35", "qwen3_5_moe")
    fused = fuse_experts(build_tiny_moe(workdir / "qwen35_fused", "qwen3_5_moe"))
    adapters = {
        "both": write_qwen35_adapter(workdir / "both", model, seed=1),
        "nonexpert": write_qwen35_adapter(workdir / "nonexpert", model, seed=2, experts=False),
        "both2": write_qwen35_adapter(workdir / "both2", model, seed=3),
        "global": write_qwen35_adapter(workdir / "global", model, seed=4, nonexpert=False),
    }
    ref = HFReference(model)
    # Per adapter set, prompts whose reference routing has no near-tie inside the prompt (past one, a bf16 server
    # may pick another expert: a different computation; assert_matches stops at the first one after it). About
    # one random 20-token prompt in four qualifies under a given set, so each set gets its own.
    g = torch.Generator().manual_seed(0)
    prompts = {}
    for name, dirs in {None: [], "both": [adapters["both"]], "nonexpert": [adapters["nonexpert"]],
                       "global": [adapters["global"]]}.items():
        prompts[name] = []
        while len(prompts[name]) < 2:
            prompt = torch.randint(3, 1000, (PROMPT_LEN,), generator=g).tolist()
            if ref.logprobs_and_routing(prompt, 1, dirs)[1] >= PROMPT_LEN:
                prompts[name].append(prompt)
    return model, fused, adapters, ref, prompts


def complete(server, model, prompt):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", timeout=300, max_retries=0)
    r = c.completions.create(model=str(model), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                             extra_body={"return_token_ids": True, "ignore_eos": True})
    return list(r.choices[0].token_ids), list(r.choices[0].logprobs.token_logprobs)


def assert_matches(ref, prompt, ids, logprobs, dirs):
    want, first_tie = ref.logprobs_and_routing(prompt + ids, len(prompt), dirs)
    compared = [(a, b) for i, (a, b) in enumerate(zip(logprobs, want)) if len(prompt) + i - 1 < first_tie]
    assert len(compared) >= 2, f"routing near-tie at position {first_tie}"
    diff = max(abs(a - b) for a, b in compared)
    assert diff < TOL, f"served {logprobs} vs reference {want}: max diff {diff:.4f} ({len(compared)} tokens, {dirs})"
    return want


@pytest.fixture(scope="module")
def server_composite(qwen35):
    model, _, adapters, _, _ = qwen35
    args = ARGS + ["--lora-paths", *(f"{n}={adapters[n]}" for n in ("both", "nonexpert", "both2"))]
    with SGLangServer(model, args) as server:
        yield server


@pytest.mark.parametrize("name", [None, "nonexpert", "both"])
def test_qwen35_per_request_adapter_matches_reference(server_composite, qwen35, name):
    model, _, adapters, ref, prompts = qwen35
    dirs = [] if name is None else [adapters[name]]
    for prompt in prompts[name]:
        ids, logprobs = complete(server_composite, model if name is None else f"{model}:{name}", prompt)
        assert_matches(ref, prompt, ids, logprobs, dirs)
        if name is not None:  # the adapter acted
            base = ref.logprobs(prompt + ids, len(prompt), [])
            assert max(abs(a - b) for a, b in zip(logprobs, base)) > MIN_EFFECT


def test_qwen35_concurrent_mixed_batch_equals_sequential(server_composite, qwen35):
    model, _, _, _, prompts = qwen35
    jobs = [(name, tuple(p)) for p in prompts[None] + prompts["both"] for name in (None, "both", "both2")]

    def run(job):
        name, prompt = job
        return complete(server_composite, model if name is None else f"{model}:{name}", list(prompt))

    sequential = [run(j) for j in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        concurrent_ = list(pool.map(run, jobs))
    for job, (ids_s, lp_s), (ids_c, lp_c) in zip(jobs, sequential, concurrent_):
        assert ids_s == ids_c, job
        assert max(abs(a - b) for a, b in zip(lp_s, lp_c)) < TOL, job


def test_qwen35_fused_checkpoint_with_global_expert_adapter(qwen35):
    model, fused, adapters, ref, prompts = qwen35
    with SGLangServer(fused, ["--kt-expert-lora-path", str(adapters["global"]), "--chunked-prefill-size",
                              str(CHUNK)]) as server:
        for prompt in prompts["global"]:
            ids, logprobs = complete(server, fused, prompt)
            assert_matches(ref, prompt, ids, logprobs, [adapters["global"]])
            base = ref.logprobs(prompt + ids, len(prompt), [])
            assert max(abs(a - b) for a, b in zip(logprobs, base)) > MIN_EFFECT


def test_qwen35_without_the_kernel_matches_reference(qwen35):
    """--kt-moe off: SGLang's own MoE; what is compared is the CPU GDN, norm and attention path."""
    model, _, _, ref, prompts = qwen35
    with SGLangServer(model, ["--kt-moe", "off", "--chunked-prefill-size", str(CHUNK)]) as server:
        for prompt in prompts[None]:
            ids, logprobs = complete(server, model, prompt)
            assert_matches(ref, prompt, ids, logprobs, [])
