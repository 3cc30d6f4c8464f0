"""The quickstart end to end in its reduced size (--small): pre-train, train, convert, a real SGLang server, eval.

Checked against independent references, not against the quickstart's own claims:
- the report's style numbers are recomputed from the raw served answers with our own regex;
- the served answers are (near-)greedy under an fp32 transformers model with the trained adapter merged in plain
  torch (kt_serve/harness/reference.py), and the adapter's answers are not greedy under the base model: the numbers
  come from the served model with the adapter applied, not from the trainer;
- no process of the run survives it, found by an environment marker every child inherits (psutil), also after a
  Ctrl-C while the server starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from kt_serve.harness.reference import HFReference

REPO = Path(__file__).resolve().parent.parent
MARKER = "KT_SERVE_QUICKSTART_TEST_RUN"
PIRATE_START = re.compile(r"\W*Arr, matey!")
GREEDY_GAP = 0.1  # nats: a bf16 server may pick a token whose fp32 log-probability is this far below the best
CHECKED_TOKENS = 8
RUN_TIMEOUT = 1200


def quickstart_cmd(out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "kt_serve.quickstart", "--out", str(out), "--small", "--threads", "1", *flags]


def marked_env(tag: str) -> dict[str, str]:
    return dict(os.environ, **{MARKER: tag})


def processes_with_marker(tag: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if proc.environ().get(MARKER) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{proc.pid} {proc.info['name']}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def assert_nothing_left(tag: str) -> None:
    deadline = time.monotonic() + 10  # killed processes may take a moment to disappear
    while (left := processes_with_marker(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left behind by the quickstart: {left}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart")
    tag = uuid.uuid4().hex
    proc = subprocess.run(quickstart_cmd(out), cwd=REPO, env=marked_env(tag), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, f"quickstart failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    report = json.loads((out / "eval" / "eval_adapter.json").read_text())
    return out, tag, proc.stdout, report


def test_stages_report_and_table(run):
    out, _, stdout, report = run
    for n, stage in enumerate(["base model", "train", "convert", "serve", "eval", "summary"], 1):
        assert f"[{n}/6] {stage}" in stdout
    for name in ("eval_adapter.json", "eval_adapter.md", "eval_adapter.png"):
        assert (out / "eval" / name).stat().st_size > 0
    for name in ("adapter_model.safetensors", "fused_expert_lora.safetensors", "adapter_config.json"):
        assert (out / "pirate_lora" / name).is_file()
    assert (out / "pirate_merged" / "adapter_config.json").is_file()
    assert "sglang.launch_server" in stdout and "--lora-paths pirate=" in stdout
    assert str(out / "eval" / "eval_adapter.md") in stdout
    base, pirate = report["scores"]["base"], report["scores"]["pirate"]
    for target, scores in (("base", base), ("pirate", pirate)):  # the printed table shows the report's numbers
        row = next(line for line in stdout.splitlines() if line.strip().startswith(f"{target} "))
        assert f"{scores['style']:.1f}" in row and f"{scores['rougeL']:.1f}" in row
    assert len(report["examples"]) == 8
    prompts = {ex["prompt"] for ex in report["examples"]}
    assert not prompts & training_prompts(), "eval prompts must be held out from the training data"


def training_prompts() -> set[str]:
    data = REPO / "kt_serve" / "data" / "example_dataset"
    prompts = {r["instruction"] for r in json.loads((data / "pirate_alpaca.json").read_text())}
    for line in (data / "pirate_sharegpt.jsonl").read_text().splitlines():
        prompts |= {m["value"] for m in json.loads(line)["conversations"]}
    return prompts


def test_style_numbers_recomputed_from_served_answers(run):
    _, _, _, report = run
    examples = report["examples"]
    for target in ("base", "pirate"):
        hits = sum(PIRATE_START.match(ex["outputs"][target].strip()) is not None for ex in examples)
        assert report["scores"][target]["style"] == pytest.approx(100.0 * hits / len(examples))
    assert report["scores"]["pirate"]["style"] >= 75.0, report["examples"]
    assert report["scores"]["base"]["style"] <= 25.0, report["examples"]
    assert report["scores"]["pirate"]["rougeL"] > report["scores"]["base"]["rougeL"]


def test_served_answers_are_greedy_under_reference(run):
    """The served answers' first tokens are the fp32 reference's greedy choices (within bf16 slack) for the model
    they claim to come from; the adapter's answers are far from greedy under the base model, so the check bites.

    Every token before the reference's first routing near-tie must agree; past one, a bf16 server may route, and
    so answer, differently, and only most tokens must agree."""
    from transformers import AutoTokenizer

    out, _, _, report = run
    model_dir, adapter_dir = out / "base_model", out / "pirate_lora"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ref = HFReference(model_dir)
    agree = total = 0
    for ex in report["examples"]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": ex["prompt"]}], tokenize=False,
                                               add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        for target, adapters in (("base", []), ("pirate", [adapter_dir])):
            answer_ids = tokenizer.encode(ex["outputs"][target], add_special_tokens=False)[:CHECKED_TOKENS]
            gaps, before_tie = greedy_gaps(ref, prompt_ids, answer_ids, adapters)
            assert all(g < GREEDY_GAP for g in gaps[:before_tie]), (target, ex["prompt"], ex["outputs"][target], gaps)
            agree += sum(g < GREEDY_GAP for g in gaps)
            total += len(gaps)
        if PIRATE_START.match(ex["outputs"]["pirate"]):
            pirate_ids = tokenizer.encode(ex["outputs"]["pirate"], add_special_tokens=False)[:CHECKED_TOKENS]
            assert max(greedy_gaps(ref, prompt_ids, pirate_ids, [])[0]) > 1.0, "the adapter's answer is the base's"
    assert total >= len(report["examples"]) * 2 * 4
    assert agree >= 0.9 * total, f"only {agree} of {total} served tokens are greedy under the reference"


@torch.no_grad()
def greedy_gaps(ref, prompt_ids, answer_ids, adapters) -> tuple[list[float], int]:
    """For each answer token: the best log-probability minus the token's under the reference with ``adapters``;
    and how many answer tokens are predicted before the reference's first routing near-tie."""
    ids = prompt_ids + answer_ids
    _, first_tie = ref.logprobs_and_routing(ids, len(prompt_ids), adapters)  # also merges the adapters
    logp = torch.log_softmax(ref.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    gaps = [float(logp[i - 1].max() - logp[i - 1, ids[i]]) for i in range(len(prompt_ids), len(ids))]
    return gaps, max(0, first_tie + 1 - len(prompt_ids))


def test_nothing_left_after_success(run):
    assert_nothing_left(run[1])


def test_ctrl_c_while_serving_leaves_nothing(run, tmp_path):
    """Reuse the run's model and adapter (stages 1-2 skipped), interrupt while the server starts."""
    out = run[0]
    tag = uuid.uuid4().hex
    cmd = quickstart_cmd(tmp_path / "again", "--model-path", str(out / "base_model"), "--adapter",
                         str(out / "pirate_lora"))
    proc = subprocess.Popen(cmd, cwd=REPO, env=marked_env(tag), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "sglang.launch_server" in line:
                break
        time.sleep(3)  # the server's process tree is starting up
        assert processes_with_marker(tag), "no server process started"
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(seen) + rest
    assert proc.returncode == 130, text
    assert "interrupted during stage 4 (serve)" in text
    assert_nothing_left(tag)


def test_qwen35_family_end_to_end(tmp_path):
    """--family qwen3_5_moe: the tiny Qwen3.5 base is saved in the official ForConditionalGeneration layout (what
    SGLang serves), trained with lora_target: all (router, shared-expert gate, in_proj_a / in_proj_b included),
    served per request: the style numbers, recomputed from the served answers, move as for Qwen3."""
    out, tag = tmp_path / "qwen35", uuid.uuid4().hex
    proc = subprocess.run(quickstart_cmd(out, "--family", "qwen3_5_moe"), cwd=REPO, env=marked_env(tag),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, f"quickstart failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    config = json.loads((out / "base_model_qwen3_5_moe" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert config["text_config"]["layer_types"].count("linear_attention") == 3
    trained = json.loads((out / "pirate_lora" / "adapter_config.json").read_text())["target_modules"]
    assert {"gate", "shared_expert_gate", "in_proj_a", "in_proj_b", "in_proj_qkv"} <= set(trained)
    report = json.loads((out / "eval" / "eval_adapter.json").read_text())
    style = {t: 100.0 * sum(PIRATE_START.match(ex["outputs"][t].strip()) is not None for ex in report["examples"])
             / len(report["examples"]) for t in ("base", "pirate")}
    assert style["pirate"] >= 75.0 and style["base"] <= 25.0, report["examples"]
    assert report["scores"]["pirate"]["rougeL"] > report["scores"]["base"]["rougeL"]
    assert_nothing_left(tag)
