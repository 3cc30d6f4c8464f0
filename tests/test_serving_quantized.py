"""End-to-end: quantized routed experts (--kt-expert-dtype) and FP8 block-quantized checkpoints, served by stock
SGLang + the kt_serve plugin on CPU and compared with fp32 HF transformers references (kt_serve/harness/reference.py).

- FP8 checkpoints (tests/fp8_checkpoint.py writes them from tiny bf16 ones): a Qwen3-MoE and a DeepSeek-V2, every
  attention / expert / shared-expert linear in e4m3 with [128, 128] block scales, dims chosen so that some blocks
  are partial (hidden 192, kv_a_proj 48 rows) and DeepSeek's kv_b_proj has several row blocks (a per-tensor
  requantization of it, what SGLang's MLA set-up does to FP8 on a CPU, is off by 0.07 nats here). Reference: the
  fp32 checkpoint of the same dequantized weights.
- ``--kt-expert-dtype int8`` / ``int4`` on a bf16 Qwen3-MoE. Reference: the checkpoint with its expert weights
  replaced by tests/quant_reference.py's torch restatement of the kernel's quantization rules
  (csrc/weights/packed_weights.cpp).

Base requests and a composite adapter (attention + expert LoRA, shared-expert LoRA for DeepSeek) are compared within
TOL over the tokens predicted before the reference's first routing near-tie. Each case also records its mean
distance from the bf16 model (the fp32 reference of the unquantized checkpoint); the last test prints the table and
writes it to ``quantization_error.json`` in the module's tmp dir. Five start-ups: four servers and one refused
(AWQ, refused by the launcher before any model is loaded, in seconds).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fp8_checkpoint import dequantize_block_fp8, write_fp8_checkpoint
from kt_serve.harness.server import ServerStartError, SGLangServer
from kt_serve.harness.tiny_model import build_tiny_moe
from quant_reference import ref_int8, ref_quantize, write_expert_quantized_reference
from kt_serve.harness.reference import HFReference, write_kt_adapter
from test_serving import LORA_ARGS, MIN_EFFECT, complete, pick_prompts
from test_serving_deepseek import DEEPSEEK_SERVING_CONFIG

TOL = 0.03  # nats: quantized serving vs an fp32 reference with the same (dequantized) weights
GROUP = 128  # --kt-expert-group-size (the default)
# Routing near-ties (kt_serve.harness.reference.routing_margin) end the comparison at 3x test_serving's margin, so that a
# different kernel table's rounding (another CI CPU) cannot flip an expert choice inside the compared tokens:
# with round-to-even int16 inputs instead of half-away, one int4 decode token here came out 0.24 nats off.
TIE_MARGIN = 3e-3
# Partial [128, 128] blocks: hidden 192 in every projection that reads or writes the hidden state, and (Qwen3)
# moe_intermediate_size 160 in the experts' gate / up rows and down columns, which SGLang's CPU engine pads to 256
# in its config (the plugin packs the checkpoint's 160); a partial int4 group in both.
QWEN3_DIMS = dict(hidden_size=192, moe_intermediate_size=160, head_dim=64)  # q 256, k/v 128 rows (merged qkv)
# DeepSeek: kv_b_proj 4 heads x (48 + 48) = 384 rows, three row blocks with their own scales (SGLang's MLA splits it
# into w_kc / w_vc after loading), o_proj reads 4 x 48 = 192 columns (a partial block), kv_a_proj 32 + 16 rows.
DEEPSEEK_DIMS = dict(hidden_size=192, moe_intermediate_size=128, qk_nope_head_dim=48, v_head_dim=48,
                     **DEEPSEEK_SERVING_CONFIG)
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")

STATS: dict[str, dict] = {}  # case -> figures, printed and written by the last test


def layer0_experts(model_dir, suffix="weight"):
    """{proj: [E, N, K]} of layer 0's routed experts as stored in the checkpoint."""
    from safetensors.torch import load_file

    state = load_file(f"{model_dir}/model.safetensors")
    E = 1 + max(int(k.split(".mlp.experts.")[1].split(".")[0]) for k in state if ".mlp.experts." in k)
    return {p: torch.stack([state[f"model.layers.0.mlp.experts.{e}.{p}.{suffix}"] for e in range(E)])
            for p in EXPERT_PROJS}


# -- models ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serving_quantized")


@pytest.fixture(scope="module")
def qwen3_bf16(workdir):
    model = build_tiny_moe(workdir / "qwen3_bf16", "qwen3_moe", **QWEN3_DIMS)
    return model, HFReference(model)


@pytest.fixture(scope="module")
def deepseek_bf16(workdir):
    model = build_tiny_moe(workdir / "deepseek_bf16", "deepseek_v2", **DEEPSEEK_DIMS)
    return model, HFReference(model)


def case(workdir, name, served_dir, ref_dir, bf16, **adapter_kinds):
    """(served model, composite adapter, reference, bf16 reference, prompts) of one served configuration."""
    adapter = write_kt_adapter(workdir / f"{name}_adapter", served_dir, seed=21, **adapter_kinds)
    ref = HFReference(ref_dir)
    return dict(name=name, model=str(served_dir), adapter=adapter, ref=ref, bf16=bf16[1],
                prompts=pick_prompts(ref, [[], [adapter]], n=2, tie_margin=TIE_MARGIN))


@pytest.fixture(scope="module")
def qwen3_fp8(workdir, qwen3_bf16):
    fp8, ref = write_fp8_checkpoint(qwen3_bf16[0], workdir / "qwen3_fp8", workdir / "qwen3_fp8_ref")
    return case(workdir, "qwen3_fp8", fp8, ref, qwen3_bf16)


@pytest.fixture(scope="module")
def deepseek_fp8(workdir, deepseek_bf16):
    fp8, ref = write_fp8_checkpoint(deepseek_bf16[0], workdir / "deepseek_fp8", workdir / "deepseek_fp8_ref")
    return case(workdir, "deepseek_v2_fp8", fp8, ref, deepseek_bf16, shared_expert=True)


def quantized_case(workdir, qwen3_bf16, fmt):
    ref = write_expert_quantized_reference(qwen3_bf16[0], workdir / f"qwen3_{fmt}_ref", fmt, GROUP)
    return case(workdir, f"qwen3_{fmt}", qwen3_bf16[0], ref, qwen3_bf16)


def serve(c, extra=()):
    return SGLangServer(c["model"], [*extra, *LORA_ARGS, "--lora-paths", f"both={c['adapter']}"])


def check_case(server, c):
    """Every prompt, base and composite adapter: served vs the case's reference within TOL; figures recorded."""
    diffs, from_bf16 = [], []
    for prompt in c["prompts"]:
        for name in (None, "both"):
            dirs = [] if name is None else [c["adapter"]]
            ids, logprobs = complete(server, c["model"] if name is None else f"{c['model']}:{name}", prompt)
            want, first_tie = c["ref"].logprobs_and_routing(prompt + ids, len(prompt), dirs, tie_margin=TIE_MARGIN)
            bf16 = c["bf16"].logprobs(prompt + ids, len(prompt), dirs)
            keep = [i for i in range(len(logprobs)) if len(prompt) + i - 1 < first_tie]
            assert keep, f"routing near-tie inside the prompt (position {first_tie})"
            d = [abs(logprobs[i] - want[i]) for i in keep]
            assert max(d) < TOL, (f"{c['name']} adapter {name}: served {logprobs} vs reference {want} "
                                  f"(max diff {max(d):.4f} over {len(keep)} tokens)")
            if name is not None:  # the adapter really acted
                base = c["ref"].logprobs(prompt + ids, len(prompt), [])
                assert max(abs(a - b) for a, b in zip(logprobs, base)) > MIN_EFFECT
            diffs += d
            from_bf16 += [abs(logprobs[i] - bf16[i]) for i in keep]
    STATS[c["name"]] = dict(tokens=len(diffs), max_vs_reference=max(diffs),
                            mean_vs_reference=sum(diffs) / len(diffs), mean_vs_bf16=sum(from_bf16) / len(from_bf16),
                            max_vs_bf16=max(from_bf16))
    return STATS[c["name"]]


# -- no server: the references' quantization equals the kernel's ---------------------------------------------
def test_reference_quantization_matches_kernel(qwen3_bf16, qwen3_fp8):
    """The torch restatements above give exactly the weights the kernel packs (bf16 -> int8 / int4 / fp8, FP8
    checkpoint -> fp8 as stored, FP8 checkpoint -> int8), so the references below are those of the served weights."""
    from kt_serve.kernel.experts import MoEExperts

    w = layer0_experts(qwen3_bf16[0])
    for fmt in ("int8", "int4", "fp8"):
        got = MoEExperts(*(w[p] for p in EXPERT_PROJS), weight_format=fmt, max_slots=1).dequantized()
        for p in EXPERT_PROJS:
            want = ref_quantize(w[p].float(), fmt, GROUP)
            assert torch.equal(got[p], want), (fmt, p, (got[p] - want).abs().max())
    from safetensors.torch import load_file

    from kt_serve.kernel.linear import PackedLinear

    state = load_file(f"{qwen3_bf16[0]}/model.safetensors")
    for name in ("q_proj", "o_proj"):  # --kt-dense-dtype: K = 192 and 256, a partial int4 group in q_proj
        w = state[f"model.layers.0.self_attn.{name}.weight"]
        for fmt in ("int8", "int4"):
            got = PackedLinear(w, weight_format=fmt, group_size=GROUP).dequantized()
            want = ref_quantize(w.float(), fmt, GROUP)
            assert torch.equal(got, want), (fmt, name, (got - want).abs().max())
    q, s = layer0_experts(qwen3_fp8["model"]), layer0_experts(qwen3_fp8["model"], "weight_scale_inv")
    scales = {f"{p.split('_')[0]}_scale_inv": s[p] for p in EXPERT_PROJS}
    dequantized = {p: torch.stack([dequantize_block_fp8(a, b) for a, b in zip(q[p], s[p])]) for p in EXPERT_PROJS}
    for fmt in ("fp8", "int8"):
        got = MoEExperts(*(q[p] for p in EXPERT_PROJS), weight_format=fmt, max_slots=1, **scales,
                         weight_block_size=[128, 128]).dequantized()
        for p in EXPERT_PROJS:
            want = dequantized[p] if fmt == "fp8" else ref_int8(dequantized[p])
            assert torch.equal(got[p], want), (fmt, p, (got[p] - want).abs().max())


# -- servers -----------------------------------------------------------------------------------------------
def test_fp8_checkpoint_qwen3(qwen3_fp8):
    with serve(qwen3_fp8) as server:
        check_case(server, qwen3_fp8)
        log = server.log_tail(100000)
    assert "fp8 experts packed from a fp8 checkpoint" in log, log[-3000:]


def test_fp8_checkpoint_deepseek_v2(deepseek_fp8):
    """MLA (kv_b_proj dequantized before SGLang splits it into w_kc / w_vc), shared experts in FP8 with LoRA."""
    with serve(deepseek_fp8) as server:
        check_case(server, deepseek_fp8)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_expert_dtype_on_bf16_checkpoint(workdir, qwen3_bf16, fmt):
    c = quantized_case(workdir, qwen3_bf16, fmt)
    with serve(c, ["--kt-expert-dtype", fmt]) as server:
        stats = check_case(server, c)
        log = server.log_tail(100000)
    assert f"{fmt} experts packed from a bf16 checkpoint" in log, log[-3000:]
    if fmt == "int4":  # the server runs the int4 weights: far closer to their reference than to the bf16 model
        assert stats["mean_vs_reference"] < stats["mean_vs_bf16"] / 2, stats


def test_dense_dtype_int4_with_int8_experts(workdir, qwen3_bf16):
    """--kt-dense-dtype int4: the attention projections quantized at load too (the routers and lm_head stay bf16),
    served through the decode stack with the composite adapter's q/k/v/o LoRA on top. (int4, not int8: this
    model's int8 attention stays within TOL of bf16, so only int4 shows the server runs the quantized weights; the
    reference test above holds int8 and int4 packing to the same rules.)"""
    ref = write_expert_quantized_reference(qwen3_bf16[0], workdir / "qwen3_int8_dense_int4_ref", "int8", GROUP,
                                           dense_fmt="int4")
    c = case(workdir, "qwen3_int8_dense_int4", qwen3_bf16[0], ref, qwen3_bf16)
    served = serve_packed_layers(c, ["--kt-expert-dtype", "int8", "--kt-dense-dtype", "int4"], "--kt-dense-dtype int4")
    if served is None:
        return
    stats, log = served
    assert "(3 bf16, 4 int4;" in log, log[-3000:]  # 2 layers x (qkv, o) in int4; the 2 routers and lm_head bf16
    assert stats["mean_vs_reference"] < stats["mean_vs_bf16"] / 2, stats


def serve_packed_layers(c, args, flag):
    """Serve case ``c`` with ``args`` that quantize layers the plugin packs and check it: (stats, server log). With
    AMX, SGLang's kernels run those layers in bf16: the start must be refused naming ``flag`` (then None)."""
    from sglang.srt.utils.common import cpu_has_amx_support

    if cpu_has_amx_support():
        with pytest.raises(ServerStartError, match=f"{flag}: the kt_serve kernel runs the linear layers"):
            with serve(c, args):
                pass
        return None
    with serve(c, args) as server:
        return check_case(server, c), server.log_tail(100000)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_lm_head_dtype(workdir, qwen3_bf16, fmt):
    """--kt-lm-head-dtype: lm_head quantized at load (the largest dense matrix a decode step reads at a 150k+
    vocabulary), everything else bf16; against the reference with lm_head's weights quantized by the same rules. int4
    must sit far closer to that reference than to the bf16 model (the server runs the quantized lm_head)."""
    ref = write_expert_quantized_reference(qwen3_bf16[0], workdir / f"qwen3_lm_head_{fmt}_ref", "bf16", GROUP,
                                           lm_head_fmt=fmt)
    c = case(workdir, f"qwen3_lm_head_{fmt}", qwen3_bf16[0], ref, qwen3_bf16)
    served = serve_packed_layers(c, ["--kt-lm-head-dtype", fmt], f"--kt-lm-head-dtype {fmt}")
    if served is None:
        return
    stats, log = served
    assert f"(6 bf16, 1 {fmt};" in log, log[-3000:]  # 2 layers x (qkv, o) and the 2 routers bf16, lm_head not
    if fmt == "int4":
        assert stats["mean_vs_reference"] < stats["mean_vs_bf16"] / 2, stats


# -- refused start-up --------------------------------------------------------------------------------------
def test_awq_checkpoint_refused_at_start(workdir, qwen3_bf16):
    awq = workdir / "qwen3_awq"
    shutil.copytree(qwen3_bf16[0], awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                     "version": "gemm"}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ServerStartError) as err:
        with SGLangServer(awq, [], startup_timeout=180):
            pass
    lines = [line for line in str(err.value).splitlines() if line.startswith("kt_serve:")]
    assert len(lines) == 1, str(err.value)[-3000:]
    assert "'awq'" in lines[0] and "--kt-expert-dtype int8 or int4" in lines[0] and "--kt-moe off" in lines[0], lines


@pytest.mark.parametrize("quantization, flag, refused", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, None, "'gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, None, "'fp8' without weight_block_size"),
    ({"quant_method": "compressed-tensors"}, None, "'compressed-tensors'"),
    (None, "w8a8_int8", "--quantization w8a8_int8 on a bf16 checkpoint"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "w8a8_fp8", "with --quantization w8a8_fp8"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, None),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8", None),
    (None, None, None),
])
def test_launcher_quantization_check(tmp_path, quantization, flag, refused):
    """What the launcher refuses before starting anything (the AWQ start above runs the same check)."""
    from types import SimpleNamespace

    from kt_serve.sglang_plugin.args import unsupported_quantization

    config = {"model_type": "qwen3_moe"} | ({"quantization_config": quantization} if quantization else {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = unsupported_quantization(SimpleNamespace(model_path=str(tmp_path), quantization=flag))
    if refused is None:
        assert message is None
    else:
        assert refused in message and "--kt-expert-dtype int8 or int4" in message and "--kt-moe off" in message
        assert "\n" not in message


# -- figures -----------------------------------------------------------------------------------------------
def test_report_quantization_error(workdir, capsys):
    """Prints (also without -s) and writes the figures of the cases above; int4 is further from bf16 than int8."""
    path = workdir / "quantization_error.json"
    path.write_text(json.dumps(STATS, indent=2))
    with capsys.disabled():
        print(f"\nquantized serving, |Δ logprob| in nats ({path}):")
        print(f"  {'case':18} {'tokens':>6} {'max vs ref':>11} {'mean vs ref':>12} {'mean vs bf16':>13}")
        for name, s in STATS.items():
            print(f"  {name:18} {s['tokens']:6d} {s['max_vs_reference']:11.4f} {s['mean_vs_reference']:12.4f} "
                  f"{s['mean_vs_bf16']:13.4f}")
    if "qwen3_int8" in STATS and "qwen3_int4" in STATS:
        assert STATS["qwen3_int4"]["mean_vs_bf16"] > STATS["qwen3_int8"]["mean_vs_bf16"], STATS
