"""The training loop: AdamW, LR schedule, gradient accumulation, logging, checkpoint/resume, export and plot.

Loss of one optimizer step = summed token cross-entropy over all its micro-batches / number of label tokens in
the step, so gradient accumulation gives the same update as one large batch.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from kt_serve.formats.safetensors_io import staged_dirs
from kt_serve.train.data import IGNORE_INDEX, BatchPlan, SFTDataset

logger = logging.getLogger(__name__)

LOG_FILE = "trainer_log.jsonl"
PLOT_FILE = "training_loss.png"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_state.pth"
TRAINABLE_FILE = "trainable_params.safetensors"  # fp32 LoRA, exact for resume (the exported experts are bf16)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class OutputDirError(ValueError):
    pass


def _inside(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def prepare_output_dir(cfg) -> Path | None:
    """Validate output_dir before any work; returns the checkpoint to resume from, if any."""
    out = Path(cfg.output_dir).absolute()
    model_dir = Path(cfg.model_name_or_path).absolute()
    if _inside(out, model_dir) or _inside(model_dir, out):
        raise OutputDirError(f"output_dir {out}: must not be, contain or lie inside the base model directory {model_dir}")
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output_dir {out}: exists and is not a directory")
    resume = cfg.resume_from_checkpoint
    if resume not in (None, False):
        if resume is True:
            found = sorted((int(m.group(1)), p) for p in out.glob("checkpoint-*") if (m := CHECKPOINT_RE.match(p.name)))
            if not found:
                raise OutputDirError(f"resume_from_checkpoint: no checkpoint-N directory in {out}")
            return found[-1][1]
        path = Path(resume).absolute()
        if not (path / STATE_FILE).is_file():
            raise OutputDirError(f"resume_from_checkpoint {path}: not a checkpoint directory (no {STATE_FILE})")
        return path
    if out.is_dir() and any(out.iterdir()):
        if not cfg.overwrite_output_dir:
            raise OutputDirError(f"output_dir {out}: not empty; set overwrite_output_dir: true or resume_from_checkpoint")
    return None


def _rng_state() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _publish_adapter(tm, directory: Path, *, overwrite: bool) -> None:
    from kt_serve.formats import write_kt_sft_output

    write_kt_sft_output(directory, nonexpert=tm.nonexpert_state_dict(), experts=tm.expert_state_dict(),
                        adapter_config=tm.adapter_config(), base_model_name_or_path=str(tm.cfg.model_name_or_path),
                        overwrite=overwrite)


def plot_loss(log_history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in log_history]
    losses = [e["loss"] for e in log_history]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses, label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"training loss of {path.parent.name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class Trainer:
    def __init__(self, cfg, tm, dataset: SFTDataset):
        from transformers import get_scheduler

        self.cfg, self.tm, self.dataset = cfg, tm, dataset
        self.output_dir = Path(cfg.output_dir).absolute()
        self.plan = BatchPlan(len(dataset), cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.seed)
        self.total_steps = self.plan.total_steps(cfg.num_train_epochs, cfg.max_steps)
        self.params = tm.named_trainable_parameters()
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=cfg.learning_rate,
                                           betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                                           weight_decay=cfg.weight_decay)
        warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * self.total_steps)
        self.scheduler = get_scheduler(cfg.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup,
                                       num_training_steps=self.total_steps)
        self.global_step = 0
        self.log_history: list[dict] = []

    # ------------------------------------------------------------------------------------------------ steps

    def training_step(self, groups: list[list[int]], batches: list[dict] | None = None) -> tuple[float, int]:
        """Forward/backward over one optimizer step's micro-batches (collated here unless given); returns
        (loss, tokens processed)."""
        if batches is None:
            batches = [self.dataset.collate(indices) for indices in groups]
        num_labels = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
        total = 0.0
        for micro, batch in enumerate(batches):
            self.tm.set_dropout_seed(self.global_step, micro)
            batch = {k: v.to(self.tm.device) for k, v in batch.items()}
            labels = batch.pop("labels")
            logits = self.tm.model(**batch).logits
            loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                       ignore_index=IGNORE_INDEX, reduction="sum")
            (loss_sum / num_labels).backward()
            total += loss_sum.item()
        return total / num_labels, sum(self.dataset.num_tokens(indices) for indices in groups)

    def optimizer_step(self) -> None:
        if self.cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------------------------------- checkpoints

    def _plan_record(self) -> dict:
        return {**asdict(self.plan), "total_steps": self.total_steps}

    def save_checkpoint(self) -> Path:
        """checkpoint-N: the adapter, the fp32 trainable parameters and (unless save_only_model) everything resume
        needs; then the oldest checkpoints beyond save_total_limit are removed."""
        from safetensors.torch import save_file

        target = self.output_dir / f"checkpoint-{self.global_step}"
        with staged_dirs([target], overwrite=True) as (tmp,):
            staged = tmp / "adapter"
            _publish_adapter(self.tm, staged, overwrite=False)
            for item in staged.iterdir():
                os.replace(item, tmp / item.name)
            staged.rmdir()
            save_file({n: p.detach().cpu().contiguous() for n, p in self.params.items()}, tmp / TRAINABLE_FILE)
            if not self.cfg.save_only_model:
                torch.save(self.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
                torch.save(self.scheduler.state_dict(), tmp / SCHEDULER_FILE)
                torch.save(_rng_state(), tmp / RNG_FILE)
            state = {"global_step": self.global_step, "plan": self._plan_record(), "log_history": self.log_history,
                     "save_only_model": self.cfg.save_only_model}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        self._rotate_checkpoints()
        return target

    def _rotate_checkpoints(self) -> None:
        limit = self.cfg.save_total_limit
        if limit is None:
            return
        found = sorted((int(m.group(1)), p) for p in self.output_dir.glob("checkpoint-*")
                       if (m := CHECKPOINT_RE.match(p.name)))
        for _, path in found[:-limit]:
            shutil.rmtree(path)
            logger.info("save_total_limit=%d: removed %s", limit, path.name)

    def _should_save(self, epoch_done: bool) -> bool:
        strategy = self.cfg.save_strategy
        if strategy == "steps":
            return self.global_step % self.cfg.save_steps == 0
        return strategy == "epoch" and epoch_done

    def load_checkpoint(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = json.loads((path / STATE_FILE).read_text())
        if state.get("save_only_model"):
            raise ValueError(f"resume_from_checkpoint {path}: written with save_only_model: true, so it holds no "
                             "optimizer, scheduler or RNG state to resume from (start a new run from its adapter)")
        if state["plan"] != self._plan_record():
            raise ValueError(f"resume_from_checkpoint {path}: it was written with a different data plan "
                             f"{state['plan']} than this run's {self._plan_record()} (dataset, batch sizes, seed, steps)")
        saved = load_file(path / TRAINABLE_FILE)
        if set(saved) != set(self.params):
            raise ValueError(f"resume_from_checkpoint {path}: trainable parameters differ from this model's "
                             f"(missing {sorted(set(self.params) - set(saved))[:3]}, extra {sorted(set(saved) - set(self.params))[:3]})")
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(saved[name])
        self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=False))
        self.scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, weights_only=False))
        _set_rng_state(torch.load(path / RNG_FILE, weights_only=False))
        self.global_step = state["global_step"]
        self.log_history = state["log_history"]

    # ----------------------------------------------------------------------------------------------- loop

    def train(self, resume_from: Path | None = None) -> list[dict]:
        from tqdm.auto import tqdm

        if resume_from is not None:
            self.load_checkpoint(resume_from)
            logger.info("resumed from %s at step %d", resume_from, self.global_step)
        elif self.output_dir.exists() and self.cfg.overwrite_output_dir:
            shutil.rmtree(self.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.output_dir / LOG_FILE
        log_path.write_text("".join(json.dumps(e) + "\n" for e in self.log_history))

        self.tm.model.train()
        start_step, start_time = self.global_step, time.perf_counter()
        window_losses, window_tokens, window_start = [], 0, start_time
        bar = tqdm(total=self.total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        steps = list(itertools.islice(self.plan.steps(start_step), self.total_steps - start_step))
        batches = iter(self.batch_loader([mb for _, _, groups in steps for mb in groups]))
        for step, epoch, groups in steps:
            lr = self.scheduler.get_last_lr()[0]
            loss, tokens = self.training_step(groups, [next(batches) for _ in groups])
            self.optimizer_step()
            self.global_step = step + 1
            window_losses.append(loss)
            window_tokens += tokens
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
            if self.global_step % self.cfg.logging_steps == 0 or self.global_step == self.total_steps:
                now = time.perf_counter()
                done = self.global_step - start_step
                entry = {"step": self.global_step, "total_steps": self.total_steps,
                         "loss": round(sum(window_losses) / len(window_losses), 6), "lr": lr,
                         "epoch": round(epoch, 4), "tokens_per_s": round(window_tokens / max(now - window_start, 1e-9), 1),
                         "elapsed_s": round(now - start_time, 2),
                         "eta_s": round((now - start_time) / done * (self.total_steps - self.global_step), 2)}
                self.log_history.append(entry)
                with log_path.open("a") as f:
                    f.write(json.dumps(entry) + "\n")
                window_losses, window_tokens, window_start = [], 0, now
            if self._should_save(epoch_done=epoch == int(epoch)):
                self.save_checkpoint()
        bar.close()
        self.export()
        return self.log_history

    def batch_loader(self, micro_batches: list[list[int]]):
        """The micro-batches, collated in order; with dataloader_num_workers > 0 by worker processes ahead of
        the step (torch's DataLoader, as HF's Trainer does)."""
        from torch.utils.data import DataLoader

        workers = self.cfg.dataloader_num_workers
        if workers == 0:
            return (self.dataset.collate(indices) for indices in micro_batches)
        # range(n) maps index i to i: the collate_fn turns a micro-batch's indices into tensors.
        return DataLoader(range(len(self.dataset)), batch_sampler=micro_batches, collate_fn=self.dataset.collate,
                          num_workers=workers)

    def export(self) -> None:
        """The final adapter into output_dir (next to checkpoints and logs): staged, then moved file by file with
        the manifest last, so a half-published adapter fails the manifest check instead of loading."""
        from kt_serve.formats.names import KT_ADAPTER_MANIFEST_FILE

        tmp = Path(tempfile.mkdtemp(prefix=".adapter.tmp-", dir=self.output_dir))
        try:
            _publish_adapter(self.tm, tmp / "adapter", overwrite=False)
            (self.output_dir / KT_ADAPTER_MANIFEST_FILE).unlink(missing_ok=True)
            files = sorted((tmp / "adapter").iterdir(), key=lambda p: p.name == KT_ADAPTER_MANIFEST_FILE)
            for item in files:
                os.replace(item, self.output_dir / item.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if self.cfg.plot_loss and self.log_history:
            plot_loss(self.log_history, self.output_dir / PLOT_FILE)
