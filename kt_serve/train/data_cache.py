"""Tokenized-dataset cache, as LLaMA-Factory keeps one through HF datasets: a second run on the same data,
template, tokenizer and cutoff_len loads the token ids instead of tokenizing again; ``overwrite_cache: true``
tokenizes anew (and replaces the entry).

Entries live in ``$KT_SERVE_CACHE/tokenized/`` (default ``~/.cache/kt_serve``), one JSON file per key. The key
hashes everything the ids depend on: the conversations themselves (so an edited file, another max_samples or
another dataset is another key), the template and its options, the tokenizer's full definition, and the source of
the code that encodes them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get("KT_SERVE_CACHE") or Path.home() / ".cache" / "kt_serve"
    return Path(root) / "tokenized"


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    special = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256((definition + special).encode()).hexdigest()


def cache_key(conversations: list, tokenizer, sources, **options) -> str:
    """sources: the files of the code that encodes the conversations (their edits change the ids)."""
    digest = hashlib.sha256()
    digest.update(json.dumps([FORMAT_VERSION, options], sort_keys=True).encode())
    digest.update(json.dumps(conversations, ensure_ascii=False).encode())
    digest.update(tokenizer_fingerprint(tokenizer).encode())
    for source in sources:
        digest.update(Path(source).read_bytes())
    return digest.hexdigest()[:32]


def load_or_build(key: str, build: Callable[[], list[dict]], *, overwrite: bool) -> list[dict]:
    """The cached records under ``key``, or ``build()``'s (then cached); ``overwrite`` always builds."""
    path = cache_dir() / f"{key}.json"
    if not overwrite and path.is_file():
        try:
            records = json.loads(path.read_text())
            logger.info("tokenized dataset loaded from the cache %s (overwrite_cache: true tokenizes anew)", path)
            return records
        except (OSError, json.JSONDecodeError):
            logger.warning("tokenized-dataset cache %s is unreadable; tokenizing anew", path)
    records = build()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump(records, f)
        os.replace(tmp, path)  # readers never see a half-written entry
        logger.info("tokenized dataset cached at %s", path)
    except OSError as exc:  # a read-only home or a full disk is no reason to fail training
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        logger.warning("cannot write the tokenized-dataset cache %s (%s); continuing without it", path, exc)
    return records
