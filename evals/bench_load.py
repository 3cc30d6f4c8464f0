"""Whole-model start-up: a full-size checkpoint generated on disk, served by stock launch_server + the plugin with
no other flag than the formats; start time, peak and settled RSS, 1-stream decode, for a first start (the packed-
weight cache empty), a second start (the cache), a start with one cache file corrupted, and the dense / lm_head
format variants (from the cache); then the fits-or-refuses check with FP8 experts, which need more than the host.

    python evals/bench_load.py --out /tmp/bench_load                       # Qwen3-30B-A3B, FP8 checkpoint
    python evals/bench_load.py --out /tmp/bl --layers 8 --checkpoint bf16  # a slice, bf16

    python evals/bench_load.py --out /tmp/bl --preset deepseek-v3 --layers 4  # 3 dense layers + 1 MoE layer

The checkpoint: a preset's full-size shapes (Qwen3-30B-A3B, DeepSeek-V3, Qwen3.5-35B-A3B; --layers cuts it to a
slice), its tensors named and shaped as the family's checkpoints store them (transformers' model built on the meta
device and renamed back to the on-disk layout), random weights, in the official FP8 layout (e4m3 projections with
[128, 128] weight_scale_inv blocks, bf16 router / norms / embeddings / lm_head) or bf16; 4 GiB shards. Written once
and reused.
RSS is the scheduler process's (VmHWM: its peak since it started, read once the server answers; VmRSS after the
decode runs). "bytes / token" is what one decode step reads: top-k experts of every layer in their packed format,
the attention projections and routers, lm_head; "% of read" compares tok/s × bytes/token with a plain streaming read
measured in the same run (fp32 sum over 1 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernel import cpu_model, measure_bandwidth_gbs  # noqa: E402
from bench_serving import decode_run, stream_prompt  # noqa: E402

from kt_serve import _kernel  # noqa: E402
from kt_serve.formats.safetensors_io import SafetensorsWriter, write_json  # noqa: E402
from kt_serve.harness.server import SGLangServer, ServerStartError  # noqa: E402
from kt_serve.harness.tiny_model import build_tokenizer  # noqa: E402
from kt_serve.formats.checkpoint import expert_layer  # noqa: E402
from kt_serve.kernel.weights import bytes_per_weight  # noqa: E402

# Full-size shapes of the models users serve (random weights); --layers cuts any of them to a slice.
PRESETS = {
    # Qwen3-30B-A3B: 48 layers, 128 experts top-8, moe_intermediate 768, 32 q / 4 kv heads of 128
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, intermediate_size=6144,
        vocab_size=151936, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, rms_norm_eps=1e-6)),
    # DeepSeek-V3 / V3.1 / R1: 61 layers (3 dense first), MLA (q_lora 1536, kv_lora 512, 128 heads), 256 routed
    # experts top-8 + 1 shared, moe_intermediate 2048, sigmoid scores with grouped top-k (8 groups, 4 kept)
    "deepseek-v3": ("deepseek_v3", dict(
        hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3, intermediate_size=18432,
        moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, vocab_size=129280, max_position_embeddings=163840, tie_word_embeddings=False,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                            "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # Qwen3.5-35B-A3B: 40 layers (three Gated DeltaNet, then one gated full attention), 256 experts top-8 + a
    # shared expert, moe_intermediate 512, 16 q / 2 kv heads of 256, GDN 16 key / 32 value heads of 128
    "qwen3.5-35b-a3b": ("qwen3_5_moe", dict(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6)),
}
SHARD_BYTES = 4 << 30
BLOCK = 128
_F8 = torch.float8_e4m3fn


# -- the checkpoint ----------------------------------------------------------------------------------------------
def hf_config(family: str, fields: dict):
    """The transformers config of a preset (Qwen3.5: the official multimodal layout, a small vision tower)."""
    if family == "qwen3_5_moe":  # tiny_model's config builder sets the layer types (one full attention in four)
        from kt_serve.harness.tiny_model import _config

        config = _config(family, hidden_size=fields["hidden_size"], moe_intermediate_size=fields["moe_intermediate_size"],
                         num_experts=fields["num_experts"], top_k=fields["num_experts_per_tok"],
                         num_layers=fields["num_hidden_layers"], vocab_size=fields["vocab_size"], overrides=fields)
        config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
        return config
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    config = {"qwen3_moe": Qwen3MoeConfig, "deepseek_v3": DeepseekV3Config}[family](**fields)
    config.architectures = [{"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[family]]
    return config


def checkpoint_layout(family: str, config) -> list[tuple[str, tuple]]:
    """(name, shape) of every tensor as the family's checkpoints store them: the transformers model built on the
    meta device (no memory), its state dict renamed back to the on-disk layout as save_pretrained writes it."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = (Qwen3_5MoeForConditionalGeneration(config) if family == "qwen3_5_moe"
                 else AutoModelForCausalLM.from_config(config))
    return [(name, tuple(t.shape)) for name, t in revert_weight_conversion(model, model.state_dict()).items()]


def is_projection(name: str, shape: tuple) -> bool:
    """A decoder layer's linear projection (attention, GDN, dense and shared MLPs, routed experts)."""
    module = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return ".layers." in name and name.endswith(".weight") and "proj" in module and len(shape) == 2 and "visual" not in name


def is_fp8(name: str, shape: tuple) -> bool:
    """Quantized in the official FP8 releases: the decoder layers' linear projections (attention, dense and shared
    MLPs, routed experts: every ``*proj*`` module) of whole 128-row blocks, and DeepSeek's kv_a_proj_with_mqa (576
    rows); embeddings, norms, routers, lm_head and projections of fewer rows (Qwen3.5's in_proj_b / in_proj_a,
    which SGLang merges and cannot block-quantize) stay bf16."""
    return is_projection(name, shape) and (shape[0] % BLOCK == 0 or name.endswith("kv_a_proj_with_mqa.weight"))


def bf16_projections(layout) -> list[str]:
    """The decoder-layer projections left bf16 in an FP8 checkpoint (its modules_to_not_convert)."""
    return sorted(name.removesuffix(".weight") for name, shape in layout
                  if is_projection(name, shape) and not is_fp8(name, shape))


class RandomPool:
    """Random values served from one pool at varying offsets: writing tens of GB of fresh random numbers would
    take longer than the starts being measured, and the bytes' randomness does not change what is timed."""

    def __init__(self, n: int = 64 << 20, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.bf16 = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        codes = torch.randint(0, 0x7F, (n,), dtype=torch.uint8, generator=g)  # no NaN code (0x7f / 0xff)
        self.fp8 = (codes | (torch.randint(0, 2, (n,), dtype=torch.uint8, generator=g) << 7)).view(_F8)
        self.next = 0

    def take(self, pool: torch.Tensor, shape) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        if n > pool.numel():
            return torch.cat([pool] * (n // pool.numel() + 1))[:n].reshape(shape)
        self.next = (self.next + 7919 * 64) % (pool.numel() - n + 1)
        return pool[self.next:self.next + n].reshape(shape)


def write_checkpoint(out: Path, family: str, config, layout, fp8: bool) -> Path:
    """A checkpoint of ``config``'s shapes (``layout``: checkpoint_layout's) under out (reused if its config
    matches)."""
    from kt_serve.harness.tiny_model import _processor

    hf = config.to_dict()
    if fp8:
        hf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [BLOCK, BLOCK]}
        if bf16_projections(layout):
            hf["quantization_config"]["modules_to_not_convert"] = bf16_projections(layout)
    if family == "qwen3_5_moe":  # SGLang reads the interval, transformers the layer types
        from kt_serve.harness.tiny_model import FULL_ATTENTION_INTERVAL

        hf["text_config"]["full_attention_interval"] = FULL_ATTENTION_INTERVAL
    hf = json.loads(json.dumps(hf))
    if (out / "config.json").exists() and json.loads((out / "config.json").read_text()) == hf:
        return out
    shutil.rmtree(out, ignore_errors=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pool = RandomPool()
    scale = torch.full((1,), 0.05 / 448)
    entries = []
    for name, shape in layout:
        if fp8 and is_fp8(name, shape):
            entries.append((name, _F8, shape))
            entries.append((name + "_scale_inv", torch.float32, (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))))
        else:
            entries.append((name, torch.bfloat16, shape))
    shards, current, size = [], [], 0
    for entry in entries:
        nbytes = torch.empty((), dtype=entry[1]).element_size()
        for d in entry[2]:
            nbytes *= d
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    shards.append(current)
    weight_map = {}
    t0 = time.perf_counter()
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsWriter(tmp / fname, {n: (d, s) for n, d, s in shard})
        for name, dtype, shape in shard:
            if dtype == torch.float32:
                t = scale.expand(shape).contiguous()
            else:
                t = pool.take(pool.fp8 if dtype == _F8 else pool.bf16, shape)
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=torch.bfloat16)
            elif name.endswith("e_score_correction_bias"):
                t = torch.zeros(shape, dtype=torch.bfloat16)
            writer.write(name, t)
            weight_map[name] = fname
        writer.close()
        print(f"  {fname}: {len(shard)} tensors ({time.perf_counter() - t0:.0f} s)", flush=True)
    write_json(tmp / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    tokenizer = build_tokenizer(1000)
    (_processor(tokenizer) if family == "qwen3_5_moe" else tokenizer).save_pretrained(tmp)  # SGLang opens a VLM's processor
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    tmp.rename(out)
    return out


# -- one start ---------------------------------------------------------------------------------------------------
def scheduler_memory(server) -> dict:
    """VmHWM / VmRSS (GiB) of the server's scheduler process."""
    import psutil

    for p in psutil.Process(server.proc.pid).children(recursive=True):
        if "scheduler" in p.name() or "scheduler" in " ".join(p.cmdline()):
            status = Path(f"/proc/{p.pid}/status").read_text()
            get = lambda key: int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) / 2**20  # noqa: E731
            return {"peak_gib": get("VmHWM"), "rss_gib": get("VmRSS")}
    raise RuntimeError("no scheduler process found")


def start(model: Path, flags: list, label: str, decode: bool, log_dir: Path) -> dict:
    t0 = time.perf_counter()
    server = SGLangServer(model, flags, max_total_tokens=None, startup_timeout=3600,
                          log_path=log_dir / f"{re.sub(r'[^a-z0-9]+', '_', label.lower())}.log")
    server.start()
    row = {"start": label, "flags": " ".join(flags), "ready_s": time.perf_counter() - t0}
    try:
        row.update(scheduler_memory(server))
        row["greedy"] = [server.greedy(str(model), stream_prompt(i), 16)[0] for i in range(2)]
        if decode:
            row["tok_s"] = decode_run(server, [{"model": str(model)}], streams=1, tokens=64)["tok_s"]
        row["settled_gib"] = scheduler_memory(server)["rss_gib"]
        log = server.log_path.read_text()
        row["cache_reads"] = log.count("read from the packed-weight cache")
        row["packed"] = log.count("packed from a ")
        row["rebuilt"] = [line.split("kt_serve: ", 1)[1] for line in log.splitlines() if "packed from the checkpoint again" in line]
    finally:
        server.stop()
    print(json.dumps(row), flush=True)
    return row


def bytes_per_token(layout, fields: dict, expert_fmt: str, dense_fmt: str, head_fmt: str, group: int = 128) -> float:
    """What one decode step reads: the top-k share of the routed experts in their format, the decoder layers'
    projections in the dense format, lm_head in its own, every other layer tensor (norms, routers, GDN state
    parameters) in bf16; the embedding's one row and the vision tower not at all."""
    share = fields["num_experts_per_tok"] / (fields.get("num_experts") or fields["n_routed_experts"])
    total = 0.0
    for name, shape in layout:
        n = 1
        for d in shape:
            n *= d
        if expert_layer(name) is not None:
            total += share * n * bytes_per_weight(expert_fmt, shape[-1], group)
        elif name.endswith("lm_head.weight"):
            total += n * bytes_per_weight(head_fmt, shape[-1], group)
        elif is_projection(name, shape):
            total += n * bytes_per_weight(dense_fmt, shape[-1], group)
        elif ".layers." in name and "visual" not in name:
            total += 2 * n
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint, cache and logs go here (the checkpoint is reused)")
    ap.add_argument("--preset", choices=list(PRESETS), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    ap.add_argument("--checkpoint", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--expert-dtype", default="int4")
    ap.add_argument("--dense-dtype", default="int8")
    ap.add_argument("--skip-refusal", action="store_true")
    args = ap.parse_args(argv)
    family, fields = PRESETS[args.preset]
    fields = dict(fields)
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    config = hf_config(family, fields)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    layout = checkpoint_layout(family, config)
    model = write_checkpoint(out / f"{args.preset}-{fields['num_hidden_layers']}l-{args.checkpoint}", family, config,
                             layout, args.checkpoint == "fp8")
    disk = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    print(f"checkpoint {model}: {disk / 1e9:.1f} GB ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"CPU: {cpu_model()}; kernel isa {_kernel.cpu_isa()}; {os.cpu_count()} cores", flush=True)
    cache = out / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    flags = lambda dense, head: ["--kt-expert-dtype", args.expert_dtype, "--kt-dense-dtype", dense,  # noqa: E731
                                 "--kt-lm-head-dtype", head, "--kt-weight-cache", str(cache)]
    base = flags(args.dense_dtype, "bf16")
    try:
        first = start(model, base, "first start (cache empty)", True, out)
    except ServerStartError as exc:  # refused at start (it would not fit this host), or failed: nothing to compare
        print(next((ln for ln in str(exc).splitlines() if "will not fit" in ln), str(exc)), flush=True)
        return 1
    rows = [first, start(model, base, "second start (cache)", True, out)]
    layer_files = sorted(cache.rglob("layer_*.safetensors"))
    victim = layer_files[min(7, len(layer_files) - 1)]
    data = bytearray(victim.read_bytes()[-4096:])
    data[100] ^= 0x10
    with open(victim, "r+b") as f:  # one flipped bit near the end of one layer file
        f.seek(-4096, os.SEEK_END)
        f.write(bytes(data))
    rows.append(start(model, base, f"{victim.name} corrupted", False, out))
    bw = measure_bandwidth_gbs()
    for label, dense, head in (("int8 lm_head", args.dense_dtype, "int8"), ("int4 dense, int8 lm_head", "int4", "int8")):
        rows.append(start(model, flags(dense, head), label, True, out))
    bw = max(bw, measure_bandwidth_gbs())
    refusal = None
    if not args.skip_refusal:
        t = time.perf_counter()
        try:
            with SGLangServer(model, ["--kt-weight-cache", str(cache)], max_total_tokens=None, startup_timeout=3600):
                refusal = ("served", time.perf_counter() - t)
        except ServerStartError as exc:
            line = next((ln for ln in str(exc).splitlines() if "will not fit" in ln), str(exc).splitlines()[-1])
            refusal = (line.strip(), time.perf_counter() - t)
    print(f"\nCPU: {cpu_model()}; kernel isa {_kernel.cpu_isa()}; checkpoint {args.checkpoint} "
          f"{fields['num_hidden_layers']} layers, {disk / 1e9:.1f} GB on disk; streaming read {bw:.1f} GB/s\n")
    print("| start | ready (s) | peak RSS while loading (GiB) | settled RSS (GiB) | peak / settled | MoE layers read "
          "from cache / packed | 1-stream tok/s | bytes / token (GB) | % of read | greedy = first start's |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        flags = row["flags"]
        fmt = lambda flag, default: (flags.split(flag + " ")[1].split()[0] if flag + " " in flags else default)  # noqa: E731
        bpt = bytes_per_token(layout, fields, fmt("--kt-expert-dtype", "bf16"), fmt("--kt-dense-dtype", "bf16"),
                              fmt("--kt-lm-head-dtype", "bf16"))
        tok_s = row.get("tok_s")
        print(f"| {row['start']} ({flags.split(' --kt-weight-cache')[0]}) "
              f"| {row['ready_s']:.0f} | {row['peak_gib']:.2f} | {row['settled_gib']:.2f} "
              f"| {row['peak_gib'] / row['settled_gib']:.3f} | {row['cache_reads']} / {row['packed']} "
              f"| {f'{tok_s:.1f}' if tok_s else '-'} | {bpt / 1e9:.2f} "
              f"| {f'{tok_s * bpt / 1e9 / bw * 100:.0f}%' if tok_s else '-'} | {row['greedy'] == rows[0]['greedy'] if row['flags'] == rows[0]['flags'] else '(other formats)'} |")
    for row in rows:
        for line in row["rebuilt"]:
            print(f"\n{row['start']}: {line}")
    print(f"\nfirst / second start: {rows[0]['ready_s'] / rows[1]['ready_s']:.1f}x")
    if refusal:
        print(f"\n--kt-expert-dtype auto (FP8 experts), no other flag: after {refusal[1]:.1f} s: {refusal[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
