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
from kt_serve.harness.reference import HFReference, write_kt_adapter
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


def emulated_server(model, adapters: dict, args=LORA_ARGS) -> SGLangServer:
    """A server through the accelerator host's code, the adapters loaded by name."""
    return SGLangServer(model, [*args, "--lora-paths", *(f"{n}={p}" for n, p in adapters.items())], env=EMULATE)


@pytest.fixture(scope="module")
def server_deepseek(deepseek):
    model, adapters, _, _ = deepseek
    with emulated_server(model, adapters) as server:
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
    with emulated_server(model, adapters) as server:
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
    with emulated_server(model, adapters, q35.ARGS) as server:
        yield server


def test_qwen35_base_and_composite_per_request_and_mixed(server_qwen35, qwen35):
    model, adapters, ref, prompts = qwen35
    for name in (None, "both"):
        for prompt in prompts[name]:
            ids, logprobs = q35.complete(server_qwen35, served(model, name), prompt)
            q35.assert_matches(ref, prompt, ids, logprobs, [] if name is None else [adapters[name]])
    jobs = [(name, tuple(p)) for name in (None, "both") for p in prompts[name]]
    mixed_batch_matches_reference(server_qwen35, model, ref, jobs, adapters, q35.complete, q35.assert_matches)


# -- launch on an accelerator host: graph decision, gate LoRA, refusals -------------------------------------------
GRAPHS_OFF_SPELLINGS = {
    "no flag (kt_serve decides)": [],
    "--disable-cuda-graph": ["--disable-cuda-graph"],
    "per-phase backends": ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"],
    "per-phase switches": ["--disable-decode-cuda-graph", "--disable-prefill-cuda-graph"],
    "JSON config": ["--cuda-graph-config", '{"decode": {"backend": "disabled"}, "prefill": {"backend": "disabled"}}'],
}


@pytest.fixture
def gpu_launch(tmp_path, monkeypatch):
    """``launch(flags) -> ServerArgs``: SGLang's parser with our flags, our BEFORE hook as on a CUDA host
    (--device cuda), SGLang's own from_cli_args and publish (as a scheduler resolves them); the published
    context is reset afterwards."""
    import argparse

    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    from kt_serve.sglang_plugin import args

    model = build_tiny_moe(tmp_path / "qwen3", "qwen3_moe")

    def launch(flags):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args.add_cli_args_hook(None, parser)
        namespace = parser.parse_args(["--model-path", str(model), "--device", "cuda", *flags])
        args.accelerator_launch_hook(namespace)
        server_args = ServerArgs.from_cli_args(namespace)
        runtime_context.publish(server_args, role="scheduler")
        return server_args

    yield launch
    runtime_context.reset_context()


@pytest.mark.parametrize("spelling", sorted(GRAPHS_OFF_SPELLINGS))
def test_graphs_fully_off_by_any_spelling_and_gate_lora_accepted(gpu_launch, spelling, caplog):
    """A plain launch gets graphs off from the plugin (one log line naming what and why); with graphs off by any
    spelling SGLang's own cuda_graph_fully_disabled() holds and gate LoRA is accepted."""
    from kt_serve.sglang_plugin.accelerator import graphs_fully_off
    from kt_serve.sglang_plugin.adapters.gate_lora import GateLoRA
    from test_gate_lora import tiny_model

    with caplog.at_level("WARNING", logger="kt_serve.sglang_plugin.args"):
        server_args = gpu_launch(GRAPHS_OFF_SPELLINGS[spelling])
    turned_off = [r.getMessage() for r in caplog.records if "CUDA graphs turned off" in r.getMessage()]
    if spelling.startswith("no flag"):
        assert turned_off == ["kt_serve: CUDA graphs turned off for decode and prefill (SGLang's default captures "
                              "them): the routed experts run in the kt_serve CPU kernel, which a graph cannot "
                              "capture yet"]
    else:
        assert turned_off == []
    assert graphs_fully_off(server_args)
    gates = GateLoRA(lambda: None)
    gates.attach(tiny_model(), server_args)
    assert gates.refusal is None


def test_gate_lora_refused_where_sglang_captures_graphs(gpu_launch):
    """--kt-moe off leaves SGLang's graphs on (decode FULL): gate LoRA, which runs outside graphs, is refused."""
    from kt_serve.sglang_plugin.adapters.gate_lora import GateLoRA
    from test_gate_lora import tiny_model

    server_args = gpu_launch(["--kt-moe", "off"])
    gates = GateLoRA(lambda: None)
    gates.attach(tiny_model(), server_args)
    assert "--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled" in gates.refusal


def test_explicit_graph_capture_refused_naming_the_flag():
    import argparse

    from kt_serve.sglang_plugin.accelerator import decide_graph_backends

    namespace = argparse.Namespace(cuda_graph_backend_decode="full", cuda_graph_backend_prefill=None)
    with pytest.raises(SystemExit, match=r"^kt_serve: --cuda-graph-backend-decode full: the routed experts run in "
                                         r"the kt_serve CPU kernel, which a CUDA graph cannot capture yet; use "
                                         r"--cuda-graph-backend-decode disabled"):
        decide_graph_backends(namespace)
    namespace = argparse.Namespace(cuda_graph_config={"prefill": {"backend": "breakable"}})
    with pytest.raises(SystemExit, match=r"--cuda-graph-config prefill.backend=breakable"):
        decide_graph_backends(namespace)


LAYOUT_REFUSALS = [
    (["--ep-size", "2"], "kt_serve: --ep-size 2: the kt_serve kernel holds each MoE layer's routed experts in one CPU "
                         "process; drop --ep-size (with --tp-size each rank holds a slice of every expert), or "
                         "pass --kt-moe off"),
    (["--enable-eplb"], "kt_serve: --enable-eplb / --ep-num-redundant-experts / --init-expert-location: the kt_serve "
                        "kernel holds each routed expert once"),
    (["--ep-num-redundant-experts", "2"], "kt_serve: --enable-eplb / --ep-num-redundant-experts"),
    (["--moe-a2a-backend", "deepep"], "kt_serve: --moe-a2a-backend deepep: the kt_serve kernel takes SGLang's "
                                      "standard dispatch only"),
    (["--attn-dp-size", "2", "--enable-lora"], "kt_serve: DP attention (--attn-dp-size / --enable-dp-attention) "
                                               "with LoRA"),
    (["--enable-dp-attention", "--dp-size", "2", "--lora-paths", "a=/x"], "kt_serve: DP attention"),
    (["--kt-weight-path", "/tmp"], "kt_serve: --kt-weight-path is SGLang's own KTransformers wrapper"),
]


@pytest.mark.parametrize("flags, message", LAYOUT_REFUSALS)
def test_parallel_layouts_the_kernel_does_not_serve_are_refused(flags, message, tmp_path):
    """Each refused at launch with one line naming the flag and what to use instead (SGLang's parser, our hook);
    DP attention without LoRA and --kt-moe off pass."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from kt_serve.sglang_plugin import args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args.add_cli_args_hook(None, parser)
    with pytest.raises(SystemExit) as refused:
        args.accelerator_launch_hook(parser.parse_args(["--model-path", str(tmp_path), *flags]))
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), str(refused.value)
    assert args.accelerator_launch_hook(parser.parse_args(["--model-path", str(tmp_path), "--kt-moe", "off", *flags])) \
        is None
    if "--attn-dp-size" in flags:
        assert args.accelerator_launch_hook(parser.parse_args(["--model-path", str(tmp_path), "--attn-dp-size", "2"])) \
            is None


def test_refusals_reach_the_user_of_launch_server(tmp_path):
    """Through the real launcher: an explicit graph backend on a CUDA device and --ep-size, each refused in one
    line before anything loads."""
    from kt_serve.harness.server import ServerStartError, SGLangServer

    model = build_tiny_moe(tmp_path / "qwen3", "qwen3_moe")
    for device, flags, message in [
            ("cpu", ["--ep-size", "2"], LAYOUT_REFUSALS[0][1]),
            ("cuda", ["--cuda-graph-backend-decode", "full"],
             "kt_serve: --cuda-graph-backend-decode full: the routed experts run in the kt_serve CPU kernel")]:
        with pytest.raises(ServerStartError) as err:
            with SGLangServer(model, flags, device=device, env={"SGLANG_USE_CPU_ENGINE": "1"}, startup_timeout=120):
                pass
        assert message in str(err.value), str(err.value)[-2000:]


def test_routed_scale_owed_by_the_method(monkeypatch):
    """1.0 where there is no factor, where TopK fused it, or where the model applies it; the factor where the model
    leaves it to the runner; refused on an accelerator for a model whose convention is unknown."""
    from types import SimpleNamespace

    from sglang.srt.models import deepseek_v2

    from kt_serve.sglang_plugin import accelerator

    def layer(factor, fused=False):
        return SimpleNamespace(moe_runner_config=SimpleNamespace(routed_scaling_factor=factor), layer_id=3,
                               should_fuse_routed_scaling_factor_in_topk=fused)

    # a stand-in of DeepSeek's MoE block: its class name and module, as the decision looks them up
    block = type("DeepseekV2MoE", (), {"__module__": deepseek_v2.__name__})()
    block.experts = SimpleNamespace(quant_method=object())
    assert accelerator.routed_scale(block, layer(2.5)) == 1.0          # CPU: the model multiplies
    monkeypatch.setattr(deepseek_v2, "_is_cuda", True)
    assert accelerator.routed_scale(block, layer(2.5)) == 2.5          # CUDA: left to the MoE method
    assert accelerator.routed_scale(block, layer(2.5, fused=True)) == 1.0
    assert accelerator.routed_scale(block, layer(None)) == 1.0

    class OtherMoE:
        pass

    monkeypatch.setattr(accelerator, "cpu_engine", lambda: False)
    with pytest.raises(ValueError, match=r"^kt_serve: OtherMoE \(MoE layer 3\) scales its routed experts by "
                                         r"routed_scaling_factor 2.5; .* on an accelerator host"):
        accelerator.routed_scale(OtherMoE(), layer(2.5))
    monkeypatch.setattr(accelerator, "cpu_engine", lambda: True)
    assert accelerator.routed_scale(OtherMoE(), layer(2.5)) == 1.0


def test_self_check_command_in_emulation(capsys):
    """python -m kt_serve.check through the accelerator path's code on CPU: every row within TOL, one table."""
    from kt_serve import check

    assert check.main(["--device", "cpu", "--emulate", "--families", "qwen3_moe"]) == 0
    out = capsys.readouterr().out
    assert "| qwen3_moe | plain launch | none (CPU device) | composite |" in out
    assert "kt_serve.check: 2/2 rows within 0.02 nats of the fp32 reference" in out
