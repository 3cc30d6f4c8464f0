"""Model surgery: a HF MoE causal LM whose routed experts run in the CPU kernel with trainable expert LoRA.

Only the routed-expert computation is replaced. Every MoE block keeps its own router (softmax or sigmoid scores,
top-k, norm_topk_prob, DeepSeek grouped top-k and routed_scaling_factor) and calls
``experts(hidden_states, top_k_index, top_k_weights)``; ``CPUExperts`` has that same call, so the block's forward
is untouched and the routing weights receive gradients from the kernel's backward. Non-expert LoRA (attention,
shared experts, dense MLPs, router) goes through PEFT, which is attached after the surgery and so never sees the
routed experts.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from kt_serve.formats.names import ordered_target_modules
from kt_serve.kernel import weight_cache
from kt_serve.train.expert_autograd import MoELoRAExperts, expert_checkpoint_contexts
from kt_serve.train.fp8_checkpoint import Fp8Checkpoint
from kt_serve.train.lora_experts import attach_lora_experts, lora_experts_state_dict

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# Kernel parameters trained for each targeted expert projection (the others stay at their zero-B init).
EXPERT_PARAMS = {proj: (f"{proj[:-5]}_lora_a", f"{proj[:-5]}_lora_b") for proj in EXPERT_PROJS}
ROUTER_LEAF = "gate"
NEVER_TARGETED = ("lm_head",)
logger = logging.getLogger(__name__)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class CPUExperts(MoELoRAExperts):
    """A MoE block's routed experts in the CPU kernel, called like the HF experts module it replaces.

    Inputs from a GPU are copied to the CPU and the result copied back (both differentiable). ``_apply`` is a
    no-op so that ``model.to("cuda")`` or ``model.to(torch.bfloat16)`` leaves the kernel's fp32 LoRA parameters
    on the CPU in fp32, where the kernel reads and accumulates them.
    """

    def forward(self, hidden_states, top_k_index, top_k_weights):
        device = hidden_states.device
        out = super().forward(hidden_states.to("cpu"), top_k_index.to("cpu"), top_k_weights.to("cpu", torch.float32))
        return out.to(device)

    def _apply(self, fn, recurse=True):
        return self


@dataclass
class MoEBlock:
    layer: int  # decoder-layer index, the key of the fused expert file
    path: str  # module path of the block, e.g. "model.layers.3.mlp"
    block: nn.Module


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """MoE blocks with fused routed experts (transformers 5.x: ``experts.gate_up_proj [E,2I,H]``, ``down_proj [E,H,I]``).

    Checkpoints on disk with per-expert keys are fused by transformers at load time, so they arrive here fused too.
    """
    blocks = []
    for path, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if experts is None or isinstance(module, CPUExperts):
            continue
        if isinstance(experts, nn.ModuleList):
            raise ValueError(f"{path}.experts is a per-expert ModuleList (transformers 4.x modeling code); load the "
                             "checkpoint with the transformers 5.x class of this family, whose experts are fused")
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and isinstance(down, torch.Tensor)):
            continue
        num_experts, two_i, hidden = gate_up.shape
        if down.shape != (num_experts, hidden, two_i // 2):
            raise ValueError(f"{path}.experts: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} "
                             "are not [E,2I,H] and [E,H,I] (transposed expert layouts are not supported)")
        match = _LAYER_INDEX.search(path + ".")
        if match is None:
            raise ValueError(f"{path}: cannot find the decoder-layer index in the module path")
        blocks.append(MoEBlock(int(match.group(1)), path, module))
    return blocks


def replace_routed_experts(model: nn.Module, rank: int, alpha: float, fp8=None, weight_cache_dir=None,
                           model_dir=None, **kernel_options) -> dict[int, CPUExperts]:
    """Swap every block's HF experts for ``CPUExperts`` (the kernel packs its own copy of the base weights, in
    ``weight_format``, so the HF tensors are released right after); returns the kernel modules by decoder-layer
    index. ``kernel_options``: ``dropout``, ``max_tokens``, ``isa`` and ``weight_format`` of :class:`MoELoRAExperts`.
    ``fp8``: the :class:`~kt_serve.train.fp8_checkpoint.Fp8Checkpoint` the model came from: experts are packed from
    its e4m3 weights and block scales, not from the bf16 values transformers dequantized. ``weight_cache_dir``
    (``kt_weight_path``): the packed-weight cache the server writes (``--kt-weight-cache``), read for the layers
    it holds in this format and written for the others, so a run packs each layer of a checkpoint once."""
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no MoE block with fused routed experts found")
    kernels = {}
    for b in blocks:
        experts = b.block.experts
        packed, cache = None, None
        if weight_cache_dir is not None:
            E, two_i, H = experts.gate_up_proj.shape
            cache = weight_cache.layer_file(weight_cache_dir, model_dir, b.layer, dict(
                weight_format=kernel_options.get("weight_format", "bf16"), group_size=128, shard=(0, 1),
                shape=(int(E), int(H), int(two_i) // 2)))
            packed = _cached(b.layer, cache, kernel_options)
        if packed is not None:
            weights = {}
        elif fp8 is not None:
            weights = fp8.expert_weights(b.path, experts.gate_up_proj.shape[0])
        else:
            weights = dict(gate_up_proj=experts.gate_up_proj.detach().cpu(), down_proj=experts.down_proj.detach().cpu())
        kernel = CPUExperts(**weights, rank=rank, alpha=alpha, packed=packed, **kernel_options)
        if cache is not None and packed is None:
            try:
                weight_cache.store(cache[0], kernel._experts, cache[1])
            except OSError as exc:  # the cache saves time only
                logger.warning("layer %d: packed experts not written to %s: %s", b.layer, cache[0], exc)
        b.block.experts = kernel
        kernels[b.layer] = kernel
    return kernels


def _cached(layer: int, cache, kernel_options):
    """The layer's packed experts from the cache, or None (logged when a file was there but could not serve)."""
    if cache is None:
        return None
    try:
        packed = weight_cache.load(*cache, max_tokens=kernel_options.get("max_tokens", 65536), max_slots=1,
                                   isa=kernel_options.get("isa", "auto"))
    except weight_cache.CacheMiss as miss:
        if cache[0].exists():
            logger.warning("layer %d: packed experts packed from the checkpoint again: %s", layer, miss)
        return None
    logger.info("layer %d: %s experts read from the packed-weight cache %s", layer, packed.weight_format,
                cache[0].parent)
    return packed


@dataclass
class PeftTargets:
    modules: list[str]  # full paths of nn.Linear modules
    parameters: list[str]  # full names of router weights (TopK routers are not nn.Linear in transformers 5.x)
    expert_projs: list[str]  # routed-expert projections trained in the kernel

    @property
    def leaves(self) -> list[str]:
        leaves = {m.rsplit(".", 1)[-1] for m in self.modules} | {p.rsplit(".", 2)[-2] for p in self.parameters}
        return ordered_target_modules(leaves | set(self.expert_projs))


def resolve_targets(model: nn.Module, lora_target: list[str]) -> PeftTargets:
    """LLaMA-Factory ``lora_target`` semantics: ``all`` = every nn.Linear except lm_head, plus the routers and the
    routed experts; otherwise module leaf names. ``gate_proj/up_proj/down_proj`` name both the routed experts
    (trained in the kernel) and shared-expert / dense MLP projections (PEFT); ``gate`` names the router."""
    use_all = "all" in lora_target
    if use_all and len(lora_target) > 1:
        raise ValueError("lora_target: 'all' cannot be combined with other names")
    wanted = set(lora_target)
    modules, parameters = [], []
    for path, module in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear):
            if leaf not in NEVER_TARGETED and (use_all or leaf in wanted):
                modules.append(path)
        elif leaf == ROUTER_LEAF and isinstance(getattr(module, "weight", None), nn.Parameter) \
                and module.weight.dim() == 2 and (use_all or leaf in wanted):
            parameters.append(f"{path}.weight")
    expert_projs = [p for p in EXPERT_PROJS if use_all or p in wanted]
    found = {m.rsplit(".", 1)[-1] for m in modules} | ({ROUTER_LEAF} if parameters else set()) | set(EXPERT_PROJS)
    missing = sorted(wanted - found - {"all"})
    if missing:
        raise ValueError(f"lora_target: no module named {', '.join(missing)} in {type(model).__name__}")
    return PeftTargets(modules, parameters, expert_projs)


@contextlib.contextmanager
def _without_peft_v4_target_conversion():
    """PEFT >= 0.19 rewrites LoRA targets of MoE model types for transformers 5 so that adapters trained on 4.x
    load: any target ending in ``.gate_proj/.up_proj/.down_proj`` becomes the fused expert parameter. For a fresh
    adapter with exact module paths that silently drops shared-expert targets (DeepSeek ``shared_experts.*``) and
    points PEFT at routed experts, so it is switched off while the adapter is created."""
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.get_checkpoint_conversion_mapping
    conversion.get_checkpoint_conversion_mapping = lambda model_type: None
    try:
        yield
    finally:
        conversion.get_checkpoint_conversion_mapping = original


def _set_linear_lora_dropout(model: nn.Module, p: float) -> None:
    """PEFT's dropout on every nn.Linear LoRA. A LoRA on a parameter (the routers, PEFT's ParamWrapper) cannot
    factor x out of ``B(A(dropout(x)))``, so PEFT refuses dropout there; those stay without it, as logged."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for module in model.modules():
        if isinstance(module, LoraLinear):
            for name in module.lora_dropout:
                module.lora_dropout[name] = nn.Dropout(p)
    logger.info("lora_dropout %.3g applies to every LoRA except the routers' (PEFT cannot drop the input of a "
                "LoRA on the router weight); name lora_target without `gate` to leave the routers untrained instead",
                p)


class TrainModel:
    """The model being trained: PEFT-wrapped HF model with kernel experts, plus what export and the optimizer need."""

    def __init__(self, model: nn.Module, kernels: dict[int, CPUExperts], targets: PeftTargets, cfg,
                 device: torch.device):
        self.model = model
        self.kernels = kernels  # by decoder-layer index
        self.targets = targets
        self.cfg = cfg
        self.device = device  # of the non-expert modules and the input batches
        self.checkpointing: str | None = None

    @classmethod
    def load(cls, cfg) -> "TrainModel":
        import peft
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        fp8 = Fp8Checkpoint.detect(cfg.model_name_or_path)
        extra = {}
        if fp8 is not None:
            from transformers import FineGrainedFP8Config

            # Dense FP8 linears load as plain nn.Linear on every device, as they do on a CPU: PEFT wraps them, and
            # transformers' FP8Linear would need the `kernels` package on a GPU. restore_dense sets their values.
            extra["quantization_config"] = FineGrainedFP8Config(weight_block_size=tuple(fp8.block), dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path, dtype=dtype,
                                                     trust_remote_code=cfg.trust_remote_code, **extra)
        model.config.use_cache = False
        if fp8 is not None:
            logger.info("FP8 checkpoint: %d dense linears set from the file's blocks; routed experts packed from its "
                        "e4m3 weights as %s", fp8.restore_dense(model), cfg.kt_config.kt_expert_weight_format)
        torch.manual_seed(cfg.seed)  # LoRA init (kernel experts, then PEFT) is a function of the seed
        kernels = replace_routed_experts(model, cfg.lora_rank, cfg.lora_alpha, fp8=fp8,
                                         weight_cache_dir=cfg.kt_weight_path, model_dir=cfg.model_name_or_path,
                                         dropout=cfg.lora_dropout,
                                         max_tokens=cfg.kernel_max_tokens, isa=cfg.kt_config.isa,
                                         weight_format=cfg.kt_config.kt_expert_weight_format)
        targets = resolve_targets(model, cfg.lora_targets)
        if targets.modules or targets.parameters:
            # Router LoRA (PEFT target_parameters) cannot take dropout, so dropout is set per module afterwards.
            dropout_at_creation = 0.0 if targets.parameters else cfg.lora_dropout
            lora_config = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=dropout_at_creation,
                                          target_modules=targets.modules, target_parameters=targets.parameters or None,
                                          bias="none", task_type="CAUSAL_LM")
            with _without_peft_v4_target_conversion():
                model = peft.get_peft_model(model, lora_config)
            if cfg.lora_dropout > 0 and targets.parameters:
                _set_linear_lora_dropout(model, cfg.lora_dropout)
        for kernel in kernels.values():  # PEFT froze everything it does not own
            for proj, names in EXPERT_PARAMS.items():
                for name in names:
                    getattr(kernel, name).requires_grad_(proj in targets.expert_projs)
        if cfg.kt_use_lora_experts:  # after PEFT, which would otherwise put LoRA on them (lora_target: all)
            blocks = [(p, m) for p, m in model.named_modules() if isinstance(getattr(m, "experts", None), CPUExperts)]
            count = attach_lora_experts(blocks, cfg.kt_lora_expert_num, cfg.kt_lora_expert_intermediate_size)
            logger.info("LoRA Experts: %d x SwiGLU(I=%d) on each of %d MoE blocks, %s values", cfg.kt_lora_expert_num,
                        cfg.kt_lora_expert_intermediate_size, len(blocks), f"{count:,}")
        if not targets.expert_projs and not targets.modules and not targets.parameters \
                and not cfg.kt_use_lora_experts:
            raise ValueError(f"lora_target: {cfg.lora_target} leaves nothing to train")
        device = cfg.kt_config.dense_device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model.to(device)  # CPUExperts stay on the CPU
        wrapped = cls(model, kernels, targets, cfg, torch.device(device))
        wrapped._check_no_peft_in_experts()
        if cfg.gradient_checkpointing:
            wrapped.enable_gradient_checkpointing(retain_expert_activations=cfg.kt_cpu_activation == "retain")
        return wrapped

    def enable_gradient_checkpointing(self, retain_expert_activations: bool) -> None:
        """Checkpoint every decoder layer (HF's non-reentrant checkpointing): its activations are recomputed in
        the backward. The kernel's experts follow it: they keep no state in the first forward and are recomputed
        with the layer, or, with ``retain_expert_activations`` (KT's ``kt_cpu_activation: retain``), keep their
        state from the first forward and are skipped in the recompute (more host memory, less CPU work)."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        if not base.supports_gradient_checkpointing:
            raise ValueError(f"disable_gradient_checkpointing: false, but {type(base).__name__} does not support "
                             "gradient checkpointing; set disable_gradient_checkpointing: true")
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": functools.partial(expert_checkpoint_contexts, retain_expert_activations)})
        self.checkpointing = "retain expert activations" if retain_expert_activations else "recompute"

    def set_dropout_seed(self, step: int, micro_batch: int) -> None:
        """The kernel's expert-LoRA dropout masks are a function of (seed, step, micro-batch, layer): the same in
        a checkpoint recompute, and the same again when a run resumes at that step."""
        for layer, kernel in self.kernels.items():
            key = f"{self.cfg.seed}/{step}/{micro_batch}/{layer}".encode()
            kernel.dropout_seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")

    def _check_no_peft_in_experts(self):
        from peft.tuners.tuners_utils import BaseTunerLayer

        kernel_paths = [p for p, m in self.model.named_modules() if isinstance(m, CPUExperts)]
        for path, module in self.model.named_modules():
            if isinstance(module, BaseTunerLayer) and (
                any(isinstance(m, CPUExperts) for m in module.modules())
                or any(path.startswith(k + ".") for k in kernel_paths)
            ):
                raise AssertionError(f"PEFT wrapped {path}: routed experts must be trained only in the kernel")

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def parameter_report(self) -> str:
        groups: dict[str, int] = {}
        kernel_params = {id(p) for k in self.kernels.values() for p in k.parameters()}
        for name, p in self.named_trainable_parameters().items():
            if id(p) in kernel_params:
                group = "routed experts (kernel)"
            elif ".lora_experts." in name:
                group = "LoRA Experts"
            elif f".{ROUTER_LEAF}." in name:
                group = "router"
            elif ".mlp." in name:
                group = "shared/dense MLP"
            else:
                group = "attention/other"
            groups[group] = groups.get(group, 0) + p.numel()
        return ", ".join(f"{g}: {n:,}" for g, n in sorted(groups.items()))

    # ---------------------------------------------------------------------------------------------- export

    def nonexpert_state_dict(self) -> dict[str, torch.Tensor]:
        """PEFT keys (``base_model.model.model.layers...lora_A.weight``) of the non-expert LoRA, and KT's keys of the
        LoRA Experts."""
        import peft

        lora_experts = lora_experts_state_dict(self.model)
        if not isinstance(self.model, peft.PeftModel):
            return lora_experts
        kernel_paths = tuple(p + "." for p, m in self.model.named_modules() if isinstance(m, CPUExperts))
        state = peft.get_peft_model_state_dict(self.model)
        # PEFT's state dict takes every name with "lora_" in it, the LoRA Experts too: they come from the line above
        return {**{k: v.detach().cpu().contiguous() for k, v in state.items()
                   if not k.startswith(kernel_paths) and ".lora_experts." not in k}, **lora_experts}

    def expert_state_dict(self) -> dict[int, dict[str, torch.Tensor]]:
        """Per decoder layer, the six KT fused tensors (``gate_lora_a`` ...) in bf16."""
        return {layer: kernel.lora().to_kt() for layer, kernel in sorted(self.kernels.items())}

    def adapter_config(self) -> dict:
        """A plain PEFT LoraConfig (no KT-specific fields), targets given as leaf names like LLaMA-Factory saves."""
        import peft

        config = peft.LoraConfig(r=self.cfg.lora_rank, lora_alpha=self.cfg.lora_alpha,
                                 lora_dropout=self.cfg.lora_dropout, target_modules=self.targets.leaves, bias="none",
                                 task_type="CAUSAL_LM", base_model_name_or_path=str(self.cfg.model_name_or_path))
        config = config.to_dict()
        config["target_modules"] = self.targets.leaves  # to_dict() turns the list into an unordered set
        return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
