"""End-to-end: tiny DeepSeek-V2 models served by stock SGLang + the kt_serve plugin on CPU, against fp32 HF.

DeepSeek differs from Qwen where the plugin could go wrong: grouped top-k routing, shared experts beside the routed
ones (kept out of the routed FusedMoE), routed_scaling_factor applied by the model after the experts, and MLA
attention, whose absorbed forward never runs kv_b_proj (its LoRA goes onto w_kc / w_vc per token). Two models, one
server each: MLA without q compression (q_proj, kv_a_proj_with_mqa) and with q_lora_rank (q_a_proj fused with
kv_a_proj_with_mqa, q_b_proj). Each serves a composite adapter with LoRA on every MLA projection + shared expert +
routed experts, and a second adapter, per request and mixed in one batch.
"""

from __future__ import annotations

import openai
import pytest
import torch

from kt_serve.formats import write_kt_sft_output
from kt_serve.harness.server import SGLangServer
from kt_serve.harness.tiny_model import SERVING_OVERRIDES, build_tiny_moe
from kt_serve.harness.reference import HFReference, model_dims, random_adapter
from test_serving import (LORA_ARGS, MIN_EFFECT, assert_matches_reference, complete,
                          concurrent_equals_sequential, pick_prompts)

DEEPSEEK_SERVING_CONFIG = SERVING_OVERRIDES["deepseek_v2"]
# The two MLA layouts: tiny_model's default (no q compression) and DeepSeek-V2/V3's q_lora_rank one.
MLA_CONFIGS = {"no_q_lora": {}, "q_lora_rank": {"q_lora_rank": 24}}
# Routing near-ties closer than this end the comparison (as in test_serving_quantized): with LoRA on every MLA
# projection, bf16 serving moves router probabilities by up to ~2e-3 (one expert flip seen at 1.8e-3: 0.39 nats).
TIE_MARGIN = 3e-3


def write_adapter(out_dir, model, nonexpert, experts):
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[1] for k in nonexpert} |
                     ({"gate_proj", "up_proj", "down_proj"} if experts else set()))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": targets, "lora_dropout": 0.0,
              "bias": "none", "task_type": "CAUSAL_LM"}
    return write_kt_sft_output(out_dir, nonexpert=nonexpert, experts=experts, adapter_config=config,
                               base_model_name_or_path=str(model), overwrite=True)


def mla_adapter(model, seed, **kinds):
    """random_adapter with its query-side LoRA (q_proj, q_a_proj, q_b_proj) 1.5x larger: it moves attention weights
    only, and must move some logprob by MIN_EFFECT on every prompt to show it is applied."""
    nonexpert, experts = random_adapter(model, seed=seed, rank=4, **kinds)
    query = tuple(f".self_attn.{q}." for q in ("q_proj", "q_a_proj", "q_b_proj"))
    return {k: v * 1.5 if any(q in k for q in query) else v for k, v in nonexpert.items()}, experts


def without(nonexpert, part):
    return {k: v for k, v in nonexpert.items() if f".{part}." not in k}


@pytest.fixture(scope="module", params=sorted(MLA_CONFIGS))
def deepseek(request, tmp_path_factory):
    """(model, adapters, reference, prompts, parts). Adapter "both": every MLA projection + shared expert + router
    (the plugin's gate LoRA) + routed experts; ``parts`` maps each of its parts to a reference-only adapter without it. Adapter "second": without q
    compression the MLA projections only (SGLang's half alone); with q_lora_rank kv_a_proj_with_mqa + kv_b_proj (a
    lone kv_a beside the fused q_a_proj) + routed experts."""
    workdir = tmp_path_factory.mktemp(f"serving_deepseek_{request.param}")
    model = build_tiny_moe(workdir / "model", "deepseek_v2", **DEEPSEEK_SERVING_CONFIG, **MLA_CONFIGS[request.param])
    nonexpert, experts = mla_adapter(model, 11, shared_expert=True, gates=True)
    mla = list(model_dims(model)["attention"])
    adapters = {"both": write_adapter(workdir / "both", model, nonexpert, experts)}
    second, second_experts = mla_adapter(model, 12)
    if request.param == "q_lora_rank":
        second = {k: v for k, v in second.items() if ".kv_a_proj_with_mqa." in k or ".kv_b_proj." in k}
    else:
        second_experts = {}
    adapters["second"] = write_adapter(workdir / "second", model, second, second_experts)
    parts = {"routed experts": write_adapter(workdir / "no_experts", model, nonexpert, {}),
             "shared expert": write_adapter(workdir / "no_shared", model, without(nonexpert, "shared_experts"),
                                            experts),
             "router": write_adapter(workdir / "no_router", model, without(nonexpert, "mlp.gate"), experts)}
    for module in mla:
        parts[module] = write_adapter(workdir / f"no_{module}", model, without(nonexpert, module), experts)
    # KT-FT LoRA Experts (3 of them) beside every MLA projection, the router and routed experts; "mlp" in
    # target_modules, as KT's converter writes it
    adapters["lora_experts"] = write_adapter(workdir / "lora_experts", model,
                                             *mla_adapter(model, 14, gates=True, lora_experts=3))
    ref = HFReference(model)
    prompts = pick_prompts(ref, [[], [adapters["both"]], [adapters["second"]]], n=2, tie_margin=TIE_MARGIN)
    return str(model), adapters, ref, prompts, parts


@pytest.fixture(scope="module")
def le_prompts(deepseek):
    """Prompts without a routing near-tie under the LoRA Experts adapter (and base)."""
    _, adapters, ref, _, _ = deepseek
    return pick_prompts(ref, [[], [adapters["lora_experts"]]], n=2, seed=1, tie_margin=TIE_MARGIN)


@pytest.fixture(scope="module")
def server_ds(deepseek):
    model, adapters, _, _, _ = deepseek
    with SGLangServer(model, LORA_ARGS + ["--lora-paths", *(f"{n}={p}" for n, p in adapters.items())]) as server:
        yield server


def served(model, name):
    return model if name is None else f"{model}:{name}"


def check(ref, prompt, ids, logprobs, adapter_dirs) -> list[int]:
    """Served logprobs within TOL of the reference up to its first routing near-tie; returns those positions."""
    return assert_matches_reference(ref, prompt, ids, logprobs, adapter_dirs, tie_margin=TIE_MARGIN)


def test_every_adapter_part_matches_reference(server_ds, deepseek):
    """Base and both adapters within TOL of the fp32 reference; without any one part of "both" (each MLA
    projection, the shared expert, the router, the routed experts) the reference is far off, so every part was
    applied."""
    model, adapters, ref, prompts, parts = deepseek
    for prompt in prompts:
        for name in (None, "both", "second"):
            ids, logprobs = complete(server_ds, served(model, name), prompt)
            keep = check(ref, prompt, ids, logprobs, [] if name is None else [adapters[name]])
            if name is None:
                continue
            others = {"base": []} if name == "second" else {"base": [], **{part: [d] for part, d in parts.items()}}
            for part, dirs in others.items():
                other = ref.logprobs(prompt + ids, len(prompt), dirs)
                assert max(abs(logprobs[i] - other[i]) for i in keep) > MIN_EFFECT, (name, part)


def test_concurrent_mixed_batch_equals_sequential(server_ds, deepseek, le_prompts):
    """Base and every adapter in flight together (kv_b_proj's correction per token segment, LoRA Experts on some
    rows) give each request its sequential result."""
    model, adapters, ref, prompts, _ = deepseek
    jobs = [(name, tuple(prompt)) for prompt in prompts for name in (None, "both", "second")]
    jobs += [("lora_experts", tuple(prompt)) for prompt in le_prompts]

    def run(job):
        name, prompt = job
        return complete(server_ds, served(model, name), list(prompt))

    for (name, prompt), (ids, logprobs) in concurrent_equals_sequential(run, jobs).items():
        check(ref, list(prompt), ids, logprobs, [] if name is None else [adapters[name]])


def test_lora_on_a_module_the_mla_layer_lacks_is_refused(server_ds, deepseek, tmp_path):
    """q_a_proj without q compression, q_proj with it: /load_lora_adapter of a composite adapter with it answers
    4xx in one line naming the module, the adapter cannot be requested, and the server keeps serving."""
    model, adapters, ref, prompts, _ = deepseek
    nonexpert, experts = random_adapter(model, seed=13, rank=4)
    dims = model_dims(model)
    if "self_attn.q_b_proj" in dims["attention"]:
        foreign, fan_out = "self_attn.q_proj", dims["attention"]["self_attn.q_b_proj"][1]
    else:
        foreign, fan_out = "self_attn.q_a_proj", 16
    for layer in range(dims["L"]):
        nonexpert[f"model.layers.{layer}.{foreign}.lora_A.weight"] = torch.zeros(4, dims["H"], dtype=torch.bfloat16)
        nonexpert[f"model.layers.{layer}.{foreign}.lora_B.weight"] = torch.zeros(fan_out, 4, dtype=torch.bfloat16)
    bad = write_adapter(tmp_path / "bad", model, nonexpert, experts)
    status, body = server_ds.post("/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    message = body.get("error_message") or body.get("message") or str(body)
    assert 400 <= status < 500 and not body.get("success", False), body
    assert foreign in message and "\n" not in message, message
    with pytest.raises(openai.APIStatusError):
        complete(server_ds, f"{model}:bad", prompts[0])
    ids, logprobs = complete(server_ds, f"{model}:both", prompts[0])
    check(ref, prompts[0], ids, logprobs, [adapters["both"]])


def test_lora_experts_are_added_unscaled_beside_the_shared_expert(server_ds, deepseek, le_prompts, tmp_path):
    """DeepSeek scales its routed experts by routed_scaling_factor before adding the shared expert; LoRA Experts
    are added to the block's output unscaled (the reference adds them after the whole block): within TOL, and far
    from the same adapter without them."""
    from test_lora_experts import rewrite

    model, adapters, ref, prompts, _ = deepseek
    stripped = rewrite(adapters["lora_experts"], tmp_path / "stripped",
                       lambda t: [t.pop(k) for k in [k for k in t if ".lora_experts." in k]])
    for prompt in le_prompts:
        ids, logprobs = complete(server_ds, f"{model}:lora_experts", prompt)
        keep = check(ref, prompt, ids, logprobs, [adapters["lora_experts"]])
        other = ref.logprobs(prompt + ids, len(prompt), [stripped])
        assert max(abs(logprobs[i] - other[i]) for i in keep) > MIN_EFFECT


# -- kv_b_proj's LoRA in the absorbed MLA forward, without a server --------------------------------------------------
def test_kv_b_correction_equals_merged_lora_weights():
    """The absorbed forward's q_nope·w_kc and latent·w_vc plus kv_b_proj's LoRA correction, per token segment (slot
    0 rank 4, slot 1 the base (rank 0), slot 2 rank 2 with junk past its rank), equal q_nope against W_k and the
    latent through W_v of each token's merged kv_b_proj weight W + s·B·A, computed in float64."""
    from types import SimpleNamespace

    from kt_serve.sglang_plugin.models import deepseek_mla

    g = torch.Generator().manual_seed(0)
    H, nope, v, kv, rmax = 3, 8, 6, 16, 4
    ranks, scalings, segments = [4, 0, 2], [2.0, 0.0, 0.5], [(0, 3), (1, 2), (2, 4), (0, 1)]  # (slot, tokens)
    T = sum(n for _, n in segments)
    W = (torch.randn(H * (nope + v), kv, generator=g) * 0.3).double()
    A = (torch.randn(3, rmax, kv, generator=g) * 0.3).bfloat16()
    B = (torch.randn(3, H * (nope + v), rmax, generator=g) * 0.3).bfloat16()
    info = SimpleNamespace(seg_lens_cpu=torch.tensor([n for _, n in segments]), num_segments=len(segments),
                           weight_indices_cpu=torch.tensor([slot for slot, _ in segments]), use_cuda_graph=False,
                           lora_ranks_cpu=torch.tensor(ranks), scalings_cpu=torch.tensor(scalings))
    attn = SimpleNamespace(num_local_heads=H, qk_nope_head_dim=nope, v_head_dim=v, kv_b_proj=SimpleNamespace(
        A_buffer=A, B_buffer=B, lora_backend=SimpleNamespace(batch_info=info)))

    def triton_only(*args):
        raise AssertionError("SGLang's Triton correction was called for CPU tensors")

    per_head = lambda w: w.view(H, nope + v, kv)  # noqa: E731  rows of head h: its nope K rows, then its V rows
    merged = torch.stack([per_head(W + scalings[s] * B[s, :, :ranks[s]].double() @ A[s, :ranks[s]].double())
                          for s, n in segments for _ in range(n)])                   # [T, H, nope + v, kv]
    q_nope = torch.randn(T, H, nope, generator=g).bfloat16()
    latent = torch.randn(T, H, kv, generator=g).bfloat16()
    base_q = torch.einsum("thn,hnk->thk", q_nope.double(), per_head(W)[:, :nope])
    base_v = torch.einsum("thk,hvk->thv", latent.double(), per_head(W)[:, nope:])
    want_q = torch.einsum("thn,thnk->thk", q_nope.double(), merged[:, :, :nope])
    want_v = torch.einsum("thk,thvk->thv", latent.double(), merged[:, :, nope:])

    got_q = deepseek_mla.kv_b_q_correction(triton_only, attn, q_nope, base_q.bfloat16())
    got_v = deepseek_mla.kv_b_v_correction(triton_only, attn, latent, base_v.reshape(T, H * v).bfloat16())
    for got, want, base in ((got_q, want_q, base_q), (got_v.view(T, H, v), want_v, base_v)):
        tol = 1e-2 * want.abs().max()  # bf16 output rounding
        assert (got.double() - want).abs().max() < tol
        assert (base - want).abs().max() > 20 * tol  # the LoRA moved it
    info.seg_lens_cpu = torch.tensor([3, 2, 4, 2])
    with pytest.raises(RuntimeError, match="kv_b_proj LoRA"):
        deepseek_mla.kv_b_q_correction(triton_only, attn, q_nope, base_q.bfloat16())
