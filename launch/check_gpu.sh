#!/usr/bin/env bash
# The GPU-host self-check: python -m kt_serve.check (tiny DeepSeek-V2 and Qwen3-MoE with a composite adapter, served
# through stock launch_server with the experts on the CPU kernel, against the fp32 reference; one table).
# On a machine with torch + CUDA but no SGLang and no network, pass a directory of wheels prepared where pip works:
#   pip download -d WHEELS sglang==0.5.23 openai pybind11 setuptools   (for that machine's Python and platform)
# Usage: launch/check_gpu.sh [WHEEL_DIR] [kt_serve.check flags, e.g. --families qwen3_moe]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-python3}"
wheels=""
if [ $# -gt 0 ] && [ -d "$1" ]; then wheels="$1"; shift; fi
from=(); [ -n "$wheels" ] && from=(--no-index --find-links "$wheels")
if ! "$py" -c 'import sglang, openai' 2>/dev/null; then
  [ -n "$wheels" ] || { echo "check_gpu: sglang is not installed here; pass a WHEEL_DIR holding sglang==0.5.23 and its dependencies" >&2; exit 2; }
  echo "[check_gpu] sglang==0.5.23 from $wheels"
  "$py" -m pip install -q --disable-pip-version-check "${from[@]}" "sglang==0.5.23" openai pybind11
fi
echo "[check_gpu] kt_serve (builds the C++ kernel)"
"$py" -m pip install -q --disable-pip-version-check "${from[@]}" --no-build-isolation --no-deps -e "$here"
exec "$py" -m kt_serve.check "$@"
