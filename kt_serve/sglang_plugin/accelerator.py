"""A host with an accelerator (CUDA): what SGLang's code there asks of the plugin, decided in one place.

On such a host attention, shared experts, the router and SGLang's LoRA run on the device, and the routed experts in
the CPU kernel (experts.py ``_forward_offload``). Four things differ from a CPU-only host, and each is decided here
from the same switch SGLang's own code reads, so that the CPU emulation below exercises the real decision:

- **routed_scaling_factor** (DeepSeek-V2/V3, Kimi): on CUDA the model leaves the factor to the MoE runner
  (``deepseek_v2.py``: it multiplies only when ``not _is_cuda and not _is_musa and not _is_xpu``), so our method
  applies it, folded into the top-k weights (exact, free).
- **CUDA graphs**: the CPU expert call cannot be captured yet (it synchronizes and reads the batch's adapter slots
  on the host), so graph capture is turned off where the user left it at SGLang's default, with one log line, and
  an explicit graph backend is refused at launch instead of crashing at capture.
- **Gate LoRA** runs outside graphs: accepted whenever no phase captures one, by any spelling of the flags.
- **Parallel layouts** the kernel does not serve are refused at launch (EP, EPLB / redundant experts, DeepEP-style
  all-to-all, DP attention with LoRA, SGLang's own ``--kt-weight-path``).

``KT_SERVE_EMULATE_ACCELERATOR=1`` (tests, and ``python -m kt_serve.check --emulate``) runs a CPU server through
that code: the GPU host's hook set (no CPU-host fast paths), experts through ``_forward_offload``, LoRA Experts in
torch rather than the packed linears, and, once the model is loaded, the model files' accelerator switches turned
on where their branches run on CPU tensors (``deepseek_v2``, ``qwen2_moe``, ``qwen3_moe``: routed scaling, the
fp32 router GEMM, shared-expert conventions). What a CPU cannot show (pinned copies, streams, capture) is the GPU
self-check's job.
"""

from __future__ import annotations

import logging
import os
import sys

from .cpu_host.compat import cpu_only_host

logger = logging.getLogger(__name__)

EMULATION_ENV = "KT_SERVE_EMULATE_ACCELERATOR"
GRAPH_PHASES = ("decode", "prefill")
# Model modules whose accelerator switch the emulation turns on after load: their forward-time branches on it are
# the conventions around our layer, and run on CPU tensors (qwen3_5's call CUDA-only attention and GDN kernels).
EMULATED_MODEL_MODULES = ("sglang.srt.models.deepseek_v2", "sglang.srt.models.qwen2_moe",
                          "sglang.srt.models.qwen3_moe")


def emulated() -> bool:
    return os.environ.get(EMULATION_ENV) == "1"


def cpu_engine() -> bool:
    """Whether this process runs SGLang's CPU engine as itself, rather than the code an accelerator host runs (or
    its emulation)."""
    return cpu_only_host() and not emulated()


def accelerator_device(namespace) -> bool:
    """Whether a server launched with these arguments runs its model on an accelerator."""
    device = getattr(namespace, "device", None)
    return device != "cpu" and (device is not None or not cpu_only_host())


# -- launch (args.accelerator_launch_hook asks these) ----------------------------------------------------
def _explicit_graph_backends(namespace) -> dict[str, tuple[str, str]]:
    """phase -> (backend, the flag that set it) for the phases whose graph backend the user chose, by SGLang's
    precedence (cuda_graph_hook.parse_cuda_graph_config: JSON > per-phase flags > legacy switches)."""
    chosen = {}
    if getattr(namespace, "disable_cuda_graph", False):
        chosen = {phase: ("disabled", "--disable-cuda-graph") for phase in GRAPH_PHASES}
    for phase in GRAPH_PHASES:
        if getattr(namespace, f"disable_{phase}_cuda_graph", False):
            chosen[phase] = ("disabled", f"--disable-{phase}-cuda-graph")
        backend = getattr(namespace, f"cuda_graph_backend_{phase}", None)
        if backend is not None:
            chosen[phase] = (str(backend), f"--cuda-graph-backend-{phase} {backend}")
    raw = getattr(namespace, "cuda_graph_config", None)
    raw = raw.to_dict() if hasattr(raw, "to_dict") else raw
    for phase, settings in (raw or {}).items():
        if isinstance(settings, dict) and "backend" in settings:
            chosen[phase] = (str(settings["backend"]), f"--cuda-graph-config {phase}.backend={settings['backend']}")
    return chosen


def decide_graph_backends(namespace) -> list[str]:
    """BEFORE ServerArgs.from_cli_args, on an accelerator host with the kernel on: every graph phase the user left
    at SGLang's default is set to disabled on the namespace (returned, for the log line); a phase the user set to
    capture is refused (SystemExit naming the flag)."""
    chosen = _explicit_graph_backends(namespace)
    for phase, (backend, flag) in chosen.items():
        if backend != "disabled":
            raise SystemExit(f"kt_serve: {flag}: the routed experts run in the kt_serve CPU kernel, which a CUDA graph "
                             f"cannot capture yet; use --cuda-graph-backend-{phase} disabled (or leave it out: "
                             "kt_serve then turns graphs off), or pass --kt-moe off for SGLang's own MoE path")
    turned_off = [phase for phase in GRAPH_PHASES if phase not in chosen]
    for phase in turned_off:
        setattr(namespace, f"cuda_graph_backend_{phase}", "disabled")
    return turned_off


def unsupported_parallel_layout(namespace, lora: bool) -> str | None:
    """One line refusing a parallel layout the kernel's MoE method does not serve, naming the flag and what to use
    instead; None where the layout is served. ``lora``: per-request adapters are enabled."""
    if getattr(namespace, "kt_weight_path", None):
        return ("kt_serve: --kt-weight-path is SGLang's own KTransformers wrapper, which would take the routed "
                "experts from the kt_serve kernel; drop it (kt_serve reads the experts from the checkpoint), or pass "
                "--kt-moe off to serve with SGLang's wrapper instead")
    if (getattr(namespace, "ep_size", 1) or 1) > 1:
        return (f"kt_serve: --ep-size {namespace.ep_size}: the kt_serve kernel holds each MoE layer's routed experts "
                "in one CPU process; drop --ep-size (with --tp-size each rank holds a slice of every expert), or pass "
                "--kt-moe off")
    a2a = getattr(namespace, "moe_a2a_backend", "none") or "none"
    if a2a != "none":
        return (f"kt_serve: --moe-a2a-backend {a2a}: the kt_serve kernel takes SGLang's standard dispatch only; "
                "drop the flag, or pass --kt-moe off")
    if (getattr(namespace, "enable_eplb", False) or (getattr(namespace, "ep_num_redundant_experts", 0) or 0) > 0
            or (getattr(namespace, "init_expert_location", "trivial") or "trivial") != "trivial"):
        return ("kt_serve: --enable-eplb / --ep-num-redundant-experts / --init-expert-location: the kt_serve kernel "
                "holds each routed expert once, in checkpoint order (no redundant or relocated experts); drop those "
                "flags, or pass --kt-moe off")
    dp_attention = getattr(namespace, "enable_dp_attention", False) or (getattr(namespace, "attn_dp_size", 1) or 1) > 1
    if dp_attention and lora:
        return ("kt_serve: DP attention (--attn-dp-size / --enable-dp-attention) with LoRA: the MoE layers see the "
                "tokens of every DP rank, while each request's adapter is known on its own rank only; serve adapters "
                "without DP attention (use --tp-size), or drop --enable-lora")
    return None


# -- scheduler ----------------------------------------------------------------------------------------------------
def graphs_fully_off(server_args) -> bool:
    """SGLang's own "no CUDA graph anywhere" question (cuda_graph_fully_disabled), true on a CPU device."""
    if (getattr(server_args, "device", "cpu") or "cpu") == "cpu":
        return True
    from sglang.srt.model_executor.cuda_graph_config import cuda_graph_fully_disabled

    return cuda_graph_fully_disabled()


def model_scales_routed_output(block) -> bool:
    """Whether the MoE block's own forward multiplies the routed output by routed_scaling_factor on this host: the
    predicate of deepseek_v2.DeepseekV2MoE.forward_normal, read from the same module switches."""
    module = sys.modules[type(block).__module__]
    from sglang.srt.layers.moe.kt_ep_wrapper import KTEPWrapperMethod

    fused = getattr(block, "routed_scaling_factor_fused_in_topk", False)
    return ((not module._is_cuda and not module._is_musa and not module._is_xpu
             and not (module._use_aiter and fused))
            or isinstance(block.experts.quant_method, KTEPWrapperMethod))


# MoE blocks whose routed_scaling_factor convention is known: type name -> its predicate
SCALING_CONVENTIONS = {"DeepseekV2MoE": model_scales_routed_output}


def routed_scale(block, layer) -> float:
    """The factor the kernel's method must apply to its routed output in ``block`` (1.0: the model applies it, or
    TopK already did, or there is none); refuses a block with a factor whose convention is not known here."""
    factor = layer.moe_runner_config.routed_scaling_factor
    if factor is None or float(factor) == 1.0 or getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False):
        return 1.0
    convention = SCALING_CONVENTIONS.get(type(block).__name__)
    if convention is None:
        if cpu_engine():
            return 1.0  # on a CPU host SGLang's models apply it themselves
        raise ValueError(f"kt_serve: {type(block).__name__} (MoE layer {layer.layer_id}) scales its routed experts by "
                         f"routed_scaling_factor {factor}; where that happens on an accelerator host is not known to "
                         "kt_serve for this model; serve it on a CPU-only host, or pass --kt-moe off")
    return 1.0 if convention(block) else float(factor)


def emulate_after_load() -> None:
    """The emulation's switch: the model modules' accelerator branches from now on (after their layers were built
    for the CPU)."""
    for name in EMULATED_MODEL_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            module._is_cuda = True
