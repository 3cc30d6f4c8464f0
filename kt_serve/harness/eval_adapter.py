"""Did the adapter take effect? Score a served base model against its LoRA adapters on one dataset.

Talks to any OpenAI-compatible server through the official `openai` client; SGLang selects an adapter per request
with model="<served>:<adapter>" and the base with model="<served>". Every prompt goes to the base and to each
adapter (greedy by default), and the outputs are scored per target:

  bleu      corpus BLEU (sacrebleu) against "reference"                    rows with "reference"
  rouge     mean ROUGE-1/2/L F1 (rouge-score, stemmed) against "reference"  rows with "reference"
  accuracy  output starts with the right choice text or its letter (A, B…)  rows with "choices" and "answer"
  style     output matches the row's "style_regex" (re.search) or the        rows with a regex
            --style-regex default; shows a persona/format adapter on a model too small for BLEU to move

All values are percentages (0-100); outputs are whitespace-stripped before scoring. Dataset: JSONL, one object per
line with "prompt" and any of "reference", "choices" + "answer" (index or choice text), "style_regex"; other keys
are ignored. The prompt is sent as is (put the choices in it yourself); with --api chat it becomes one user message
and the server applies the model's chat template, as for adapters trained on conversations.

Writes OUT/eval_adapter.{json,md,png}. Exit code 2 with a one-line error when the server is unreachable, the
served name or an adapter name is unknown to it, or the dataset is malformed.

  python -m kt_serve.harness.eval_adapter --base-url http://127.0.0.1:30000 --served-name tiny --adapters a,b \\
      --dataset style.jsonl --out runs/eval --api chat
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from kt_serve.harness.report import write_report

BASE = "base"  # the target label of the un-adapted model
REPORT_NAME = "eval_adapter"


class EvalError(Exception):
    """A user-facing failure with a one-line message (CLI exit code 2)."""


@dataclass(frozen=True)
class Example:
    prompt: str
    reference: str | None = None
    choices: tuple[str, ...] | None = None
    answer: int | None = None  # index into choices
    style: re.Pattern | None = None


# ---------------------------------------------------------------------------------------------------------------
# Dataset


def load_examples(source: str | os.PathLike | Iterable[Mapping[str, Any]],
                  style_regex: str | None = None) -> list[Example]:
    """Parse a JSONL file (or already-parsed rows) into Examples; errors name the file, line and field."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise EvalError(f"dataset {path}: cannot read ({e.strerror})") from None
        rows = []
        for lineno, line in enumerate(lines, 1):
            if line.strip():
                try:
                    rows.append((f"{path}:{lineno}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise EvalError(f"{path}:{lineno}: expected one JSON object per line ({e.msg})") from None
    else:
        rows = [(f"dataset row {i}", row) for i, row in enumerate(source)]
    default_style = _compile(style_regex, "--style-regex") if style_regex else None
    examples = [_example(where, row, default_style) for where, row in rows]
    if not examples:
        raise EvalError(f"dataset {source}: no rows")
    return examples


def _example(where: str, row: Any, default_style: re.Pattern | None) -> Example:
    def field(name, kind, expected):
        value = row.get(name)
        if value is not None and not isinstance(value, kind):
            raise EvalError(f"{where}: field '{name}': expected {expected}, got {value!r}")
        return value

    if not isinstance(row, dict):
        raise EvalError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompt = field("prompt", str, "a non-empty string")
    if not prompt:
        raise EvalError(f"{where}: field 'prompt': expected a non-empty string, got {prompt!r}")
    reference = field("reference", str, "a string")
    choices = field("choices", list, "a list of at least two strings")
    answer = row.get("answer")
    if choices is not None or answer is not None:
        if choices is None or len(choices) < 2 or not all(isinstance(c, str) and c.strip() for c in choices):
            raise EvalError(f"{where}: field 'choices': expected a list of at least two non-empty strings, "
                            f"got {choices!r}")
        if isinstance(answer, str) and answer in choices:
            answer = choices.index(answer)
        if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
            raise EvalError(f"{where}: field 'answer': expected an index 0..{len(choices) - 1} or one of the "
                            f"choices, got {answer!r}")
        choices = tuple(choices)
    pattern = field("style_regex", str, "a regular expression string")
    style = _compile(pattern, f"{where}: field 'style_regex'") if pattern else default_style
    return Example(prompt, reference, choices, answer, style)


def _compile(pattern: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise EvalError(f"{where}: invalid regular expression {pattern!r} ({e})") from None


# ---------------------------------------------------------------------------------------------------------------
# Metrics: each scores the examples it applies to; values in percent


def pick_choice(output: str, choices: Sequence[str]) -> int | None:
    """The choice an output commits to: the longest choice text it starts with (case-insensitive, whole words),
    else a leading letter label ("B", "(B)", "B." …); None if neither."""
    text = output.strip()
    low = text.casefold()
    starts = []
    for i, choice in enumerate(choices):
        c = choice.strip().casefold()
        if low.startswith(c) and not low[len(c):len(c) + 1].isalnum():
            starts.append(i)
    if starts:
        return max(starts, key=lambda i: len(choices[i].strip()))
    label = re.match(r"\(?([A-Z])(?![A-Za-z0-9])", text)
    if label and ord(label.group(1)) - ord("A") < len(choices):
        return ord(label.group(1)) - ord("A")
    return None


def _bleu(examples: list[Example], outputs: list[str]) -> dict[str, float]:
    import sacrebleu

    return {"bleu": sacrebleu.corpus_bleu(outputs, [[ex.reference for ex in examples]]).score}


def _rouge(examples: list[Example], outputs: list[str]) -> dict[str, float]:
    from rouge_score import rouge_scorer

    kinds = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(kinds), use_stemmer=True)
    scores = [scorer.score(ex.reference, out) for ex, out in zip(examples, outputs)]
    return {k: 100.0 * sum(s[k].fmeasure for s in scores) / len(scores) for k in kinds}


def _accuracy(examples: list[Example], outputs: list[str]) -> dict[str, float]:
    hits = sum(pick_choice(out, ex.choices) == ex.answer for ex, out in zip(examples, outputs))
    return {"accuracy": 100.0 * hits / len(examples)}


def _style(examples: list[Example], outputs: list[str]) -> dict[str, float]:
    hits = sum(ex.style.search(out) is not None for ex, out in zip(examples, outputs))
    return {"style": 100.0 * hits / len(examples)}


@dataclass(frozen=True)
class Metric:
    applies: Callable[[Example], bool]
    needs: str  # what a row must carry, for the error message
    score: Callable[[list[Example], list[str]], dict[str, float]]


METRICS: dict[str, Metric] = {
    "bleu": Metric(lambda ex: ex.reference is not None, "a 'reference'", _bleu),
    "rouge": Metric(lambda ex: ex.reference is not None, "a 'reference'", _rouge),
    "accuracy": Metric(lambda ex: ex.choices is not None, "'choices' and 'answer'", _accuracy),
    "style": Metric(lambda ex: ex.style is not None, "a 'style_regex' (or pass --style-regex)", _style),
}


def select_metrics(requested: Sequence[str] | None, examples: list[Example]) -> list[str]:
    """The requested metrics (each must apply to some row), or by default every metric the dataset supports."""
    if requested is None:
        chosen = [m for m, metric in METRICS.items() if any(map(metric.applies, examples))]
        if not chosen:
            raise EvalError("dataset: no row has a 'reference', 'choices'/'answer' or 'style_regex' to score against")
        return chosen
    for m in requested:
        if m not in METRICS:
            raise EvalError(f"--metrics: unknown metric {m!r} (expected some of {', '.join(METRICS)})")
        if not any(map(METRICS[m].applies, examples)):
            raise EvalError(f"--metrics {m}: no dataset row has {METRICS[m].needs}")
    return list(dict.fromkeys(requested))


def score(metric: str, examples: list[Example], outputs: list[str]) -> tuple[dict[str, float], int]:
    """Score the rows the metric applies to; returns ({sub-metric: percent}, number of rows scored)."""
    pairs = [(ex, out.strip()) for ex, out in zip(examples, outputs) if METRICS[metric].applies(ex)]
    return METRICS[metric].score([p[0] for p in pairs], [p[1] for p in pairs]), len(pairs)


# ---------------------------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True)
class Sampling:
    api: str = "completions"  # or "chat": the prompt becomes one user message (the server applies the chat template)
    max_tokens: int = 64
    temperature: float = 0.0
    retries: int = 3  # extra attempts after a connection error, timeout or 5xx; a 4xx is never retried
    retry_backoff: float = 0.5  # seconds before the first retry, doubled each time


def openai_base_url(base_url: str) -> str:
    """The client wants the /v1 root; accept the bare server address too."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def model_name(served_name: str, target: str) -> str:
    return served_name if target == BASE else f"{served_name}:{target}"


def _server_message(e: openai.APIStatusError) -> str:
    body = e.body
    if isinstance(body, dict):
        body = body.get("error", body)  # OpenAI nests {"error": {...}}, SGLang does not
        if isinstance(body, dict) and body.get("message"):
            return " ".join(str(body["message"]).split())
    return " ".join(e.message.split())


async def _with_retries(call: Callable, sampling: Sampling, what: str, base_url: str):
    for attempt in range(sampling.retries + 1):
        try:
            return await call()
        except (openai.APIConnectionError, openai.InternalServerError) as e:  # transient: refused, reset, timeout, 5xx
            if attempt < sampling.retries:
                await asyncio.sleep(sampling.retry_backoff * 2**attempt)
                continue
            tries = f"{attempt + 1} attempt{'s' if attempt else ''}"
            if isinstance(e, openai.APIStatusError):
                raise EvalError(f"{what}: server error HTTP {e.status_code} after {tries}: "
                                f"{_server_message(e)}") from None
            if isinstance(e, openai.APITimeoutError):
                raise EvalError(f"{what}: no answer within the timeout after {tries} (raise --timeout?)") from None
            reason = " ".join(str(e.__cause__ or e).split())
            raise EvalError(f"cannot reach the server at {base_url} after {tries} ({reason}); is it running?") from None
        except openai.APIStatusError as e:
            raise EvalError(f"{what} rejected by {base_url} (HTTP {e.status_code}): {_server_message(e)}") from None


def _describe(target: str, served_name: str) -> str:
    if target == BASE:
        return f"served model {served_name!r}"
    return f"adapter {target!r} ({model_name(served_name, target)!r})"


async def _generate(client: openai.AsyncOpenAI, model: str, prompt: str, sampling: Sampling, max_tokens: int) -> str:
    if sampling.api == "chat":
        r = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=sampling.temperature)
        return r.choices[0].message.content or ""
    r = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                        temperature=sampling.temperature)
    return r.choices[0].text


async def collect_outputs(
    base_url: str, served_name: str, targets: list[str], prompts: list[str], sampling: Sampling, *,
    concurrency: int, timeout: float, api_key: str,
) -> dict[str, list[str]]:
    """Every prompt through every target, at most `concurrency` requests in flight; outputs in prompt order.

    Checked first, cheaply: the server answers /v1/models and lists the served name, and each target accepts a
    1-token request, so a wrong adapter name fails in seconds instead of after the base model's whole run."""
    async with openai.AsyncOpenAI(base_url=openai_base_url(base_url), api_key=api_key, timeout=timeout,
                                  max_retries=0) as client:  # retries are ours: bounded, and never on a 4xx
        models = await _with_retries(client.models.list, sampling, "GET /v1/models", base_url)
        ids = [m.id for m in models.data]
        if served_name not in ids:
            raise EvalError(f"served name {served_name!r} is not a model on {base_url} "
                            f"(it lists: {', '.join(ids) or 'none'})")
        for target in targets:
            model = model_name(served_name, target)
            await _with_retries(lambda: _generate(client, model, prompts[0], sampling, 1), sampling,
                                _describe(target, served_name), base_url)

        limit = asyncio.Semaphore(concurrency)

        async def one(target: str, prompt: str) -> str:
            model = model_name(served_name, target)
            async with limit:
                return await _with_retries(lambda: _generate(client, model, prompt, sampling, sampling.max_tokens),
                                           sampling, _describe(target, served_name), base_url)

        # gather raises the first error; asyncio.run then cancels the requests still in flight
        flat = await asyncio.gather(*(one(t, p) for t in targets for p in prompts))
    return {t: list(flat[i * len(prompts):(i + 1) * len(prompts)]) for i, t in enumerate(targets)}


# ---------------------------------------------------------------------------------------------------------------
# Entry points


def run_eval(
    base_url: str,
    served_name: str,
    adapters: Sequence[str],
    dataset: str | os.PathLike | Iterable[Mapping[str, Any]],
    out_dir: str | os.PathLike,
    *,
    metrics: Sequence[str] | None = None,
    style_regex: str | None = None,
    api: str = "completions",
    concurrency: int = 8,
    max_tokens: int = 64,
    temperature: float = 0.0,
    timeout: float = 60.0,
    retries: int = 3,
    retry_backoff: float = 0.5,
    api_key: str | None = None,
    title: str | None = None,
) -> dict:
    """Score the base and each adapter; write OUT_DIR/eval_adapter.{json,md,png} and return the JSON document plus
    "paths". doc["scores"][target][metric] is a percentage; target "base" is the un-adapted model. Raises EvalError."""
    adapters = list(adapters)
    if BASE in adapters or len(set(adapters)) != len(adapters) or not all(adapters):
        raise EvalError(f"--adapters {','.join(adapters)}: expected distinct, non-empty names other than {BASE!r}")
    if api not in ("completions", "chat"):
        raise EvalError(f"--api {api}: expected 'completions' or 'chat'")
    if concurrency < 1 or max_tokens < 1 or retries < 0:
        raise EvalError("--concurrency and --max-tokens must be >= 1, --retries >= 0")
    examples = load_examples(dataset, style_regex)
    chosen = select_metrics(metrics, examples)
    targets = [BASE, *adapters]
    sampling = Sampling(api, max_tokens, temperature, retries, retry_backoff)
    outputs = asyncio.run(collect_outputs(
        base_url, served_name, targets, [ex.prompt for ex in examples], sampling, concurrency=concurrency,
        timeout=timeout, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"))

    scores: dict[str, dict[str, float]] = {t: {} for t in targets}
    rows = []
    for metric in chosen:
        per_target = {t: score(metric, examples, outputs[t]) for t in targets}
        for sub in per_target[BASE][0]:
            for t in targets:
                value, n = per_target[t][0][sub], per_target[t][1]
                scores[t][sub] = value
                delta = None if t == BASE else value - per_target[BASE][0][sub]
                rows.append({"metric": sub, "target": t, "value": value, "delta_vs_base": delta, "n": n})

    dataset_name = str(dataset) if isinstance(dataset, (str, os.PathLike)) else "<rows>"
    meta = {
        "base_url": base_url, "served_name": served_name, "adapters": ",".join(adapters), "dataset": dataset_name,
        "examples_total": len(examples), "api": api, "max_tokens": max_tokens, "temperature": temperature,
        "metrics": ",".join(chosen), "units": "percent (0-100)",
        "scores": scores,
        "examples": [{"prompt": ex.prompt, "reference": ex.reference,
                      "outputs": {t: outputs[t][i] for t in targets}} for i, ex in enumerate(examples)],
    }
    title = title or f"Adapter eval: {served_name} base vs {', '.join(adapters) or '(no adapters)'}"
    paths = write_report(out_dir, REPORT_NAME, rows, title=title, chart=("metric", "value", "target"), meta=meta)
    return {"title": title, "rows": rows, **meta, "paths": {k: str(v) for k, v in paths.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kt_serve.harness.eval_adapter", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="server address, e.g. http://127.0.0.1:30000 (/v1 optional)")
    p.add_argument("--served-name", required=True, help="the base model's name on the server")
    p.add_argument("--adapters", default="", help="comma-separated adapter names (empty: base only)")
    p.add_argument("--dataset", required=True, help="JSONL file")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--metrics", help=f"comma-separated, some of {','.join(METRICS)} "
                                     "(default: every one the dataset supports)")
    p.add_argument("--style-regex", help="style pattern for rows without their own 'style_regex'")
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--retries", type=int, default=3, help="extra attempts on connection errors, timeouts and 5xx")
    p.add_argument("--title")
    args = p.parse_args(argv)
    try:
        result = run_eval(
            args.base_url, args.served_name, [a.strip() for a in args.adapters.split(",") if a.strip()], args.dataset,
            args.out, metrics=[m.strip() for m in args.metrics.split(",")] if args.metrics else None,
            style_regex=args.style_regex, api=args.api, concurrency=args.concurrency, max_tokens=args.max_tokens,
            temperature=args.temperature, timeout=args.timeout, retries=args.retries, title=args.title)
    except EvalError as e:
        print(f"eval_adapter: error: {e}", file=sys.stderr)
        return 2
    print(Path(result["paths"]["md"]).read_text(), end="")
    print("wrote " + ", ".join(result["paths"].values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
