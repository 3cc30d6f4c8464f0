"""``python -m kt_serve.train CONFIG.yaml [key=value ...]``: MoE LoRA SFT with routed experts in the CPU kernel.

Writes a KT SFT output directory (adapter_model.safetensors, fused_expert_lora.safetensors, adapter_config.json,
kt_adapter_manifest.json) plus checkpoint-N/, trainer_log.jsonl and, with plot_loss, training_loss.png.
"""

from __future__ import annotations

import logging

from kt_serve.train.config import ConfigError, TrainConfig, load_config

logger = logging.getLogger("kt_serve.train")


def train(cfg: TrainConfig) -> list[dict]:
    """Run one training job; returns the log history. Cheap checks (config, output_dir, data) come before the
    model is loaded, so a bad field fails in seconds."""
    import torch
    from transformers import AutoTokenizer

    from kt_serve.kernel import set_num_threads
    from kt_serve.train.data import SFTDataset
    from kt_serve.train.model import TrainModel
    from kt_serve.train.trainer import Trainer, prepare_output_dir

    resume_from = prepare_output_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    dataset = SFTDataset.build(cfg, tokenizer)
    if cfg.kt_config.threads is not None:
        set_num_threads(cfg.kt_config.threads)
    torch.manual_seed(cfg.seed)
    tm = TrainModel.load(cfg)
    logger.info("%d examples; trainable parameters: %s; non-expert device: %s", len(dataset), tm.parameter_report(),
                tm.device)
    return Trainer(cfg, tm, dataset).train(resume_from)


__all__ = ["ConfigError", "TrainConfig", "load_config", "train"]
