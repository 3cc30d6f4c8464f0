"""A composite adapter dir split into what SGLang applies, the routed-expert half and the gate LoRA.

A composite adapter (merged PEFT dir or KT SFT output dir) has its non-expert half written as a plain PEFT adapter
to a cache dir (once per adapter version) and handed to SGLang; its expert half goes into one kernel slot of every
MoE layer, LoRA on the router and gates SGLang has no layer for to gate_lora, KT-FT's LoRA Experts to lora_experts
(registry.py does all three).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..config import get_config

logger = logging.getLogger(__name__)


EMPTY_HALF_TARGET = "o_proj"  # a module every served family has; an empty half holds no tensor for it


class AdapterError(ValueError):
    """An adapter that cannot be served as given; the message is one line naming its path."""


def _cache_root() -> Path:
    configured = get_config().lora_cache_dir
    if configured:
        return Path(configured)
    user = os.environ.get("USER") or str(os.getuid())
    return Path(tempfile.gettempdir()) / f"kt_serve_lora_cache_{user}"


def _fingerprint(path: Path) -> str:
    """Stable name of a split: the dir and the size/mtime of its files (a changed adapter gets a new split)."""
    h = hashlib.sha256(b"kt_serve split v3\0" + str(path.resolve()).encode())
    for f in sorted(path.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


@dataclass
class SplitAdapter:
    sglang_path: str          # what SGLang's LoRA manager loads
    experts: object | None    # AdapterSource with the routed-expert half (its tensors still on disk), or None
    gates: dict               # gate LoRA (formats.sglang_modules.split_gate_modules), for gate_lora
    scaling: float            # lora_alpha / r of the adapter
    lora_experts: object | None = None  # formats.lora_experts.LoRAExperts (KT-FT), for lora_experts.py


def split_composite(path: str, gdn_dims=None) -> SplitAdapter:
    """Read an adapter dir and split it into what SGLang applies, the routed-expert half and the gate LoRA.

    A dir with expert tensors, gate LoRA, or non-expert modules SGLang names otherwise (formats.sglang_modules:
    Qwen3.5's in_proj_qkv, with the model's ``gdn_dims``) gets the half SGLang applies written (once) to
    ``<cache>/<fingerprint>/nonexpert`` in SGLang's names; a module nothing can apply is refused here.
    """
    from kt_serve.formats import nonexpert_config, open_adapter_dir, write_peft_adapter
    from kt_serve.formats.sglang_modules import needs_sglang_names, split_gate_modules, to_sglang_modules

    adapter = open_adapter_dir(path)  # expert tensors stay on disk: the registry reads them layer by layer
    scaling = float(adapter.alpha) / adapter.rank if adapter.rank else 1.0
    rename = needs_sglang_names(adapter.nonexpert)
    experts = adapter if adapter.experts is not None else None
    if experts is None and not rename and adapter.lora_experts is None:
        return SplitAdapter(path, None, {}, scaling)
    nonexpert, gates = split_gate_modules(path, adapter.nonexpert)
    targets = None
    if not nonexpert:
        # Nothing for SGLang's LoRA layers (expert LoRA, LoRA Experts or gate LoRA only), but SGLang knows a request's
        # adapter by its half: an empty one (no tensors, so zero LoRA wherever SGLang looks) lets it be named
        targets = [EMPTY_HALF_TARGET]
    elif rename:
        nonexpert, targets = to_sglang_modules(path, nonexpert, gdn_dims or {})
    target = _cache_root() / _fingerprint(Path(path)) / "nonexpert"
    if not (target / "adapter_config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            config = nonexpert_config(adapter.config, rank=adapter.rank, alpha=adapter.alpha,
                                      base_model_name_or_path=adapter.config.get("base_model_name_or_path") or "",
                                      nonexpert_keys=nonexpert)
            if targets is not None:
                config["target_modules"] = targets
            write_peft_adapter(target, nonexpert, config, overwrite=False)
        except FileExistsError:
            pass  # another scheduler (TP rank) wrote the same split first
        logger.info("kt_serve: split adapter %s; the half SGLang applies, in its module names -> %s", path, target)
    return SplitAdapter(str(target), experts, gates, scaling, adapter.lora_experts)
