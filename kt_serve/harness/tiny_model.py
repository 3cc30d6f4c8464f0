"""Deterministic tiny random MoE checkpoints with an offline tokenizer, for tests, evals and the quickstart.

No hub access: the model is built from a transformers config with a fixed seed and saved in bf16 with
``save_pretrained``; the tokenizer is a byte-level BPE trained on ``kt_serve/data/tiny_corpus.txt`` with the
ChatML specials ``<|endoftext|>`` (0), ``<|im_start|>`` (1), ``<|im_end|>`` (2, also EOS).

    python -m kt_serve.harness.tiny_model OUT_DIR [--family qwen3_moe|qwen2_moe|deepseek_v2|qwen3_5_moe]
                                                  [--hidden-size 128] ...

``qwen3_5_moe`` is written as the official Qwen3.5-MoE checkpoints are: ``Qwen3_5MoeForConditionalGeneration`` (the
text model under ``model.language_model.``, a one-block vision tower), hybrid layers (three Gated DeltaNet linear
attention layers to one full attention layer), a shared expert behind a sigmoid gate, and
``full_attention_interval`` in ``text_config`` (SGLang reads it; transformers does not write it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = Path(__file__).parent.parent / "data" / "tiny_corpus.txt"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FAMILIES = ("qwen3_moe", "qwen2_moe", "deepseek_v2", "qwen3_5_moe")
DEFAULT_LAYERS = {"qwen3_5_moe": 4}  # one full-attention layer per four
FULL_ATTENTION_INTERVAL = 4
ROUTER_SCALE = 8.0  # qwen3_5_moe: router weights at 8 x the 0.02 init
# Larger than HF's 0.02 so that routed experts and adapters move the logits visibly in a 2-layer model.
DEFAULT_INIT_RANGE = 0.05
# What SGLang's model classes need beyond transformers' config defaults to serve a family (real checkpoints have
# them): DeepSeek-V2's yarn RoPE (its CPU rotary embedding is deepseek_yarn only), moe_layer_freq and scoring_func.
SERVING_OVERRIDES = {
    "deepseek_v2": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 1024, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
                        moe_layer_freq=1, scoring_func="softmax"),
}


def _config(family: str, *, hidden_size, moe_intermediate_size, num_experts, top_k, num_layers, vocab_size,
            overrides):
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0,
                  initializer_range=DEFAULT_INIT_RANGE, rms_norm_eps=1e-6)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig as Config

        kw = dict(common, intermediate_size=2 * hidden_size, moe_intermediate_size=moe_intermediate_size,
                  head_dim=hidden_size // 4, num_experts=num_experts, num_experts_per_tok=top_k,
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    elif family == "qwen2_moe":
        from transformers import Qwen2MoeConfig as Config

        kw = dict(common, intermediate_size=2 * hidden_size, moe_intermediate_size=moe_intermediate_size,
                  shared_expert_intermediate_size=2 * moe_intermediate_size, num_experts=num_experts,
                  num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False)
    elif family == "deepseek_v2":
        from transformers import DeepseekV2Config as Config

        # MLA without q compression; grouped top-k and a routed scaling factor != 1 exercise the DeepSeek path.
        kw = dict(common, num_key_value_heads=4, intermediate_size=2 * hidden_size,
                  moe_intermediate_size=moe_intermediate_size, n_routed_experts=num_experts,
                  num_experts_per_tok=top_k, n_shared_experts=1, first_k_dense_replace=0,
                  topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=2.0,
                  norm_topk_prob=False, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=16, v_head_dim=16, head_dim=16)
    elif family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeConfig

        layer_types = ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
                       for i in range(num_layers)]
        # HF's own 0.02 init: at 0.05 a bf16 forward drifts 0.03-0.3 nats from fp32 through the Gated DeltaNet
        # layers (HF's own bf16 vs fp32, 20 tokens), more than the serving tests can tell from a real error.
        text = dict(common, initializer_range=0.02, head_dim=hidden_size // 4, moe_intermediate_size=moe_intermediate_size,
                    shared_expert_intermediate_size=2 * moe_intermediate_size, num_experts=num_experts,
                    num_experts_per_tok=top_k, layer_types=layer_types, linear_conv_kernel_dim=4,
                    linear_key_head_dim=hidden_size // 4, linear_value_head_dim=hidden_size // 4,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
        text.update(overrides)
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=hidden_size,
                      patch_size=16, num_position_embeddings=64)
        return Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    else:
        raise ValueError(f"family={family!r}: expected one of {', '.join(FAMILIES)}")
    kw.update(overrides)
    return Config(**kw)


def build_tokenizer(vocab_size: int):
    """Byte-level BPE trained on the shipped corpus (deterministic), wrapped as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 1000), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the trained tokenizer ({tok.get_vocab_size()})")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def _processor(tokenizer):
    """The image / video processor files an official Qwen3.5 checkpoint ships, around the tiny tokenizer."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    sizes = dict(patch_size=16, merge_size=2, temporal_patch_size=2)
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**sizes), tokenizer=tokenizer,
                            video_processor=Qwen3VLVideoProcessor(**sizes), chat_template=tokenizer.chat_template)


def build_tiny_moe(out_dir, family: str = "qwen3_moe", *, hidden_size: int = 128, moe_intermediate_size: int = 64,
                   num_experts: int = 8, top_k: int = 2, num_layers: int | None = None, vocab_size: int = 1024, seed: int = 0,
                   **overrides) -> Path:
    """Write a tiny random HF MoE checkpoint (bf16 safetensors) plus tokenizer to ``out_dir``; returns the path.

    The same arguments give byte-identical weights. ``overrides`` go into the transformers config.
    An existing ``out_dir`` is replaced atomically (written to a temp dir next to it, then renamed).
    """
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir).absolute()
    num_layers = num_layers or DEFAULT_LAYERS.get(family, 2)
    config = _config(family, hidden_size=hidden_size, moe_intermediate_size=moe_intermediate_size,
                     num_experts=num_experts, top_k=top_k, num_layers=num_layers, vocab_size=vocab_size,
                     overrides=overrides)
    from kt_serve.formats.safetensors_io import staged_dirs

    with staged_dirs([out_dir], overwrite=True) as (tmp,):
        tmp.chmod(0o755)  # mkdtemp makes it private; a model dir should be readable like any other
        torch.manual_seed(seed)
        if family == "qwen3_5_moe":
            from transformers import Qwen3_5MoeForConditionalGeneration

            model = Qwen3_5MoeForConditionalGeneration(config)
            with torch.no_grad():  # decisive routing at the 0.02 init (else near-ties everywhere): larger router
                for name, param in model.named_parameters():
                    if name.endswith("mlp.gate.weight"):
                        param.mul_(ROUTER_SCALE)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.to(torch.bfloat16).save_pretrained(tmp)
        if family == "qwen3_5_moe":
            config_path = tmp / "config.json"
            written = json.loads(config_path.read_text())
            written["text_config"]["full_attention_interval"] = FULL_ATTENTION_INTERVAL
            config_path.write_text(json.dumps(written, indent=2) + "\n")
            _processor(build_tokenizer(vocab_size)).save_pretrained(tmp)  # SGLang opens a VLM's processor
        else:
            build_tokenizer(vocab_size).save_pretrained(tmp)
    return out_dir


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--family", choices=FAMILIES, default="qwen3_moe")
    for name, default in [("hidden-size", 128), ("moe-intermediate-size", 64), ("num-experts", 8), ("top-k", 2),
                          ("num-layers", 0), ("vocab-size", 1024), ("seed", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args(argv)
    path = build_tiny_moe(a.out_dir, a.family, hidden_size=a.hidden_size,
                          moe_intermediate_size=a.moe_intermediate_size, num_experts=a.num_experts, top_k=a.top_k,
                          num_layers=a.num_layers or None, vocab_size=a.vocab_size, seed=a.seed)
    print(path)


if __name__ == "__main__":
    main()
