"""DeepSeek's MLA attention: LoRA on every projection through SGLang's own LoRA manager, also on a CPU host, and the
absorbed MLA path on the CPU's torch_native attention backend (:func:`handler_torch_native`).

Projections of an MLA layer (SGLang module names): ``q_proj`` (no q compression) or ``fused_qkv_a_proj_with_mqa``
(q_a_proj + kv_a_proj_with_mqa) and ``q_b_proj`` (q_lora_rank set); ``kv_a_proj_with_mqa`` (no q compression);
``kv_b_proj``; ``o_proj``. SGLang 0.5.23 wraps them in its LoRA layers, but on this model:

* ``q_proj`` / ``kv_a_proj_with_mqa`` names are normalised to ``qkv_proj`` / ``fused_qkv_a_proj_with_mqa``, which
  an MLA layer without q compression does not have (the weights were then skipped, or loading failed on the
  missing v_proj); here they keep their own names, with their shapes, on MLA models;
* a lone ``kv_a_proj_with_mqa`` (or ``q_a_proj``) of a q_lora_rank model is fused with a zero partner of the
  wrong shape; here the partner gets its own shape;
* ``ReplicatedLinearWithLoRA`` without a fused boundary calls the torch_native backend without its output offsets;
* the absorbed MLA forward never runs ``kv_b_proj``: it multiplies by ``w_kc`` / ``w_vc`` (slices of kv_b_proj's
  weight) and adds kv_b_proj's LoRA with Triton kernels (``deepseek_mla_correction``). On CPU tensors that
  correction runs here in torch, per segment of tokens sharing an adapter slot, so a mixed batch gives each
  request its own adapter's W_kc + s·B_k·A and W_vc + s·(B_v·A)ᵀ; the base weights are never touched.

An adapter LoRA on any other module of an MLA attention layer is refused at load, naming the module.
"""

from __future__ import annotations

import glob
import os

import torch

_FUSED_A = "fused_qkv_a_proj_with_mqa"
_MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
# q_lora_rank of the MLA model this scheduler serves ("none" for no q compression); None: not an MLA model.
# get_normalized_target_modules has no model argument, and one scheduler process serves one model.
_served = {"q_lora_rank": None}


def is_mla(config) -> bool:
    """A DeepSeek-V2/V3 (and Kimi-K2, model_type deepseek_v3) config: MLA attention of SGLang's DeepseekV2."""
    return getattr(config, "model_type", None) in _MLA_MODEL_TYPES and bool(getattr(config, "kv_lora_rank", None))


def attention_targets(config) -> tuple[str, ...]:
    """The MLA projections an adapter may put LoRA on, as named in its PEFT keys."""
    query = ("q_a_proj", "q_b_proj", _FUSED_A) if getattr(config, "q_lora_rank", None) else ("q_proj",)
    return (*query, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


# -- which modules, and their shapes -----------------------------------------------------------------------------
def record_model(manager, *args, **kwargs):
    """BEFORE LoRAManager.init_state (adapters are read, then targets inferred, then layers wrapped)."""
    config = manager.base_hf_config
    _served["q_lora_rank"] = (getattr(config, "q_lora_rank", None) or "none") if is_mla(config) else None


def _own_names() -> set[str]:
    """Names that keep their own LoRA target on the served MLA model instead of SGLang's stacked one."""
    if _served["q_lora_rank"] is None:
        return set()
    return {"q_proj", "kv_a_proj_with_mqa"} if _served["q_lora_rank"] == "none" else set()


def normalized_targets(original, target_modules):
    """AROUND utils.get_normalized_target_modules: q_proj / kv_a_proj_with_mqa stay themselves on an MLA model
    without q compression (SGLang would map them to qkv_proj / fused_qkv_a_proj_with_mqa, which it lacks)."""
    own = _own_names()
    if not own or isinstance(target_modules, str):
        return original(target_modules)
    names = list(target_modules)
    kept = {name.split(".")[-1] for name in names} & own
    return original([n for n in names if n.split(".")[-1] not in own]) | kept


def hidden_dim(original, module_name, config, *args, **kwargs):
    """AROUND utils.get_default_hidden_dim: (fan_in, fan_out) of the MLA modules SGLang's table lacks."""
    if is_mla(config) and module_name == "q_proj":
        return config.hidden_size, config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
    if is_mla(config) and module_name == "kv_a_proj_with_mqa":
        return config.hidden_size, config.kv_lora_rank + config.qk_rope_head_dim
    return original(module_name, config, *args, **kwargs)


def detected_targets(result, model, *args, **kwargs):
    """AFTER utils.auto_detect_lora_target_modules (--lora-target-modules all): add the MLA names kept above."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return set(result) | (_own_names() & names)


def normalize_qkv(original, adapter, weight_names, weights):
    """AROUND LoRAAdapter.normalize_qkv_proj: an MLA q_proj has no k/v to be stacked with."""
    if is_mla(adapter.base_hf_config):
        return None
    return original(adapter, weight_names, weights)


def normalize_fused_a(original, adapter, weight_names, weights):
    """AROUND LoRAAdapter.normalize_fused_qkv_a_proj: on a q_lora_rank model, give a lone q_a_proj or
    kv_a_proj_with_mqa a zero partner of its own shape before SGLang fuses them; leave other models' names."""
    config = adapter.base_hf_config
    if not is_mla(config):
        return original(adapter, weight_names, weights)
    if not getattr(config, "q_lora_rank", None):
        return None  # q_a_proj here is refused by refuse_unsupported; kv_a_proj_with_mqa is its own target
    rows = {"q_a_proj": config.q_lora_rank, "kv_a_proj_with_mqa": config.kv_lora_rank + config.qk_rope_head_dim}
    for name in list(weights):
        for present, missing in (("q_a_proj", "kv_a_proj_with_mqa"), ("kv_a_proj_with_mqa", "q_a_proj")):
            if f".{present}." not in name or _FUSED_A in name:
                continue
            partner = name.replace(f".{present}.", f".{missing}.")
            if partner in weights:
                continue
            w = weights[name]
            shape = w.shape if "lora_A" in name else (rows[missing], w.shape[1])
            weights[partner] = torch.zeros(shape, dtype=w.dtype)
    return original(adapter, list(weights), weights)


def _adapter_module_names(lora_config) -> list[str]:
    """Module paths of the adapter's LoRA tensors (the keys of its safetensors or .bin files)."""
    from safetensors import safe_open

    keys = set()
    for path in sorted(glob.glob(os.path.join(str(lora_config.path), "*.safetensors"))):
        with safe_open(path, "pt") as f:
            keys.update(f.keys())
    if not keys:
        for path in sorted(glob.glob(os.path.join(str(lora_config.path), "*.bin"))):
            keys.update(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    return sorted({key.split(".lora_")[0] for key in keys if ".lora_" in key})


def refuse_unsupported(manager, lora_config, lora_ref, *args, **kwargs):
    """BEFORE LoRAManager.validate_new_adapter: LoRA on an MLA attention module other than the projections this
    model has is refused (SGLang would skip its weights with a warning) in one line naming the module."""
    config = manager.base_hf_config
    if not is_mla(config):
        return None
    allowed = attention_targets(config)
    for module in _adapter_module_names(lora_config):
        parent, _, leaf = module.rpartition(".")
        if (parent == "self_attn" or parent.endswith(".self_attn")) and leaf not in allowed:
            q_rank = getattr(config, "q_lora_rank", None)
            raise ValueError(f"LoRA adapter '{lora_ref.lora_name}': LoRA on self_attn.{leaf} is not supported on "
                             f"this DeepSeek MLA model (q_lora_rank={q_rank}); its attention LoRA targets are "
                             f"{', '.join(allowed)}")
    return None


# -- forward -----------------------------------------------------------------------------------------------------
def replicated_apply_lora(original, layer, base_output, x):
    """AROUND ReplicatedLinearWithLoRA.apply_lora: its unfused branch (first_output_dim 0, here
    kv_a_proj_with_mqa without q compression) passes the torch_native backend no output_offset_cpu."""
    if layer.first_output_dim or layer.lora_backend.name != "torch_native":
        return original(layer, base_output, x)
    lora_a = layer.lora_backend.run_lora_a_sgemm(x, layer.A_buffer)
    return layer.lora_backend.run_lora_b_sgemm(x=lora_a, weights=layer.B_buffer,
                                               output_offset_cpu=layer._output_offset.cpu(), base_output=base_output)


def _segments(attn, tokens: int):
    """(start, stop, A [r, kv_lora_rank], B [heads, nope + v, r], scaling) per run of tokens with an adapter, or
    None where the backend's batch is not the torch_native one (SGLang's Triton kernels then run)."""
    layer = attn.kv_b_proj
    info = getattr(layer.lora_backend, "batch_info", None)
    if getattr(info, "seg_lens_cpu", None) is None or info.use_cuda_graph:
        return None
    lens = info.seg_lens_cpu[: info.num_segments].tolist()
    if sum(lens) != tokens:
        raise RuntimeError(f"kt_serve: kv_b_proj LoRA: the batch has {tokens} tokens, its LoRA segments {sum(lens)}")
    heads, per_head = attn.num_local_heads, attn.qk_nope_head_dim + attn.v_head_dim
    out, start = [], 0
    for n, slot in zip(lens, info.weight_indices_cpu[: info.num_segments].tolist()):
        rank = int(info.lora_ranks_cpu[slot])
        if n and rank:
            B = layer.B_buffer[slot].view(heads, per_head, -1)[:, :, :rank]
            out.append((start, start + n, layer.A_buffer[slot, :rank], B, float(info.scalings_cpu[slot])))
        start += n
    return out


def kv_b_q_correction(original, attn, q_nope, q_nope_out):
    """AROUND deepseek_mla_correction.apply_q_correction: q_nope_out[t, h] += s · (q_nope[t, h] · B_k[h]) · A,
    i.e. q_nope against W_k + s·B_k·A, for the adapter of each token (q_nope [T, H, nope], q_nope_out [T, H, kv])."""
    segments = _segments(attn, q_nope.shape[0]) if q_nope.device.type == "cpu" else None
    if segments is None:
        return original(attn, q_nope, q_nope_out)
    nope = attn.qk_nope_head_dim
    for start, stop, A, B, scaling in segments:  # fp32 in between, one rounding into q_nope_out (as Triton's)
        low = torch.bmm(q_nope[start:stop].transpose(0, 1).float(), B[:, :nope, :].float())    # [H, n, r]
        delta = (low @ A.float()).transpose(0, 1) * scaling
        q_nope_out[start:stop] = (q_nope_out[start:stop].float() + delta).to(q_nope_out.dtype)
    return q_nope_out


def kv_b_v_correction(original, attn, attn_output, attn_bmm_flat):
    """AROUND deepseek_mla_correction.apply_v_correction: out[t, h] += s · B_v[h] · (A · latent[t, h]), i.e. the
    latent attention output through W_v + s·B_v·A (attn_output [T, H, kv], attn_bmm_flat [T, H * v])."""
    segments = _segments(attn, attn_output.shape[0]) if attn_output.device.type == "cpu" else None
    if segments is None:
        return original(attn, attn_output, attn_bmm_flat)
    nope = attn.qk_nope_head_dim
    out = attn_bmm_flat.view(-1, attn.num_local_heads, attn.v_head_dim)
    for start, stop, A, B, scaling in segments:
        low = (attn_output[start:stop].float() @ A.float().T).transpose(0, 1)                  # [H, n, r]
        delta = torch.bmm(low, B[:, nope:, :].float().transpose(1, 2)).transpose(0, 1) * scaling
        out[start:stop] = (out[start:stop].float() + delta).to(out.dtype)
    return attn_bmm_flat


def handler_torch_native(original, registry, backend_name):
    """AROUND DeepSeek's AttentionBackendRegistry.get_handler: absorbed MLA on the torch_native backend.

    SGLang registers no DeepSeek handler for torch_native (the CPU default), so it falls back to Triton's, which
    picks MHA for a prefill; torch_native's MHA then reads the MLA latent cache as per-head K and fails ("Expected
    size ... [4, 32] but got: [4, 48]"). The absorbed MLA path, which decode uses anyway, reads that cache right.
    """
    if backend_name != "torch_native":
        return original(registry, backend_name)
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    return lambda attn, forward_batch: AttnForwardMethod.MLA
