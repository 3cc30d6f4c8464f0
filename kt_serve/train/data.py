"""Supervised fine-tuning data: LLaMA-Factory ``dataset_info.json`` datasets (alpaca, sharegpt) to token ids.

Every example becomes a list of chat messages, which a chat template (:mod:`kt_serve.train.templates`) turns into
input ids and labels: -100 everywhere except on assistant turns (their end-of-turn marker included, so that the
model learns to stop).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

# Re-exported: callers import the template API and the shared error from here.
from kt_serve.train.templates import (  # noqa: F401
    IGNORE_INDEX, NAMED_TEMPLATES, DataError, TokenizerTemplate, get_template)

logger = logging.getLogger(__name__)

DATASET_INFO = "dataset_info.json"


# ---------------------------------------------------------------------------------------------------- datasets

@dataclass
class DatasetSpec:
    """One ``dataset_info.json`` entry, with LLaMA-Factory's defaults for columns and sharegpt tags."""

    name: str
    file: Path
    formatting: str = "alpaca"
    columns: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)

    ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": None, "history": None}
    SHAREGPT_COLUMNS = {"messages": "conversations", "system": None}
    SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                     "system_tag": "system", "observation_tag": "observation", "function_tag": "function_call"}
    SUPPORTED_KEYS = {"file_name", "formatting", "columns", "tags"}

    @classmethod
    def from_info(cls, name: str, entry: dict, dataset_dir: Path) -> "DatasetSpec":
        where = f"{dataset_dir / DATASET_INFO}: dataset {name!r}"
        unsupported = sorted(set(entry) - cls.SUPPORTED_KEYS)
        if unsupported:
            raise DataError(f"{where}: unsupported key(s) {', '.join(unsupported)} (only local files: "
                            f"{', '.join(sorted(cls.SUPPORTED_KEYS))})")
        if "file_name" not in entry:
            raise DataError(f"{where}: 'file_name' is required")
        formatting = entry.get("formatting", "alpaca")
        defaults = {"alpaca": cls.ALPACA_COLUMNS, "sharegpt": cls.SHAREGPT_COLUMNS}.get(formatting)
        if defaults is None:
            raise DataError(f"{where}: formatting must be 'alpaca' or 'sharegpt', got {formatting!r}")
        columns = {**defaults, **entry.get("columns", {})}
        unknown = sorted(set(columns) - set(defaults))
        if unknown:
            raise DataError(f"{where}: unknown column(s) {', '.join(unknown)} for {formatting}")
        tags = {**cls.SHAREGPT_TAGS, **entry.get("tags", {})} if formatting == "sharegpt" else {}
        file = dataset_dir / entry["file_name"]
        if not file.is_file():
            raise DataError(f"{where}: file {file} does not exist")
        return cls(name, file, formatting, columns, tags)

    def read_records(self) -> list[dict]:
        try:
            text = self.file.read_text(encoding="utf-8")
            if self.file.suffix == ".jsonl":
                records = [json.loads(line) for line in text.splitlines() if line.strip()]
            else:
                records = json.loads(text)
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"{self.file}: cannot read JSON ({exc})") from None
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise DataError(f"{self.file}: expected a list of JSON objects")
        return records

    def to_messages(self, record: dict, index: int) -> list[dict]:
        where = f"{self.file}: record {index}"
        convert = self._alpaca if self.formatting == "alpaca" else self._sharegpt
        messages = convert(record, where)
        roles = [m["role"] for m in messages if m["role"] != "system"]
        if not roles or roles[-1] != "assistant" or any(
            role != ("user" if i % 2 == 0 else "assistant") for i, role in enumerate(roles)
        ):
            raise DataError(f"{where}: expected alternating user/assistant turns ending with the assistant, got {roles}")
        return messages

    def _alpaca(self, record: dict, where: str) -> list[dict]:
        col = self.columns
        prompt, response = record.get(col["prompt"]), record.get(col["response"])
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise DataError(f"{where}: columns {col['prompt']!r} and {col['response']!r} must be strings")
        query = record.get(col["query"]) or ""
        messages = []
        if col["system"] and record.get(col["system"]):
            messages.append({"role": "system", "content": record[col["system"]]})
        for turn in (record.get(col["history"]) or []) if col["history"] else []:
            if not (isinstance(turn, list) and len(turn) == 2):
                raise DataError(f"{where}: history entries must be [prompt, response] pairs")
            messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
        messages.append({"role": "user", "content": prompt + ("\n" + query if query else "")})
        messages.append({"role": "assistant", "content": response})
        return messages

    def _sharegpt(self, record: dict, where: str) -> list[dict]:
        col, tags = self.columns, self.tags
        turns = record.get(col["messages"])
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{where}: column {col['messages']!r} must be a non-empty list")
        role_of = {tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["system_tag"]: "system"}
        messages = []
        if col["system"] and record.get(col["system"]):
            messages.append({"role": "system", "content": record[col["system"]]})
        for turn in turns:
            role = role_of.get(turn.get(tags["role_tag"])) if isinstance(turn, dict) else None
            content = turn.get(tags["content_tag"]) if isinstance(turn, dict) else None
            if role is None or not isinstance(content, str):
                raise DataError(f"{where}: each turn needs {tags['role_tag']!r} in {sorted(role_of)} and a string "
                                f"{tags['content_tag']!r} (tool turns are not supported)")
            if role == "system" and messages:
                raise DataError(f"{where}: a system turn may only come first")
            messages.append({"role": role, "content": content})
        return messages


def load_dataset_specs(dataset_dir: str | Path, names: list[str]) -> list[DatasetSpec]:
    dataset_dir = Path(dataset_dir)
    info_path = dataset_dir / DATASET_INFO
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{info_path}: cannot read ({exc})") from None
    missing = [n for n in names if n not in info]
    if missing:
        raise DataError(f"{info_path}: no dataset named {', '.join(missing)} (have: {', '.join(sorted(info))})")
    return [DatasetSpec.from_info(n, info[n], dataset_dir) for n in names]


# ---------------------------------------------------------------------------------------------------- tokenising

@dataclass
class Example:
    """One training row: a tokenised conversation, or (packing) several of them back to back."""

    input_ids: list[int]
    labels: list[int]
    sequence_lengths: list[int] | None = None  # packed rows: the length of each conversation in it

    @property
    def lengths(self) -> list[int]:
        return self.sequence_lengths or [len(self.input_ids)]


def encode_example(messages: list[dict], template, tokenizer, cutoff_len: int) -> Example:
    """Token ids with response-only labels, at most ``cutoff_len`` of them (cut the way the template cuts)."""
    return Example(*template.encode(tokenizer, messages, cutoff_len))


def pack_examples(examples: list[Example], capacity: int) -> list[Example]:
    """LLaMA-Factory's greedy knapsack: each row is filled with the longest remaining example that still fits.
    Rows keep each example's length, so attention and positions stay within an example (see ``collate``)."""
    remaining = sorted(range(len(examples)), key=lambda i: (len(examples[i].input_ids), i))
    lengths = [len(examples[i].input_ids) for i in remaining]  # ascending, searched by bisect
    rows = []
    while remaining:
        chosen, room = [], capacity
        while (j := bisect.bisect_right(lengths, room) - 1) >= 0:
            i = remaining.pop(j)
            room -= lengths.pop(j)
            chosen.append(examples[i])
        # An example's first token is not predicted from the example before it.
        labels = [label for e in chosen for label in [IGNORE_INDEX, *e.labels[1:]]]
        rows.append(Example(sum((e.input_ids for e in chosen), []), labels, [len(e.input_ids) for e in chosen]))
    return rows


_WORKER_STATE: tuple = ()


def _init_worker(template, tokenizer, cutoff_len):
    global _WORKER_STATE
    _WORKER_STATE = (template, tokenizer, cutoff_len)


def _encode_chunk(conversations: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    template, tokenizer, cutoff_len = _WORKER_STATE
    return [template.encode(tokenizer, messages, cutoff_len) for messages in conversations]


MIN_RECORDS_PER_WORKER = 256  # below this a process costs more than it tokenizes


def encode_all(conversations: list[list[dict]], template, tokenizer, cutoff_len: int,
               workers: int | None) -> list[tuple[list[int], list[int]]]:
    """Every conversation encoded, in order; with ``preprocessing_num_workers``, by that many forked processes
    (fewer for a small dataset)."""
    n = min(workers or 1, math.ceil(len(conversations) / MIN_RECORDS_PER_WORKER))
    if n <= 1:
        return [template.encode(tokenizer, messages, cutoff_len) for messages in conversations]
    import multiprocessing

    size = math.ceil(len(conversations) / n)
    chunks = [conversations[i : i + size] for i in range(0, len(conversations), size)]
    logger.info("tokenizing %d conversations in %d processes", len(conversations), len(chunks))
    with multiprocessing.get_context("fork").Pool(len(chunks), _init_worker, (template, tokenizer, cutoff_len)) as pool:
        return [pair for chunk in pool.map(_encode_chunk, chunks) for pair in chunk]


class SFTDataset:
    """Tokenised rows plus the deterministic batch order the trainer and resume rely on."""

    def __init__(self, examples: list[Example], pad_token_id: int, packed: bool = False):
        if not examples:
            raise DataError("dataset: no example has a response token within cutoff_len")
        self.examples = examples
        self.pad_token_id = pad_token_id
        self.packed = packed

    def __len__(self):
        return len(self.examples)

    @classmethod
    def build(cls, cfg, tokenizer) -> "SFTDataset":
        from kt_serve.train import data_cache, templates

        enable_thinking = getattr(cfg, "enable_thinking", True)
        template = get_template(cfg.template, tokenizer, enable_thinking)
        conversations = [spec.to_messages(record, i)
                         for spec in load_dataset_specs(cfg.dataset_dir, cfg.dataset_names)
                         for i, record in enumerate(spec.read_records()[: cfg.max_samples])]
        key = data_cache.cache_key(conversations, tokenizer, (__file__, templates.__file__), template=cfg.template,
                                   enable_thinking=enable_thinking, cutoff_len=cfg.cutoff_len)
        workers = getattr(cfg, "preprocessing_num_workers", None)
        encoded = data_cache.load_or_build(
            key, lambda: encode_all(conversations, template, tokenizer, cfg.cutoff_len, workers),
            overwrite=getattr(cfg, "overwrite_cache", False))
        examples = [Example(list(ids), list(labels)) for ids, labels in encoded
                    if any(label != IGNORE_INDEX for label in labels[1:])]
        if len(examples) < len(encoded):
            logger.warning("dropped %d example(s) with no response token within cutoff_len=%d",
                           len(encoded) - len(examples), cfg.cutoff_len)
        packed = getattr(cfg, "use_packing", False)
        if packed:
            count = len(examples)
            examples = pack_examples(examples, cfg.cutoff_len)
            logger.info("packing: %d examples in %d rows of at most %d tokens", count, len(examples), cfg.cutoff_len)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return cls(examples, pad, packed)

    def num_tokens(self, indices: list[int]) -> int:
        return sum(len(self.examples[i].input_ids) for i in indices)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Right-padded batch with labels -100 on padding. Unpacked: input_ids, attention_mask, labels. Packed:
        input_ids, position_ids, labels, no attention mask: positions restart at 0 for each example (and for
        the padding), from which transformers builds a causal mask that never crosses into another example."""
        batch = [self.examples[i] for i in indices]
        width = max(len(e.input_ids) for e in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        for row, e in enumerate(batch):
            input_ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
            labels[row, : len(e.labels)] = torch.tensor(e.labels)
        if self.packed:
            position_ids = torch.stack([torch.cat([torch.arange(m) for m in e.lengths + [width - len(e.input_ids)]])
                                        for e in batch])
            return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
        lengths = torch.tensor([len(e.input_ids) for e in batch])
        attention_mask = (torch.arange(width) < lengths[:, None]).long()
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@dataclass(frozen=True)
class BatchPlan:
    """Which examples each optimizer step sees: epoch e shuffles with ``randperm(seed + e)``, cuts micro-batches of
    ``batch_size``, and groups ``accumulation`` of them per step (the last group of an epoch may be shorter).
    Being a pure function of the step number is what lets a resumed run see exactly the batches it would have seen."""

    num_examples: int
    batch_size: int
    accumulation: int
    seed: int

    @property
    def micro_batches_per_epoch(self) -> int:
        return math.ceil(self.num_examples / self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.micro_batches_per_epoch / self.accumulation)

    def total_steps(self, num_train_epochs: float, max_steps: int) -> int:
        return max_steps if max_steps > 0 else max(1, math.ceil(num_train_epochs * self.steps_per_epoch))

    def epoch_groups(self, epoch: int) -> list[list[list[int]]]:
        order = torch.randperm(self.num_examples, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        micro = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        return [micro[i : i + self.accumulation] for i in range(0, len(micro), self.accumulation)]

    def steps(self, start_step: int = 0) -> Iterator[tuple[int, float, list[list[int]]]]:
        """Yields (step, epoch as a float, micro-batch index lists) forever from ``start_step``."""
        epoch, offset = divmod(start_step, self.steps_per_epoch)
        step = start_step
        while True:
            groups = self.epoch_groups(epoch)
            for i in range(offset, len(groups)):
                yield step, epoch + (i + 1) / len(groups), groups[i]
                step += 1
            epoch, offset = epoch + 1, 0
