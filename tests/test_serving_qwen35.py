"""End-to-end: a tiny Qwen3.5-MoE (3 Gated DeltaNet layers + 1 gated full-attention layer, shared expert) served
by stock SGLang + the kt_serve plugin on CPU, against HF transformers fp32 (its pure-torch GDN path) with the LoRA
merged in plain torch (kt_serve.harness.reference.HFReference).

Three servers: the official layout (per-expert keys, as transformers saves it) with composite adapters per request;
the fused-expert layout (``mlp.experts.gate_up_proj [E, 2I, H]``) with a global ``--kt-expert-lora-path``; and
``--kt-moe off`` (SGLang's own MoE path: the CPU GDN ops on their own). Prompts are longer than
``--chunked-prefill-size`` and decode many tokens, so chunked prefill, the conv / delta-rule state carried between
chunks and the recurrent decode step are all compared.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

import kt_serve
from kt_serve.formats.export import convert_adapter
from kt_serve.harness.server import SGLangServer
from kt_serve.harness.tiny_model import build_tiny_moe
from qwen35_adapters import text_config, write_qwen35_adapter
from kt_serve.harness.reference import HFReference
from test_serving import MIN_EFFECT, TOL, assert_matches_reference, concurrent_equals_sequential
from test_serving import complete as serving_complete

DATA_DIR = Path(kt_serve.__file__).parent / "data" / "example_dataset"
PROMPT_LEN, MAX_TOKENS, CHUNK = 20, 12, 8
CHECKED_DECODE = 6  # generated tokens compared: the prompt and these steps are checked for near-ties and bf16 error
# Routing near-tie, as the DeepSeek and quantized serving tests: bf16 serving moves router probabilities by up to
# ~2e-3, so a margin under 3e-3 may route differently (at 1e-3, one token was 0.043 nats off, its neighbours 0.017).
TIE_MARGIN = 3e-3
# Beyond routing ties, the tiny model amplifies bf16 rounding on some prompts: transformers' own model run in bf16 is
# up to 0.02-0.08 nats off its fp32 self there (measured with and without the trained adapter). Such a prompt cannot
# tell a correct bf16 server from a wrong one, so prompts are kept only where the bf16 twin is within BF16_SLACK.
BF16_SLACK = TOL / 2
MAX_CANDIDATES = 400  # random prompts tried per adapter set before the fixture gives up
ARGS = ["--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", "6", "--max-running-requests", "8",
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


def train_adapter(out_dir, model_dir):
    """A Qwen3.5 adapter trained by kt_serve.train (pirate data, lora_target: all: every projection, linear
    attention's in_proj_a / in_proj_b, the shared-expert gate and the routers included)."""
    from kt_serve.train import load_config, train

    cfg = load_config(None, [f"model_name_or_path={model_dir}", f"output_dir={out_dir}", "dataset=pirate_alpaca",
                             f"dataset_dir={DATA_DIR}", "cutoff_len=64", "lora_target=all",
                             "max_steps=12", "learning_rate=1e-2", "per_device_train_batch_size=2", "logging_steps=4",
                             "save_steps=1000", "kt_config.threads=2", "seed=3"])
    history = train(cfg)
    assert history[-1]["loss"] < history[0]["loss"]
    return Path(out_dir)


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
        "lora_experts": write_qwen35_adapter(workdir / "lora_experts", model, seed=5, lora_experts=2),
        "trained": train_adapter(workdir / "trained", model),
    }
    convert_adapter(adapters["trained"], merged_dir=workdir / "trained_merged")  # one PEFT dir, per-expert keys
    adapters["trained_merged"] = workdir / "trained_merged"
    ref = HFReference(model)
    prompts = pick_prompts(ref, {None: [], "both": [adapters["both"]], "nonexpert": [adapters["nonexpert"]],
                                 "global": [adapters["global"]], "trained": [adapters["trained"]],
                                 "lora_experts": [adapters["lora_experts"]]})
    return model, fused, adapters, ref, prompts


def pick_prompts(ref, adapter_sets: dict) -> dict:
    """Per adapter set (name -> adapter dirs), two prompts whose reference routing has no near-tie inside the prompt
    and its first greedy decode steps (past one, a bf16 server may pick another expert: a different computation;
    assert_matches stops at the first one after it), and on which bf16 arithmetic itself stays close to fp32. About
    one random prompt in five qualifies under a given set, so each set gets its own."""
    twin = copy.deepcopy(ref.model).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = {}
    for name, dirs in adapter_sets.items():
        prompts[name] = []
        for _ in range(MAX_CANDIDATES):
            prompt = torch.randint(3, 1000, (PROMPT_LEN,), generator=g).tolist()
            ids = greedy(ref, prompt, dirs, CHECKED_DECODE)
            want, first_tie = ref.logprobs_and_routing(ids, PROMPT_LEN, dirs, tie_margin=TIE_MARGIN)
            if first_tie >= PROMPT_LEN + CHECKED_DECODE and bf16_error(twin, ref, ids, want) < BF16_SLACK:
                prompts[name].append(prompt)
                if len(prompts[name]) == 2:
                    break
        assert len(prompts[name]) == 2, f"adapter set {name}: {MAX_CANDIDATES} random prompts, too few without a tie"
    return prompts


def bf16_error(twin, ref, ids, want):
    """Largest |logprob| difference between the reference (its adapters merged, fp32) and the same weights in bf16
    (``twin``), over the tokens after the prompt."""
    twin.load_state_dict(ref.model.state_dict())  # rounds the merged fp32 weights to bf16
    with torch.no_grad():
        logp = torch.log_softmax(twin(torch.tensor([ids])).logits[0].float(), dim=-1)
    return max(abs(float(logp[i - 1, ids[i]]) - w) for i, w in zip(range(PROMPT_LEN, len(ids)), want))


def greedy(ref, prompt, dirs, n):
    """The prompt and the reference's n greedy tokens after it (adapters merged)."""
    ids = list(prompt)
    ref.logprobs(ids, 1, dirs)  # merges dirs into ref.model
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref.model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def complete(server, model, prompt):
    """Greedy MAX_TOKENS decode steps, past any EOS."""
    return serving_complete(server, model, prompt, max_tokens=MAX_TOKENS, ignore_eos=True)


def assert_matches(ref, prompt, ids, logprobs, dirs):
    """test_serving's check at this file's tie margin over the first CHECKED_DECODE generated tokens (the window the
    fixture checked), at least two of them."""
    n = CHECKED_DECODE
    return assert_matches_reference(ref, prompt, ids[:n], logprobs[:n], dirs, tie_margin=TIE_MARGIN, min_compared=2)


@pytest.fixture(scope="module")
def server_composite(qwen35, tmp_path_factory):
    model, _, adapters, _, _ = qwen35
    cache = tmp_path_factory.mktemp("lora_cache")
    args = ARGS + ["--kt-lora-cache-dir", str(cache), "--lora-paths",
                   *(f"{n}={adapters[n]}" for n in ("both", "nonexpert", "both2", "trained", "trained_merged",
                                                     "lora_experts"))]
    with SGLangServer(model, args) as server:
        server.lora_cache = cache
        yield server


def test_qwen35_lora_nothing_can_apply_is_refused(server_composite, qwen35, tmp_path):
    """An adapter with LoRA on the GDN short convolution answers /load_lora_adapter with a 4xx in one line naming the
    module, writes no split, cannot be requested, and the server keeps serving."""
    from kt_serve.formats import load_adapter_dir, write_kt_sft_output

    model, _, adapters, ref, prompts = qwen35
    good = load_adapter_dir(adapters["both"])
    channels, kernel = 2 * text_config(model)["linear_key_head_dim"] * text_config(model)["linear_num_key_heads"], 4
    module = "model.language_model.layers.0.linear_attn.conv1d"
    nonexpert = {**good.nonexpert, f"{module}.lora_A.weight": torch.zeros(good.rank, kernel, dtype=torch.bfloat16),
                 f"{module}.lora_B.weight": torch.zeros(channels, good.rank, dtype=torch.bfloat16)}
    bad = write_kt_sft_output(tmp_path / "bad", nonexpert=nonexpert, experts=good.experts,
                              adapter_config={"r": good.rank, "lora_alpha": good.alpha},
                              base_model_name_or_path=str(model))
    splits = sorted(server_composite.lora_cache.iterdir())
    status, body = server_composite.post("/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    message = body.get("error_message") or body.get("message") or str(body)
    assert 400 <= status < 500 and not body.get("success", False), body
    assert f"LoRA on {module}: SGLang has no LoRA layer for Qwen3.5's short convolution" in message, message
    assert "\n" not in message, message
    assert sorted(server_composite.lora_cache.iterdir()) == splits
    with pytest.raises(openai.APIStatusError):
        complete(server_composite, f"{model}:bad", prompts["both"][0])
    ids, logprobs = complete(server_composite, f"{model}:both", prompts["both"][0])
    assert_matches(ref, prompts["both"][0], ids, logprobs, [adapters["both"]])


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


def test_qwen35_trained_adapter_converts_and_serves(server_composite, qwen35):
    """kt_serve.train's output dir, and the merged PEFT dir kt_serve.convert makes of it, serve per request as the
    fp32 reference with the trained LoRA merged, and move the logprobs."""
    model, _, adapters, ref, prompts = qwen35
    for prompt in prompts["trained"]:
        ids, logprobs = complete(server_composite, f"{model}:trained", prompt)
        assert_matches(ref, prompt, ids, logprobs, [adapters["trained"]])
        base = ref.logprobs(prompt + ids, len(prompt), [])
        assert max(abs(a - b) for a, b in zip(logprobs, base)) > MIN_EFFECT
        ids_m, logprobs_m = complete(server_composite, f"{model}:trained_merged", prompt)
        assert ids_m == ids and max(abs(a - b) for a, b in zip(logprobs, logprobs_m)) < TOL


def test_qwen35_lora_experts_beside_the_gated_shared_expert(server_composite, qwen35, tmp_path):
    """LoRA Experts are added to the MoE block's output, not through the shared expert's sigmoid gate: within TOL
    of the reference (which adds them after the whole block), and far from the same adapter without them."""
    from test_lora_experts import rewrite

    model, _, adapters, ref, prompts = qwen35
    stripped = rewrite(adapters["lora_experts"], tmp_path / "stripped",
                       lambda t: [t.pop(k) for k in [k for k in t if ".lora_experts." in k]])
    for prompt in prompts["lora_experts"]:
        ids, logprobs = complete(server_composite, f"{model}:lora_experts", prompt)
        keep = assert_matches(ref, prompt, ids, logprobs, [adapters["lora_experts"]])
        other = ref.logprobs(prompt + ids, len(prompt), [stripped])
        assert max(abs(logprobs[i] - other[i]) for i in keep) > MIN_EFFECT


def test_qwen35_concurrent_mixed_batch_equals_sequential(server_composite, qwen35):
    model, _, _, _, prompts = qwen35
    jobs = [(name, tuple(p)) for p in prompts[None] + prompts["both"] for name in (None, "both", "both2")]
    jobs += [("lora_experts", tuple(p)) for p in prompts["lora_experts"]]

    def run(job):
        name, prompt = job
        return complete(server_composite, model if name is None else f"{model}:{name}", list(prompt))

    concurrent_equals_sequential(run, jobs)


def test_qwen35_decode_steps_ran_in_one_kernel_call(server_composite):
    """The reference comparisons above went through the one-call Qwen3.5 decode step (cpu_host/decode_stack.py),
    SGLang's LoRA on the linear attention, q/k/v, o and shared expert inside it; requests whose adapter holds gate
    LoRA (trained: router, shared-expert gate, in_proj_ba) or LoRA Experts took the layer loop, saying so."""
    from sglang.srt.utils.common import cpu_has_amx_support

    if cpu_has_amx_support():  # SGLang's own intel_amx kernels run the layers there: no stack
        return
    log = server_composite.log_tail(100000)
    assert re.search(r"decode steps in one kernel call \(4 layers and the final norm\)", log), log[-3000:]
    assert "decode steps apply SGLang's LoRA of the layers' projections inside that call" in log, log[-3000:]
    assert "this decode batch keeps SGLang's layer loop: gate LoRA" in log, log[-3000:]


def test_qwen35_fused_checkpoint_with_global_expert_adapter(qwen35):
    """Also the router path of Qwen2MoeSparseMoeBlock in one kernel call (moe_block.router_experts; no router LoRA
    is loaded here), the shared expert and its sigmoid gate added by SGLang's block around it; and the Gemma
    RMSNorm layers in C++ (cpu_host/norm.py)."""
    from sglang.srt.utils.common import cpu_has_amx_support

    model, fused, adapters, ref, prompts = qwen35
    with SGLangServer(fused, ["--kt-expert-lora-path", str(adapters["global"]), "--chunked-prefill-size",
                              str(CHUNK)]) as server:
        for prompt in prompts["global"]:
            ids, logprobs = complete(server, fused, prompt)
            assert_matches(ref, prompt, ids, logprobs, [adapters["global"]])
            base = ref.logprobs(prompt + ids, len(prompt), [])
            assert max(abs(a - b) for a, b in zip(logprobs, base)) > MIN_EFFECT
        log = server.log_tail(100000)
    if not cpu_has_amx_support():  # with AMX the router gate is SGLang's (not packed): its own path, logged
        assert "MoE blocks in one kernel call (router gate, softmax top-k, routed experts)" in log, log[-3000:]
        assert "MoE blocks keep SGLang's router path" not in log, log[-3000:]
        assert "Gemma RMSNorm on the kt_serve kernel" in log, log[-3000:]  # cpu_host/norm.py: the layer norms above
        assert "gated RMSNorm on the kt_serve kernel" in log, log[-3000:]  # models/qwen35.py: GDN's output norm
        # the GDN decode steps, prefill scans and norms took C++ for every batch: nothing said it fell back to torch
        assert "on torch formulas" not in log and "on its torch formula" not in log, log[-3000:]


def test_qwen35_without_the_kernel_matches_reference(qwen35):
    """--kt-moe off: SGLang's own MoE; what is compared is the CPU GDN, norm and attention path."""
    model, _, _, ref, prompts = qwen35
    with SGLangServer(model, ["--kt-moe", "off", "--chunked-prefill-size", str(CHUNK)]) as server:
        for prompt in prompts[None]:
            ids, logprobs = complete(server, model, prompt)
            assert_matches(ref, prompt, ids, logprobs, [])
