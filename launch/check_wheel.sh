#!/usr/bin/env bash
# What an installed kt_serve (not the source checkout) can run on its own: `pip install ".[eval]"` into a fresh venv,
# then `python -m kt_serve.quickstart --help` and the quickstart's eval step (kt_serve.harness.eval_adapter) against
# a canned OpenAI-compatible server (tests/fake_openai_server.py). Needs PyPI; builds the kernel (a few minutes).
# Usage: bash launch/check_wheel.sh [WORK_DIR]   (default: a temp dir, removed afterwards)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
[ -n "${1:-}" ] || trap 'rm -rf "$work"' EXIT
py="${PYTHON:-python3}"

"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$here[eval]"
cd "$work"  # nothing of the checkout on sys.path
"$work/venv/bin/python" -m kt_serve.quickstart --help > /dev/null
data="$("$work/venv/bin/python" -c 'import kt_serve.quickstart as q; print(q.EVAL_DATASET)')"
"$work/venv/bin/python" - "$here/tests" "$work/venv/bin/python" "$data" "$work/eval" <<'PY'
import subprocess, sys
tests, python, data, out = sys.argv[1:]
sys.path.insert(0, tests)
from fake_openai_server import FakeOpenAIServer

with FakeOpenAIServer("tiny", base=lambda p: "hello there", adapters={"pirate": lambda p: "arr matey"}) as srv:
    subprocess.run([python, "-m", "kt_serve.harness.eval_adapter", "--base-url", srv.url, "--served-name", "tiny",
                    "--adapters", "pirate", "--dataset", data, "--out", out, "--api", "chat"], check=True)
PY
echo "[check_wheel] ok: the installed wheel runs the quickstart's --help and its eval step"
