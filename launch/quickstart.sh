#!/usr/bin/env bash
# The README's main-job command: install everything into .venv (idempotent), then run the whole flow offline on
# CPU: tiny base MoE -> LoRA SFT -> convert -> SGLang server with the adapter -> eval base vs adapter -> report.
# Usage: bash launch/quickstart.sh [--out runs/quickstart] [--model-path DIR] [--adapter DIR] [--small] ...
#        (all flags: bash launch/quickstart.sh --help)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bash "$here/launch/install.sh"
exec "$here/.venv/bin/python" -m kt_serve.quickstart "$@"
