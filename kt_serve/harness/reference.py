"""Independent fp32 reference for the serving tests and the GPU self-check (kt_serve.check): HF transformers with
LoRA merged in plain torch.

Adapters are random tensors written as real KT SFT output dirs (non-expert PEFT file + fused expert file) through
kt_serve.formats. The reference never uses the plugin or the kernel: it loads the checkpoint in fp32 and adds
``alpha/r * B @ A`` to each targeted weight (attention, shared expert, and each routed expert of the transformers
5.x fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``), which equals applying the LoRA in the forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

EXPERT_SHAPES = {  # KT fused layout: name -> shape from (E, H, I, r)
    "gate_lora_a": lambda E, H, I, r: (E, r, H), "gate_lora_b": lambda E, H, I, r: (E, I, r),
    "up_lora_a": lambda E, H, I, r: (E, r, H), "up_lora_b": lambda E, H, I, r: (E, I, r),
    "down_lora_a": lambda E, H, I, r: (E, r, I), "down_lora_b": lambda E, H, I, r: (E, H, r),
}


def model_dims(model_dir) -> dict:
    """Expert sizes, and the (fan_in, fan_out) of the non-expert modules an adapter may target."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    E = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if "kv_lora_rank" in cfg:
        # DeepSeek MLA: every projection; q_proj without q compression, q_a_proj + q_b_proj with q_lora_rank.
        nope, rope, v, kv_rank, q_rank = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"],
                                          cfg["kv_lora_rank"], cfg.get("q_lora_rank"))
        query = ({"self_attn.q_a_proj": (H, q_rank), "self_attn.q_b_proj": (q_rank, heads * (nope + rope))} if q_rank
                 else {"self_attn.q_proj": (H, heads * (nope + rope))})
        attention = {**query, "self_attn.kv_a_proj_with_mqa": (H, kv_rank + rope),
                     "self_attn.kv_b_proj": (kv_rank, heads * (nope + v)), "self_attn.o_proj": (heads * v, H)}
        shared = "mlp.shared_experts", cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0)
    else:
        head_dim = cfg.get("head_dim") or H // heads
        q_out, kv_out = heads * head_dim, cfg["num_key_value_heads"] * head_dim
        attention = {"self_attn.q_proj": (H, q_out), "self_attn.v_proj": (H, kv_out), "self_attn.o_proj": (q_out, H)}
        shared = "mlp.shared_expert", cfg.get("shared_expert_intermediate_size") or 0
    prefix, shared_I = shared
    shared_modules = {f"{prefix}.gate_proj": (H, shared_I), f"{prefix}.up_proj": (H, shared_I),
                      f"{prefix}.down_proj": (shared_I, H)} if shared_I else {}
    gates = {"mlp.gate": (H, E), **({"mlp.shared_expert_gate": (H, 1)} if prefix == "mlp.shared_expert" and shared_I
                                    else {})}
    return dict(E=E, H=H, I=cfg["moe_intermediate_size"], L=cfg["num_hidden_layers"], attention=attention,
                shared_expert=shared_modules, gates=gates)


def random_adapter(model_dir, *, seed: int, rank: int = 4, attention: bool = True, experts: bool = True,
                   shared_expert: bool = False, gates: bool = False, lora_experts: int = 0,
                   lora_expert_size: int = 16, lora_expert_dtype=torch.bfloat16, scale: float = 0.1):
    """(nonexpert PEFT tensors keyed model.layers..., experts {layer: {kt name: tensor}}) with visible effect.
    gates: LoRA on the router (mlp.gate) and, where the model has one, the shared-expert gate.
    lora_experts: N KT-FT LoRA Experts of intermediate size ``lora_expert_size`` per layer (KT's keys, among the
    non-expert tensors), in ``lora_expert_dtype``."""
    d = model_dims(model_dir)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    if shared_expert and not d["shared_expert"]:
        raise ValueError(f"{model_dir}: the model has no shared expert")
    modules = {**(d["attention"] if attention else {}), **(d["shared_expert"] if shared_expert else {}),
               **(d["gates"] if gates else {})}
    nonexpert, expert = {}, {}
    for layer in range(d["L"]):
        for module, (fan_in, fan_out) in modules.items():
            nonexpert[f"model.layers.{layer}.{module}.lora_A.weight"] = rnd(rank, fan_in)
            nonexpert[f"model.layers.{layer}.{module}.lora_B.weight"] = rnd(fan_out, rank)
        if experts:
            expert[layer] = {name: rnd(*shape(d["E"], d["H"], d["I"], rank)) for name, shape in EXPERT_SHAPES.items()}
        for j in range(lora_experts):
            for proj, shape in (("gate", (lora_expert_size, d["H"])), ("up", (lora_expert_size, d["H"])),
                                ("down", (d["H"], lora_expert_size))):
                nonexpert[f"model.layers.{layer}.mlp.lora_experts.{j}.le_{proj}.weight"] = \
                    rnd(*shape).to(lora_expert_dtype)
    return nonexpert, expert


def write_kt_adapter(out_dir, model_dir, *, seed: int, rank: int = 4, alpha: float = 8.0, **kinds) -> Path:
    """A KT SFT output dir (what training writes): non-expert PEFT file + fused expert file."""
    from kt_serve.formats import write_kt_sft_output

    nonexpert, experts = random_adapter(model_dir, seed=seed, rank=rank, **kinds)
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[1] for k in nonexpert if ".lora_experts." not in k} |
                     ({"gate_proj", "up_proj", "down_proj"} if experts else set()))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets,
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
    return write_kt_sft_output(out_dir, nonexpert=nonexpert, experts=experts, adapter_config=config,
                               base_model_name_or_path=str(model_dir), overwrite=True)


def write_expert_peft_adapter(out_dir, model_dir, *, seed: int, rank: int = 4, alpha: float = 8.0) -> Path:
    """An expert-only PEFT adapter (per-expert keys, as the reference converter's expert dir)."""
    from kt_serve.formats import per_expert_key, write_peft_adapter

    _, experts = random_adapter(model_dir, seed=seed, rank=rank, attention=False)
    tensors = {}
    for layer, t in experts.items():
        for proj in ("gate", "up", "down"):
            for side, kt_side in (("A", "a"), ("B", "b")):
                for e, value in enumerate(t[f"{proj}_lora_{kt_side}"]):
                    tensors[per_expert_key(layer, e, proj, side)] = value.contiguous()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["gate_proj", "up_proj",
              "down_proj"], "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
              "base_model_name_or_path": str(model_dir)}
    return write_peft_adapter(out_dir, tensors, config, overwrite=True)


def routing_margin(router_logits, config) -> torch.Tensor:
    """Per token, the smallest gap between the last chosen and the first rejected softmax score over the routing's
    selection steps: the top-k experts, preceded by the top ``topk_group`` groups (scored by their best expert)
    for DeepSeek's group_limited_greedy."""
    k = config.num_experts_per_tok
    p = torch.softmax(router_logits.float(), -1)
    margins = []
    if getattr(config, "topk_method", None) == "group_limited_greedy":
        n_group, topk_group = config.n_group, config.topk_group
        group_scores = p.view(p.shape[0], n_group, -1).amax(-1)
        ranked = group_scores.sort(-1, descending=True).values
        margins.append(ranked[:, topk_group - 1] - ranked[:, topk_group])
        chosen = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, -1).indices, 1.0)
        p = p * chosen.repeat_interleave(p.shape[1] // n_group, dim=1)
    ranked = p.sort(-1, descending=True).values
    margins.append(ranked[:, k - 1] - ranked[:, k])
    return torch.stack(margins).amin(0)


class HFReference:
    """fp32 transformers model; ``logprobs(ids, start, adapter_dirs)`` merges the adapters' LoRA first."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.model_dir = str(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.base_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.lora_experts: dict[int, list] = {}  # layer -> [(gate, up, down) fp32] of the merged adapters
        for i, layer in enumerate(self.model.model.layers):  # kept on copies of the model too (deepcopy)
            layer.mlp.register_forward_hook(self._lora_experts_hook(i))

    def _add_lora_experts(self, peft: dict) -> None:
        """KT-FT LoRA Experts from the formula: the MoE block's output gains (1/N) Σ_j down_j (SiLU(gate_j x) *
        (up_j x)) on its input x (kept per layer; applied by forward hooks). Held in bf16 by the server, so
        rounded to bf16 first, as LoRA A/B are."""
        found: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        for key, value in peft.items():
            if ".mlp.lora_experts." in key:
                head, rest = key.split(".mlp.lora_experts.")
                layer, (j, proj) = int(head.rsplit(".", 1)[1]), rest.split(".")[:2]
                found.setdefault(layer, {}).setdefault(int(j), {})[proj[3:]] = value.to(torch.bfloat16).float()
        for layer, experts in found.items():
            self.lora_experts.setdefault(layer, []).append([experts[j] for j in range(len(experts))])

    def _lora_experts_hook(self, layer: int):
        def hook(module, args, output):
            if layer not in self.lora_experts:
                return None
            x = args[0].float()
            total = 0
            for experts in self.lora_experts[layer]:
                terms = [(torch.nn.functional.silu(x @ e["gate"].T) * (x @ e["up"].T)) @ e["down"].T for e in experts]
                total = total + sum(terms) / len(terms)
            if isinstance(output, tuple):
                return (output[0] + total.to(output[0].dtype), *output[1:])
            return output + total.to(output.dtype)
        return hook

    def _merge(self, adapter_dir) -> None:
        from safetensors.torch import load_file

        adapter_dir = Path(adapter_dir)
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        scale = config["lora_alpha"] / config["r"]
        params = dict(self.model.named_parameters())
        peft = load_file(adapter_dir / "adapter_model.safetensors") if (adapter_dir / "adapter_model.safetensors").exists() else {}
        self._add_lora_experts(peft)
        with torch.no_grad():
            for key, a in peft.items():
                if ".lora_A." not in key:
                    continue
                # Qwen3.5's ConditionalGeneration keys name the text model model.language_model.
                module = key.replace("base_model.model.", "").replace("model.language_model.", "model.")
                module = module.split(".lora_A.")[0]
                # SGLang's LoRA pool holds A and B in the model dtype (bf16): an fp32 adapter is served rounded
                b = peft[key.replace(".lora_A.", ".lora_B.")]
                delta = scale * (b.to(torch.bfloat16).float() @ a.to(torch.bfloat16).float())
                if ".mlp.experts." in module:  # per-expert PEFT key -> slice of the fused 5.x parameter
                    prefix, rest = module.split(".mlp.experts.")
                    e, proj = rest.split(".")
                    e, I = int(e), delta.shape[0] if proj != "down_proj" else delta.shape[1]
                    if proj == "down_proj":
                        params[f"{prefix}.mlp.experts.down_proj"][e] += delta
                    else:
                        rows = slice(0, I) if proj == "gate_proj" else slice(I, 2 * I)
                        params[f"{prefix}.mlp.experts.gate_up_proj"][e, rows] += delta
                    continue
                params[f"{module}.weight"] += delta
            fused = adapter_dir / "fused_expert_lora.safetensors"
            if fused.exists():
                tensors = load_file(fused)
                layers = sorted({int(k.split(".")[1]) for k in tensors})
                for layer in layers:
                    t = {name: tensors[f"layers.{layer}.experts.{name}"].float() for name in EXPERT_SHAPES}
                    gate_up = params[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
                    down = params[f"model.layers.{layer}.mlp.experts.down_proj"]
                    I = t["gate_lora_b"].shape[1]
                    gate_up[:, :I] += scale * torch.bmm(t["gate_lora_b"], t["gate_lora_a"])
                    gate_up[:, I:] += scale * torch.bmm(t["up_lora_b"], t["up_lora_a"])
                    down += scale * torch.bmm(t["down_lora_b"], t["down_lora_a"])

    @torch.no_grad()
    def logprobs(self, ids: list[int], start: int, adapter_dirs=()) -> list[float]:
        """log p(ids[i] | ids[:i]) for i in [start, len(ids)) with the given adapters merged (fp32)."""
        return self.logprobs_and_routing(ids, start, adapter_dirs)[0]

    @torch.no_grad()
    def logprobs_and_routing(self, ids: list[int], start: int, adapter_dirs=(), tie_margin: float = 1e-3):
        """(logprobs as above, first position whose routing is a near tie in some layer, or len(ids)).

        A served bf16 model can pick another expert (or group) where the reference's last chosen and first
        rejected routing probabilities differ by less than ``tie_margin`` (routing_margin); from that position on
        the two are different computations, so tests compare only the predictions made before it.
        """
        self.model.load_state_dict(self.base_state)
        self.lora_experts = {}
        for adapter_dir in adapter_dirs:
            self._merge(adapter_dir)
        router_logits = []
        hooks = [layer.mlp.gate.register_forward_pre_hook(
            lambda m, a: router_logits.append(a[0].reshape(-1, a[0].shape[-1]).float() @ m.weight.float().T))
            for layer in self.model.model.layers if hasattr(layer.mlp, "gate")]

        try:
            logits = self.model(torch.tensor([ids])).logits[0].float()
        finally:
            for h in hooks:
                h.remove()
        first_tie = len(ids)
        for layer_logits in router_logits:
            ties = (routing_margin(layer_logits, self.model.config) < tie_margin).nonzero()
            if len(ties):
                first_tie = min(first_tie, int(ties[0]))
        logp = torch.log_softmax(logits, dim=-1)
        return [float(logp[i - 1, ids[i]]) for i in range(start, len(ids))], first_tie


def pick_prompts(ref: HFReference, adapter_sets, *, n: int, length: int, tie_margin: float, seed: int = 0,
                 tries: int = 400) -> list[list[int]]:
    """``n`` random prompts of ``length`` tokens whose reference routing has no near-tie (closer than
    ``tie_margin``) under any of the adapter sets (lists of adapter dirs): past a near-tie a bf16 server may route
    differently, so such a prompt would leave nothing to compare."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(tries):
        prompt = torch.randint(3, 1000, (length,), generator=g).tolist()
        if all(ref.logprobs_and_routing(prompt, 1, dirs, tie_margin=tie_margin)[1] >= length for dirs in adapter_sets):
            prompts.append(prompt)
            if len(prompts) == n:
                return prompts
    raise RuntimeError(f"{tries} random prompts gave {len(prompts)} of {n} without a routing near-tie")


def compared_positions(ref: HFReference, prompt, ids, adapter_dirs, tie_margin: float):
    """(positions of ``ids`` predicted before the reference's first routing near-tie, the reference's logprobs of
    ``ids``, that first near-tie's position): what a served completion is compared on."""
    want, first_tie = ref.logprobs_and_routing(prompt + ids, len(prompt), adapter_dirs, tie_margin=tie_margin)
    keep = [i for i in range(min(len(ids), len(want))) if len(prompt) + i - 1 < first_tie]
    return keep, want, first_tie
