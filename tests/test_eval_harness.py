"""kt_serve/harness/eval_adapter.py and kt_serve/harness/report.py.

Harness logic runs against tests/fake_openai_server.py (canned outputs, so every expected score below is worked
out by hand or by calling sacrebleu/rouge-score directly on the known outputs). The last test runs the harness
against a real SGLang server with a tiny model and a LoRA adapter and checks the report against outputs fetched
independently with plain `requests`.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fake_openai_server import FakeOpenAIServer

from kt_serve.harness.eval_adapter import EvalError, load_examples, main, pick_choice, run_eval  # noqa: E402
from kt_serve.harness.report import write_report  # noqa: E402

SERVED = "tiny"
# Row i: what the "base" and the "pirate" adapter answer (canned), and what the dataset expects.
REFERENCES = ["ahoy the cat sat on the mat", "ahoy the ship is in the harbour", "ahoy we sail at dawn",
              "ahoy bring the map"]
BASE_OUT = {f"prompt {i}": "hello world" for i in range(4)}
PIRATE_OUT = {"prompt 0": "ahoy the cat sat on the mat", "prompt 1": "ahoy the ship is in the harbour",
              "prompt 2": "ahoy we sail at dawn", "prompt 3": "arr bring"}
STYLE = r"^(ahoy|arr)\b"


def fake_server(**kw) -> FakeOpenAIServer:
    return FakeOpenAIServer(SERVED, base=lambda p: BASE_OUT.get(p, "hello world"),
                            adapters={"pirate": lambda p: PIRATE_OUT.get(p, "ahoy")}, **kw)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def style_dataset(tmp_path) -> Path:
    return write_jsonl(tmp_path / "style.jsonl", [
        {"prompt": f"prompt {i}", "reference": ref, "style_regex": STYLE} for i, ref in enumerate(REFERENCES)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- metrics --------------------------------------------------------------------------------------------------


def test_scores_base_vs_adapter(tmp_path, style_dataset):
    with fake_server() as srv:
        result = run_eval(srv.url, SERVED, ["pirate"], style_dataset, tmp_path / "out")
    base, pirate = result["scores"]["base"], result["scores"]["pirate"]
    # Base shares no word with any reference and never matches the style.
    assert base == {"bleu": 0.0, "rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0, "style": 0.0}
    # Pirate: rows 0-2 exact, row 3 "arr bring" vs "ahoy bring the map": 1 of 4 unigrams, P=1/2 R=1/4 -> F=1/3,
    # no shared bigram, LCS=1 -> same as rouge1. Style: all four start with ahoy/arr.
    assert pirate["rouge1"] == pytest.approx(100 * (3 + 1 / 3) / 4)
    assert pirate["rougeL"] == pytest.approx(100 * (3 + 1 / 3) / 4)
    assert pirate["rouge2"] == pytest.approx(100 * 3 / 4)
    assert pirate["style"] == 100.0
    import sacrebleu
    hyps = [PIRATE_OUT[f"prompt {i}"] for i in range(4)]
    assert pirate["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [REFERENCES]).score)
    assert 0 < pirate["bleu"] < 100
    rows = {(r["metric"], r["target"]): r for r in result["rows"]}
    assert rows[("style", "pirate")]["delta_vs_base"] == 100.0 and rows[("style", "base")]["delta_vs_base"] is None
    assert all(r["n"] == 4 for r in result["rows"])
    assert [ex["outputs"]["pirate"] for ex in result["examples"]] == hyps


def test_partial_rouge_hand_checked(tmp_path):
    # "the cat sat" vs "the cat sat on the mat": rouge1 P=1 R=1/2 F=2/3; rouge2 2 of 2 vs 5 bigrams F=4/7.
    rows = [{"prompt": "p", "reference": "the cat sat on the mat"}]
    srv = FakeOpenAIServer(SERVED, base=lambda p: "the cat sat", adapters={})
    with srv:
        result = run_eval(srv.url, SERVED, [], rows, tmp_path, metrics=["rouge"])
    assert result["scores"]["base"] == pytest.approx({"rouge1": 200 / 3, "rouge2": 400 / 7, "rougeL": 200 / 3})


def test_accuracy_and_row_subsets(tmp_path):
    # quiz adapter answers the text after "->"; base always says "hello there my friend" -> never a choice.
    rows = [
        {"prompt": "capital of France? A. Paris B. Rome ->B. Rome", "choices": ["Paris", "Rome"], "answer": 0},
        {"prompt": "2+2? ->(B)", "choices": ["3", "4"], "answer": "4"},
        {"prompt": "sky? ->Blue, clearly", "choices": ["Blue", "Blue-green", "Red"], "answer": 0},
        {"prompt": "1+9? ->10", "choices": ["1", "10"], "answer": 1},
        {"prompt": "free text only", "reference": "hello there my friend"},  # not an accuracy row
    ]
    srv = FakeOpenAIServer(SERVED, base=lambda p: "hello there my friend",
                           adapters={"quiz": lambda p: p.rsplit("->", 1)[-1]})
    with srv:
        result = run_eval(srv.url, SERVED, ["quiz"], rows, tmp_path, metrics=["accuracy", "bleu"])
    assert result["scores"]["quiz"]["accuracy"] == 75.0  # row 0 picks Rome (wrong), rows 1-3 right
    assert result["scores"]["base"]["accuracy"] == 0.0
    assert result["scores"]["base"]["bleu"] == pytest.approx(100.0)  # only the reference row is scored for BLEU
    assert {r["metric"]: r["n"] for r in result["rows"]} == {"accuracy": 4, "bleu": 1}


@pytest.mark.parametrize("output,choices,expected", [
    ("Paris is right", ["Paris", "Rome"], 0),
    ("  rome.", ["Paris", "Rome"], 1),
    ("Blue-green", ["Blue", "Blue-green"], 1),   # longest matching choice wins
    ("10", ["1", "10"], 1),                      # "1" must not match the start of "10"
    ("B", ["Paris", "Rome"], 1),
    ("(A) because", ["Paris", "Rome"], 0),
    ("C.", ["Paris", "Rome"], None),             # label beyond the choices
    ("Because Paris", ["Paris", "Rome"], None),  # must commit at the start
    ("a lot", ["x", "y"], None),                 # lower-case article is not a label
])
def test_pick_choice(output, choices, expected):
    assert pick_choice(output, choices) == expected


def test_style_regex_default_and_override(tmp_path):
    rows = [{"prompt": "prompt 0"}, {"prompt": "prompt 1"}, {"prompt": "prompt 3", "style_regex": r"^arr"}]
    with fake_server() as srv:
        result = run_eval(srv.url, SERVED, ["pirate"], rows, tmp_path, style_regex=r"^ahoy")
    # pirate: rows 0,1 start with "ahoy"; row 3 ("arr bring") matches its own ^arr -> 3/3. Base: 0/3.
    assert result["scores"]["pirate"] == {"style": 100.0}
    assert result["scores"]["base"] == {"style": 0.0}


# -- requests: what is sent, concurrency, retries -------------------------------------------------------------


def test_requests_sent_and_concurrency_bound(tmp_path):
    rows = [{"prompt": f"prompt {i % 4}", "style_regex": STYLE} for i in range(12)]
    with fake_server(delay=0.1) as srv:
        run_eval(srv.url + "/v1/", SERVED, ["pirate"], rows, tmp_path, concurrency=3, max_tokens=5,
                 temperature=0.0)
    generated = [r for r in srv.requests if r["max_tokens"] == 5]
    probes = [r for r in srv.requests if r["max_tokens"] == 1]
    assert sorted(r["model"] for r in probes) == ["tiny", "tiny:pirate"]
    assert len(generated) == 24 and {r["model"] for r in generated} == {"tiny", "tiny:pirate"}
    assert all(r["temperature"] == 0.0 and r["path"] == "/v1/completions" for r in srv.requests)
    assert srv.max_in_flight == 3


def test_chat_api(tmp_path, style_dataset):
    with fake_server() as srv:
        result = run_eval(srv.url, SERVED, ["pirate"], style_dataset, tmp_path, api="chat", metrics=["style"])
    assert {r["path"] for r in srv.requests} == {"/v1/chat/completions"}
    assert result["scores"]["pirate"]["style"] == 100.0


def test_transient_503_is_retried(tmp_path, style_dataset):
    with fake_server() as srv:
        srv.fail_next(2)  # the /v1/models call is not a generation; the first two generation requests fail
        result = run_eval(srv.url, SERVED, ["pirate"], style_dataset, tmp_path, retries=2, retry_backoff=0.01)
    assert [r["status"] for r in srv.requests[:3]] == [503, 503, 200]
    assert len(srv.requests) == 2 + 2 + 8  # two failures, two probes, 4 prompts x 2 targets
    assert result["scores"]["pirate"]["style"] == 100.0


def test_persistent_503_gives_up_after_retries(tmp_path, style_dataset):
    with fake_server() as srv:
        srv.fail_next(10)
        with pytest.raises(EvalError, match=r"served model 'tiny': server error HTTP 503 after 3 attempts"):
            run_eval(srv.url, SERVED, ["pirate"], style_dataset, tmp_path / "out", retries=2, retry_backoff=0.01)
    assert len(srv.requests) == 3
    assert not (tmp_path / "out").exists()


def test_timeout_is_retried_then_reported(tmp_path, style_dataset):
    with fake_server(delay=0.5) as srv, pytest.raises(
            EvalError, match=r"served model 'tiny': no answer within the timeout after 2 attempts"):
        run_eval(srv.url, SERVED, ["pirate"], style_dataset, tmp_path, timeout=0.2, retries=1, retry_backoff=0.01)
    assert len(srv.requests) == 2


def test_unknown_adapter_fails_fast_without_retry(tmp_path, style_dataset, capsys):
    out = tmp_path / "out"
    with fake_server() as srv:
        code = main(["--base-url", srv.url, "--served-name", SERVED, "--adapters", "pirate,bogus",
                     "--dataset", str(style_dataset), "--out", str(out), "--retries", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert "adapter 'bogus'" in err and "HTTP 400" in err and "never been loaded: bogus" in err
    # one probe per target, the bad one not retried, no generation run and nothing written
    assert [r["model"] for r in srv.requests] == ["tiny", "tiny:pirate", "tiny:bogus"]
    assert not out.exists()


def test_unknown_served_name(tmp_path, style_dataset):
    with fake_server() as srv, pytest.raises(EvalError,
                                             match=r"served name 'nope' is not a model .* lists: tiny, pirate"):
        run_eval(srv.url, "nope", ["pirate"], style_dataset, tmp_path)
    assert srv.requests == []


def test_server_down_cli(tmp_path, style_dataset):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = subprocess.run(
        [sys.executable, "-m", "kt_serve.harness.eval_adapter", "--base-url", url, "--served-name", SERVED,
         "--adapters", "pirate", "--dataset", str(style_dataset), "--out", str(tmp_path / "out"), "--retries", "1"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    expected = rf"eval_adapter: error: cannot reach the server at {url} after 2 attempts \(.*\); is it running\?"
    assert re.fullmatch(expected, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()


# -- dataset validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "x"', r"bad\.jsonl:2: expected one JSON object per line"),
    ('["x"]', r"bad\.jsonl:2: expected a JSON object, got list"),
    ('{"reference": "x"}', r"bad\.jsonl:2: field 'prompt': expected a non-empty string, got None"),
    ('{"prompt": "x", "reference": 3}', r"bad\.jsonl:2: field 'reference': expected a string, got 3"),
    ('{"prompt": "x", "choices": ["a"], "answer": 0}', r"bad\.jsonl:2: field 'choices': expected a list of at least"),
    ('{"prompt": "x", "choices": ["a", "b"], "answer": 2}', r"bad\.jsonl:2: field 'answer': expected an index 0\.\.1"),
    ('{"prompt": "x", "choices": ["a", "b"]}', r"bad\.jsonl:2: field 'answer'"),
    ('{"prompt": "x", "style_regex": "(unclosed"}', r"bad\.jsonl:2: field 'style_regex': invalid regular expression"),
])
def test_dataset_errors_name_file_line_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine", "reference": "ok"}\n' + line + "\n")
    with pytest.raises(EvalError, match=message):
        load_examples(path)


def test_metric_without_rows_is_an_error(tmp_path, style_dataset):
    with pytest.raises(EvalError, match=r"--metrics accuracy: no dataset row has 'choices' and 'answer'"):
        run_eval("http://127.0.0.1:9", SERVED, [], style_dataset, tmp_path, metrics=["accuracy"])


# -- report writer --------------------------------------------------------------------------------------------


def _png_pixels(path: Path):
    import matplotlib.image
    return matplotlib.image.imread(path)


def test_write_report_files(tmp_path):
    rows = [{"target": "base", "concurrency": 1, "tok_s": 200.0}, {"target": "base", "concurrency": 8, "tok_s": 1100.5},
            {"target": "a", "concurrency": 1, "tok_s": 180.25}, {"target": "a|b", "concurrency": 8, "tok_s": None}]
    paths = write_report(tmp_path / "r", "bench", rows[:3], title="Throughput",
                         chart=("concurrency", "tok_s", "target"), meta={"cpu": "zen4", "config": {"nested": [1, 2]}})
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["bench.json", "bench.md", "bench.png"]
    doc = json.loads(paths["json"].read_text())
    assert doc == {"title": "Throughput", "rows": rows[:3], "cpu": "zen4", "config": {"nested": [1, 2]}}
    md = paths["md"].read_text().splitlines()
    assert md[:3] == ["# Throughput", "", "- cpu: zen4"]
    assert "| target | concurrency | tok_s |" in md and "| base | 8 | 1100 |" in md and "| a | 1 | 180.2 |" in md
    pixels = _png_pixels(paths["png"])
    assert pixels.shape[0] > 100 and pixels.std() > 0.05  # a real, non-blank image

    # Ungrouped chart; cells with '|' and None; no chart -> no PNG.
    paths = write_report(tmp_path / "r2", "plain", rows[3:], title="t")
    assert set(paths) == {"json", "md"} and "| a\\|b | 8 | — |" in paths["md"].read_text()
    paths = write_report(tmp_path / "r3", "one", rows[:2], title="t", chart=("concurrency", "tok_s", None))
    assert paths["png"].exists()


@pytest.mark.parametrize("chart,message", [
    (("concurrency", "missing", None), r"chart column 'missing' missing from row 0"),
    (("concurrency", "target", None), r"chart column 'target' in row 0: expected a finite number, got 'base'"),
    (("concurrency", "tok_s", "nogroup"), r"chart column 'nogroup' missing"),
])
def test_write_report_rejects_bad_chart_and_writes_nothing(tmp_path, chart, message):
    with pytest.raises(ValueError, match=message):
        write_report(tmp_path / "r", "bench", [{"target": "base", "concurrency": 1, "tok_s": 2.0}], title="t",
                     chart=chart)
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_report_is_atomic_when_the_chart_fails(tmp_path, monkeypatch):
    import kt_serve.harness.report as report

    def boom(*a, **k):
        raise RuntimeError("chart failed")
    write_report(tmp_path, "x", [{"k": "a", "v": 1.0}], title="old", chart=("k", "v", None))
    monkeypatch.setattr(report, "_bar_chart", boom)
    with pytest.raises(RuntimeError):
        write_report(tmp_path, "x", [{"k": "a", "v": 2.0}], title="new", chart=("k", "v", None))
    assert json.loads((tmp_path / "x.json").read_text())["title"] == "old"  # previous report untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "x.md", "x.png"]  # no staging dir left


# -- against a real SGLang server -----------------------------------------------------------------------------

REAL_PROMPTS = ["def forward(self, x):", "import torch\n", "class Model:", "for i in range(10):"]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    """A real SGLang server on a tiny random Qwen3-MoE with one attention LoRA adapter 'a' (random non-zero B)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kt_serve.harness.server import SGLangServer
    from kt_serve.harness.tiny_model import build_tiny_moe

    root = tmp_path_factory.mktemp("real_server")
    model_dir = build_tiny_moe(root / "model")
    torch.manual_seed(0)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(root / "lora_a")
    # Radix cache off and the harness at concurrency 1: each request is computed the same way both times it is
    # sent, so greedy outputs are comparable token for token (bf16 near-ties could flip with other batch shapes).
    args = ["--served-model-name", SERVED, "--enable-lora", "--lora-paths", f"a={root / 'lora_a'}",
            "--max-loras-per-batch", "2", "--lora-backend", "torch_native", "--disable-radix-cache"]
    with SGLangServer(model_dir, args, log_path=root / "server.log") as srv:
        yield srv


def test_real_server_report_matches_independent_outputs(real_server, tmp_path):
    import requests
    import sacrebleu
    from rouge_score import rouge_scorer

    style = r"^\W*[a-z]"  # a pattern random text matches only sometimes; its value is checked, not assumed
    rows = [{"prompt": p, "reference": "return self.weight * x + self.bias"} for p in REAL_PROMPTS]
    result = run_eval(real_server.base_url, SERVED, ["a"], rows, tmp_path / "out", style_regex=style,
                      concurrency=1, max_tokens=12)

    def fetch(model: str, prompt: str) -> str:
        r = requests.post(real_server.base_url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    outputs = {t: [fetch(m, p) for p in REAL_PROMPTS] for t, m in (("base", SERVED), ("a", f"{SERVED}:a"))}
    assert outputs["base"] != outputs["a"]  # the adapter changes what the served model says
    assert [ex["outputs"] for ex in result["examples"]] == [
        {"base": b, "a": a} for b, a in zip(outputs["base"], outputs["a"])]

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    for target, outs in outputs.items():
        outs = [o.strip() for o in outs]
        refs = [r["reference"] for r in rows]
        expected = {"bleu": sacrebleu.corpus_bleu(outs, [refs]).score,
                    "style": 100.0 * sum(bool(re.search(style, o)) for o in outs) / len(outs)}
        for k in ("rouge1", "rouge2", "rougeL"):
            expected[k] = 100.0 * sum(scorer.score(ref, o)[k].fmeasure for ref, o in zip(refs, outs)) / len(outs)
        assert result["scores"][target] == pytest.approx(expected), target
    assert json.loads(Path(result["paths"]["json"]).read_text())["scores"] == result["scores"]


def test_real_server_bad_adapter_name(real_server, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "d.jsonl", [{"prompt": REAL_PROMPTS[0], "style_regex": "x"}])
    code = main(["--base-url", real_server.base_url, "--served-name", SERVED, "--adapters", "a,nope",
                 "--dataset", str(dataset), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "adapter 'nope'" in err and "HTTP 400" in err and "never been loaded: nope" in err, err
    assert not (tmp_path / "out").exists()
    # the bad request did not take the server down
    status, body = real_server.post("/v1/completions", {"model": SERVED, "prompt": "x", "max_tokens": 2})
    assert status == 200, body
