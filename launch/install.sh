#!/usr/bin/env bash
# Create (or update) the project venv: CPU torch, stock sglang==0.5.23 without its CUDA stack, kt_serve.
# Idempotent: a second run only re-checks. Usage: bash launch/install.sh [VENV_DIR]   (default .venv)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-${KT_SERVE_VENV:-$here/.venv}}"
py="${PYTHON:-python3}"

[ -x "$venv/bin/python" ] || { echo "[install] creating venv $venv"; "$py" -m venv "$venv"; }
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# pip's noise about sglang's (deliberately) missing CUDA dependencies hides real errors: filter it, keep the status.
quiet() {
  local rc
  set +e
  "$@" 2>&1 | grep -v -e "is ignored: it is neither" -e "which is not installed" -e "which is incompatible" \
    -e "dependency resolver does not currently"
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

# CPU torch first; the constraint keeps every later step from swapping it for a CUDA build.
pin="$venv/torch-pin.txt"
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "[install] torch 2.13.0 (CPU build)"
  quiet "${pip[@]}" "torch==2.13.0"
fi
"$venv/bin/python" -c 'import torch; print("torch==" + torch.__version__)' > "$pin"

# Re-run when the requirements change (their hash is stamped into the venv).
stamp="$venv/.kt_serve_requirements.sha256"
want="$(sha256sum "$here/launch/requirements-cpu.txt" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$venv/bin/python" -c 'import sglang, transformers, peft, openai' 2>/dev/null; then
  echo "[install] sglang==0.5.23 (no CUDA dependencies) and pure-Python requirements"
  quiet "${pip[@]}" -c "$pin" --no-deps sglang==0.5.23 torchvision==0.28.0
  quiet "${pip[@]}" -c "$pin" -r "$here/launch/requirements-cpu.txt"
  echo "$want" > "$stamp"
fi

echo "[install] CPU shims (only where no GPU stack exists)"
"$venv/bin/python" "$here/launch/cpu_shims/install_shims.py"

echo "[install] kt_serve (builds the C++ kernel)"
quiet "${pip[@]}" -c "$pin" --no-build-isolation -e "$here"
"$venv/bin/python" -c 'import kt_serve._kernel as k; print("[install] kernel ok, ISA:", k.cpu_isa())'
