"""Qwen3.5 on SGLang's CPU engine without sgl-kernel: torch implementations of the CPU ops it calls, and their install.

On a CPU host, SGLang 0.5.23's ``models/qwen3_5.py`` and its GDN backend (``layers/attention/linear/gdn_backend.py``,
``.../kernels/gdn_triton.py``) bind sgl-kernel CPU ops at import time; the stand-in ``sgl_kernel`` that
launch/cpu_shims installs has none of them. :func:`install_qwen35_cpu_ops` registers, in the ``sgl_kernel`` torch
library namespace, each op below that no real kernel provides (same schema, semantics, dtypes and in-place
behaviour as sgl-kernel/csrc/cpu), and on the stand-in only, the ``sgl_kernel.mamba`` Python wrappers. Call it in
every process before ``sglang.srt.models.qwen3_5`` or the GDN backend is imported.

:func:`rms_norm_gated_forward_hook` is an AROUND hook for fla's gated ``RMSNorm.forward`` (RMSNormGated, whose CPU
branch needs AMX and whose other branch is Triton). Norms, gates and splits here; conv1d and the delta rule in
qwen35_gdn. :func:`hybrid_cache_on_cpu` picks the Mamba cache strategy a CPU host can run.
"""

from __future__ import annotations

import importlib
import logging
import sys

import torch
import torch.nn.functional as F

from ..config import local_model_config
from ..cpu_host.compat import cpu_only_host
from ..adapters import gate_lora
from ..log import log_once
from . import qwen35_gdn

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- norms and gates


def fused_sigmoid_mul_cpu(input, gate):
    """input *= sigmoid(gate), in place. input: [T, H*D] contiguous; gate: [T, H*D] or a [T, H, D] view. bf16 in C++
    (kt_serve.kernel.activation, what the one-call decode step runs), else the torch formula."""
    if input.dim() != 2 or gate.dim() not in (2, 3) or gate.shape[0] != input.shape[0]:
        raise ValueError(f"fused_sigmoid_mul_cpu: input [T, H*D] and gate [T, H*D] or [T, H, D] expected, got "
                         f"{tuple(input.shape)} and {tuple(gate.shape)}")
    from kt_serve.kernel.activation import sigmoid_mul

    if sigmoid_mul(input, gate) is None:
        input.copy_(input.float() * torch.sigmoid(gate.float()).reshape(input.shape))


def _gemma_heads(x, weight, eps, heads, head_dim):
    """Gemma RMSNorm per head: x·rsqrt(mean x² + eps)·(1 + w), fp32; [T, heads, head_dim] -> [T*heads, head_dim].
    bf16 in C++ (kt_serve.kernel.norm, what the one-call decode step runs), else the torch formula."""
    from kt_serve.kernel.norm import gemma_rms_norm_heads

    from ..cpu_host.norm import fp32_weight_of

    if x.dtype == torch.bfloat16 and weight.dim() == 1 and weight.shape[0] == head_dim:
        out = torch.empty(x.shape[0], heads * head_dim, dtype=x.dtype)  # a fresh copy: x may view the caller's qkv
        out.view(x.shape[0], heads, head_dim).copy_(x.reshape(x.shape[0], heads, head_dim))
        return gemma_rms_norm_heads(out, fp32_weight_of(weight, plus_one=True), eps, head_dim).view(-1, head_dim)
    xf = x.reshape(x.shape[0], heads, head_dim).float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return y.to(x.dtype).reshape(-1, head_dim)


def fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps, head_dim):
    """q: [T, Hq*D], k: [T, Hk*D] (views allowed) -> normalised copies of the same shapes."""
    qo = _gemma_heads(q, q_weight, eps, q.shape[1] // head_dim, head_dim).view(q.shape)
    ko = _gemma_heads(k, k_weight, eps, k.shape[1] // head_dim, head_dim).view(k.shape)
    return qo, ko


def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_weight, k_weight, eps, head_dim, num_head):
    """q_gate: [T, H*2*D], per head [q_h | gate_h]; k: [T, Hk*D] -> (q [T*H, D], k [T*Hk, D], gate [T*H, D])."""
    if q_gate.shape[1] != num_head * head_dim * 2:
        raise ValueError(f"fused_qk_gemma_rmsnorm_with_gate_cpu: q_gate width {q_gate.shape[1]} != "
                         f"2 * {num_head} heads * {head_dim}")
    qg = q_gate.reshape(q_gate.shape[0], num_head, 2, head_dim)
    qo = _gemma_heads(qg[:, :, 0], q_weight, eps, num_head, head_dim)
    ko = _gemma_heads(k, k_weight, eps, k.shape[1] // head_dim, head_dim)
    return qo, ko, qg[:, :, 1].reshape(-1, head_dim).clone(memory_format=torch.contiguous_format)


def rms_norm_gated(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True,
                   activation="swish"):
    """fla's gated RMSNorm (fp32): norm(x)·w(+b)·act(z) if norm_before_gate else norm(x·act(z))·w(+b), act silu
    ("swish"/"silu") or sigmoid, per group of group_size (None: the whole row). z: x's shape, or [T, H, N] for
    x [T*H, N]. Output in x's dtype and shape."""
    if activation not in ("swish", "silu", "sigmoid"):
        raise ValueError(f"rms_norm_gated: activation {activation!r} is not one of swish, silu, sigmoid")
    n = x.shape[-1]
    xf = x.reshape(-1, n).float()
    gate = None
    if z is not None:
        zf = z.reshape(xf.shape).float()
        gate = torch.sigmoid(zf) if activation == "sigmoid" else F.silu(zf)
        if not norm_before_gate:
            xf = xf * gate
    group = group_size or n
    xg = xf.view(xf.shape[0], n // group, group)
    y = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + eps)).view(xf.shape) * weight.float()
    if bias is not None:
        y = y + bias.float()
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype).view(x.shape)


def fused_rmsnorm_gated_cpu(input, weight, gate, eps):
    """sgl-kernel's RMSNormGated op (AMX hosts): norm before gate, SiLU gate, one group."""
    return rms_norm_gated(input, weight, None, gate, eps)


def rms_norm_gated_forward_hook(original, module, x, z=None):
    """AROUND hook for fla's gated RMSNorm.forward: SGLang's own path on an accelerator or with the AMX kernel, else
    ours
    (the CPU branch needs AMX, the other one is Triton: "Torch not compiled with CUDA enabled"): bf16 with the norm
    before the gate (Qwen3.5) in one C++ pass (kt_serve.kernel.norm.gated_rms_norm), anything else rms_norm_gated."""
    layernorm_gated = sys.modules.get(type(module).__module__)  # fla's layernorm_gated
    if x.device.type != "cpu" or getattr(layernorm_gated, "_use_cpu", False):
        return original(module, x, z)
    if (z is not None and module.norm_before_gate and module.activation in ("swish", "silu", "sigmoid")
            and x.dtype == torch.bfloat16 and z.dtype == torch.bfloat16 and z.numel() == x.numel()):
        from kt_serve.kernel.norm import gated_rms_norm

        from ..cpu_host.norm import fp32_weight

        log_once(logger, "gated RMSNorm on the kt_serve kernel (one C++ pass per call)")
        bias = None if module.bias is None else module.bias.detach().float()
        return gated_rms_norm(x, z, fp32_weight(module), module.eps, module.group_size or x.shape[-1], bias,
                              module.activation == "sigmoid")
    log_once(logger, "gated RMSNorm on its torch formula, not the C++ pass (x %s, z %s, norm before the gate: %s)",
             x.dtype, getattr(z, "dtype", None), module.norm_before_gate)
    return rms_norm_gated(x, module.weight, module.bias, z, module.eps, module.group_size, module.norm_before_gate,
                          module.activation)


def fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Qwen3.5's contiguous projection [q | k | v | z], [b | a] -> (mixed_qkv [T, 2*Hk*Dk + Hv*Dv], z [T, Hv, Dv],
    b [T, Hv], a [T, Hv]), each a fresh contiguous tensor."""
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    if mixed_qkvz.shape[1] != qkv_dim + num_heads_v * head_v or mixed_ba.shape[1] != 2 * num_heads_v:
        raise ValueError(f"fused_qkvzba_split_reshape_cat_contiguous_cpu: widths {mixed_qkvz.shape[1]}, "
                         f"{mixed_ba.shape[1]} do not fit {num_heads_qk}x{head_qk} qk / {num_heads_v}x{head_v} v heads")
    tokens = mixed_qkvz.shape[0]
    fresh = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731 - an op's outputs never alias inputs
    z = mixed_qkvz[:, qkv_dim:].reshape(tokens, num_heads_v, head_v)
    return fresh(mixed_qkvz[:, :qkv_dim]), fresh(z), fresh(mixed_ba[:, :num_heads_v]), fresh(mixed_ba[:, num_heads_v:])


def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    """g = -exp(A_log)·softplus(a + dt_bias) (fp32, [1, T, H]) and beta = sigmoid(b) ([1, T, H], b's dtype)."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g.unsqueeze(0), torch.sigmoid(b.float()).to(b.dtype).unsqueeze(0)


# ------------------------------------------------------------------------------------------------------ install

_SCHEMAS = {
    "fused_sigmoid_mul_cpu": ("(Tensor(a!) input, Tensor gate) -> ()", fused_sigmoid_mul_cpu),
    "fused_qk_gemma_rmsnorm_cpu": (
        "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim) -> (Tensor, Tensor)",
        fused_qk_gemma_rmsnorm_cpu),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim, int num_head) -> "
        "(Tensor, Tensor, Tensor)", fused_qk_gemma_rmsnorm_with_gate_cpu),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, int num_heads_v, int head_qk, int head_v) -> "
        "(Tensor, Tensor, Tensor, Tensor)", fused_qkvzba_split_reshape_cat_contiguous_cpu),
    "fused_gdn_gating_cpu": ("(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
                             fused_gdn_gating_cpu),
    "fused_rmsnorm_gated_cpu": ("(Tensor input, Tensor weight, Tensor gate, float eps) -> Tensor",
                                fused_rmsnorm_gated_cpu),
    "causal_conv1d_fwd_cpu": (
        "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states, Tensor? query_start_loc, "
        "Tensor? cache_indices, Tensor? has_initial_state, bool silu_activation, int pad_slot_id, bool is_vnni) -> "
        "Tensor", qwen35_gdn.causal_conv1d_fwd_cpu),
    "causal_conv1d_update_cpu": (
        "(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, bool silu_activation, Tensor? cache_seqlens, "
        "Tensor? conv_state_indices, int pad_slot_id, bool is_vnni) -> Tensor", qwen35_gdn.causal_conv1d_update_cpu),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, "
        "Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens, "
        "bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor",
        qwen35_gdn.fused_sigmoid_gating_delta_rule_update_cpu),
    "chunk_gated_delta_rule_cpu": (
        "(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, Tensor(a!) initial_state, "
        "bool output_final_state, Tensor cu_seqlens, bool head_first, bool use_qk_l2norm_in_kernel, "
        "Tensor? initial_state_indices=None, float eps=1e-6) -> (Tensor, Tensor)",
        qwen35_gdn.chunk_gated_delta_rule_cpu),
}

_library = None  # kept alive: dropping the Library would unregister the ops
_ours: set[str] = set()


def _sgl(name):
    return getattr(torch.ops.sgl_kernel, name)


# sgl_kernel.mamba's Python wrappers (sgl-kernel/python/sgl_kernel/mamba.py), with the call-site keywords of
# gdn_backend.py / gdn_triton.py. Conv weights are plain here: only the real kernel packs them (AMX).


def causal_conv1d_fn_cpu(mixed_qkv_transposed, conv_weights, bias, activation, conv_states, has_initial_state,
                         cache_indices, query_start_loc, seq_lens_cpu):
    return _sgl("causal_conv1d_fwd_cpu")(mixed_qkv_transposed, conv_weights, bias, conv_states, query_start_loc,
                                         cache_indices, has_initial_state, activation in ("silu", "swish"), -1, False)


def causal_conv1d_update_cpu(mixed_qkv, conv_states, conv_weights, bias, activation, conv_state_indices,
                             intermediate_conv_window=None, intermediate_state_indices=None, retrieve_next_token=None,
                             retrieve_next_sibling=None, retrieve_parent_token=None):
    if intermediate_conv_window is not None:
        raise NotImplementedError("causal_conv1d_update_cpu: speculative target-verify is not supported by "
                                  "kt_serve's CPU GDN ops")
    return _sgl("causal_conv1d_update_cpu")(mixed_qkv, conv_states, conv_weights, bias,
                                            activation in ("silu", "swish"), None, conv_state_indices, -1, False)


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens, head_first, use_qk_l2norm_in_kernel,
                               initial_state_indices):
    out, final = _sgl("chunk_gated_delta_rule_cpu")(q, k, v, g, beta, initial_state, True, cu_seqlens, head_first,
                                                    use_qk_l2norm_in_kernel, initial_state_indices)
    return out, final, None  # no per-chunk states (h): radix-cache state tracking is off on CPU


def fused_sigmoid_gating_delta_rule_update_cpu(*, A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                                               softplus_beta=1.0, softplus_threshold=20.0, **verify):
    if any(value is not None and value is not False for value in verify.values()):
        raise NotImplementedError("fused_sigmoid_gating_delta_rule_update_cpu: speculative target-verify is not "
                                  "supported by kt_serve's CPU GDN ops")
    return _sgl("fused_sigmoid_gating_delta_rule_update_cpu")(
        A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices, cu_seqlens,
        use_qk_l2norm_in_kernel, softplus_beta, softplus_threshold)


_MAMBA_WRAPPERS = (causal_conv1d_fn_cpu, causal_conv1d_update_cpu, chunk_gated_delta_rule_cpu,
                   fused_sigmoid_gating_delta_rule_update_cpu)


def install_qwen35_cpu_ops() -> list[str]:
    """Register every op above that no real sgl-kernel provides; set the sgl_kernel.mamba wrappers on kt_serve's
    stand-in sgl_kernel. Idempotent. Returns the names served by kt_serve (ops, then mamba.<wrapper>)."""
    global _library
    try:
        import sgl_kernel  # a real sgl-kernel registers its ops on import
    except Exception:  # noqa: BLE001 - absent or broken: nothing of it to keep
        sgl_kernel = None
    for name, (schema, impl) in _SCHEMAS.items():
        if name in _ours or hasattr(torch.ops.sgl_kernel, name):
            continue
        if _library is None:
            _library = torch.library.Library("sgl_kernel", "FRAGMENT")
        _library.define(name + schema)
        _library.impl(name, impl, "CPU")
        _ours.add(name)
    served = sorted(_ours)
    if sgl_kernel is not None and getattr(sgl_kernel, "KT_SERVE_STUB", False):
        mamba = importlib.import_module("sgl_kernel.mamba")
        for wrapper in _MAMBA_WRAPPERS:
            setattr(mamba, wrapper.__name__, wrapper)
        served += [f"mamba.{wrapper.__name__}" for wrapper in _MAMBA_WRAPPERS]
    return served


def lora_safe_fused_input_proj_probe(result, layer, *args, **kwargs):
    """AFTER Qwen3_5GatedDeltaNet.__init__: its lazy probe for the AMX fused input projection reads
    ``in_proj_qkvz.bias``, which SGLang's LoRA wrapper of in_proj_qkvz lacks; the AttributeError inside the lazy
    value then recurses without end (RecursionError on the first forward with a linear-attention adapter). A
    wrapped projection cannot take the fused path, so the probe answers no instead; so does an ``in_proj_ba`` that
    the plugin's gate LoRA wraps (the fused kernel would read its weight and skip the LoRA)."""
    probe = getattr(layer, "_fused_input_proj_cpu_enabled", None)
    creator = getattr(probe, "_creator", None)
    if creator is None:
        return result

    def probe_without_lora_wrappers():
        if gate_lora.wraps(layer.in_proj_ba):
            return False
        try:
            return creator()
        except AttributeError:
            return False

    probe._creator = probe_without_lora_wrappers
    return result


def _hybrid_linear_attention(model_path) -> bool:
    """Whether a local checkpoint mixes linear-attention (GDN / Mamba) layers with full attention (Qwen3.5)."""
    config = local_model_config(model_path)
    if config is None:
        return False
    text = config.get("text_config") or config
    return "linear_attention" in (text.get("layer_types") or []) or "full_attention_interval" in text


def hybrid_cache_on_cpu(*args, **kwargs):
    """BEFORE ServerArgs.from_cli_args: on a CPU host, a hybrid linear-attention model keeps its radix cache with
    the no_buffer Mamba strategy and no overlap schedule.

    SGLang's "auto" strategy picks extra_buffer whenever the overlap schedule is on, then refuses it on a CPU
    ("extra_buffer requires platform support for Mamba cache state snapshots"). An explicit strategy, or
    --disable-radix-cache, is the user's and stays.
    """
    import argparse

    namespace = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, argparse.Namespace)), None)
    if (namespace is None or not cpu_only_host() or getattr(namespace, "disable_radix_cache", False)
            or getattr(namespace, "mamba_radix_cache_strategy", None) != "auto"
            or not _hybrid_linear_attention(getattr(namespace, "model_path", None))):
        return None
    namespace.mamba_radix_cache_strategy = "no_buffer"
    if not getattr(namespace, "disable_overlap_schedule", False):
        namespace.disable_overlap_schedule = True
    logger.warning(
        "kt_serve: hybrid linear-attention model on a CPU host: radix cache with --mamba-radix-cache-strategy "
        "no_buffer and --disable-overlap-schedule (SGLang's extra_buffer needs GPU state snapshots)")
    return None
