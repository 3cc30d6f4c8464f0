"""``python -m kt_serve.train CONFIG.yaml [key=value ...]``: MoE LoRA SFT with routed experts in the CPU kernel.

Writes a KT SFT output directory (adapter_model.safetensors, fused_expert_lora.safetensors, adapter_config.json,
kt_adapter_manifest.json) plus checkpoint-N/, trainer_log.jsonl and, with plot_loss, training_loss.png.
"""

from __future__ import annotations

import logging
import os

from kt_serve.train.config import ConfigError, TrainConfig, load_config

logger = logging.getLogger("kt_serve.train")


def _usable_threads(wanted: int) -> int:
    """Kernel threads: as asked, but never more than the CPUs this process may run on (a YAML written for a
    64-core host would otherwise oversubscribe a small one many times over)."""
    available = len(os.sched_getaffinity(0))
    if wanted > available:
        logger.warning("kernel threads: %d asked (kt_num_threads / cpu_infer / threads), but this process may run on "
                       "%d CPUs; using %d", wanted, available, available)
    return min(wanted, available)


def train(cfg: TrainConfig) -> list[dict]:
    """Run one training job; returns the log history. Cheap checks (config, output_dir, data) come before the
    model is loaded, so a bad field fails in seconds."""
    import torch
    from transformers import AutoTokenizer

    from kt_serve.kernel.threads import set_num_threads
    from kt_serve.train.data import SFTDataset
    from kt_serve.train.model import TrainModel
    from kt_serve.train.trainer import Trainer, prepare_output_dir

    for note in cfg.no_effect_notes():
        logger.info("config %s", note)
    resume_from = prepare_output_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    dataset = SFTDataset.build(cfg, tokenizer)
    if cfg.kt_config.threads is not None:
        set_num_threads(_usable_threads(cfg.kt_config.threads))
    torch.manual_seed(cfg.seed)
    tm = TrainModel.load(cfg)
    logger.info("%d %s; trainable parameters: %s; non-expert device: %s; gradient checkpointing: %s",
                len(dataset), "packed rows" if cfg.use_packing else "examples", tm.parameter_report(), tm.device,
                tm.checkpointing or "off")
    return Trainer(cfg, tm, dataset).train(resume_from)


__all__ = ["ConfigError", "TrainConfig", "load_config", "train"]
