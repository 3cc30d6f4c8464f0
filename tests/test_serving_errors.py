"""Server start-ups the kt_serve plugin refuses, each with a message that names the problem (real SGLang, CPU)."""

from __future__ import annotations

import pytest

from kt_serve.harness.server import ServerStartError, SGLangServer
from kt_serve.harness.tiny_model import build_tiny_moe, build_tokenizer
from kt_serve.harness.reference import write_expert_peft_adapter


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serving_errors")


@pytest.fixture(scope="module")
def moe_model(workdir):
    return build_tiny_moe(workdir / "qwen3_moe", "qwen3_moe")


def build_tiny_dense(out_dir):
    """A tiny dense Qwen3 (no MoE layer at all) with the offline tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out_dir)
    build_tokenizer(config.vocab_size).save_pretrained(out_dir)
    return out_dir


def start_error(model, args, **kwargs) -> str:
    with pytest.raises(ServerStartError) as err:
        with SGLangServer(model, args, startup_timeout=180, **kwargs):
            pass
    return str(err.value)


def test_expert_adapter_on_dense_model_refused(workdir, moe_model):
    dense = build_tiny_dense(workdir / "qwen3_dense")
    adapter = write_expert_peft_adapter(workdir / "experts", moe_model, seed=1)
    message = start_error(dense, ["--kt-expert-lora-path", str(adapter)])
    assert f"--kt-expert-lora-path {adapter}: model {dense} has no MoE layers with routed experts" in message, \
        message[-2000:]


def test_enforced_shared_expert_fusion_refused(moe_model):
    """Fused shared experts would land in the kernel as routed experts that expert adapters do not cover."""
    message = start_error(moe_model, ["--enforce-shared-experts-fusion"])
    assert "--enforce-shared-experts-fusion: the kt_serve kernel runs routed experts only" in message, message[-2000:]


def test_text_only_qwen35_checkpoint_refused(workdir):
    """transformers' text-only Qwen3_5MoeForCausalLM save has no SGLang model class: refused at start, not served
    through SGLang's generic Transformers fallback (which would bypass the kernel and every expert adapter)."""
    import torch
    from transformers import AutoModelForCausalLM

    official = build_tiny_moe(workdir / "qwen35", "qwen3_5_moe", hidden_size=64, moe_intermediate_size=32)
    text_only = workdir / "qwen35_text_only"
    AutoModelForCausalLM.from_pretrained(official, dtype=torch.bfloat16).save_pretrained(text_only)
    build_tokenizer(1024).save_pretrained(text_only)
    message = start_error(text_only, [])
    assert f"kt_serve: {text_only} is a text-only Qwen3.5-MoE checkpoint" in message, message[-2000:]


def test_port_taken_before_bind_is_retried_on_a_fresh_port(moe_model, monkeypatch):
    """Another process takes the chosen HTTP port between free_port() and SGLang's bind (CI saw it): the helper
    restarts on a fresh port instead of probing the squatter until its timeout."""
    import socket

    import kt_serve.harness.server as server_mod

    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()  # accepts connections and never answers, as a foreign socket would
    taken = squatter.getsockname()[1]
    ports = iter([taken])
    real_free_port = server_mod.free_port
    monkeypatch.setattr(server_mod, "free_port", lambda: next(ports, None) or real_free_port())
    try:
        with SGLangServer(moe_model, [], startup_timeout=180) as srv:
            assert srv.port != taken
            status, body = srv.post("/generate", {"input_ids": [5, 6],
                                                  "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
            assert status == 200 and body["meta_info"]["completion_tokens"] == 2, body
        # A port the caller chose is not swapped behind its back: a clear error instead.
        message = start_error(moe_model, [], port=taken)
        assert f"port {taken} is taken by another process" in message, message[-2000:]
    finally:
        squatter.close()


@pytest.mark.parametrize("args, message", [
    (["--enable-lora", "--lora-paths", "x=/nonexistent", "--kt-lora-dir", "/nonexistent/adapters"],
     "--kt-lora-dir /nonexistent/adapters: not a directory"),
    (["--kt-lora-dir", "."], "--kt-lora-dir needs --enable-lora"),
    (["--kt-max-expert-loras", "lots"], "--kt-max-expert-loras=lots: expected a number of adapters"),
])
def test_bad_adapter_pool_flags_refused_at_launch(moe_model, args, message):
    assert message in start_error(moe_model, args)
