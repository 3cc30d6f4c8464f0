#!/usr/bin/env bash
# Serve a MoE model on a CPU-only host: stock sglang + the kt_serve plugin (installed by launch/install.sh).
# Usage: launch/serve_cpu.sh MODEL_DIR [EXPERT_LORA_DIR] [extra sglang flags...]
#   e.g. launch/serve_cpu.sh /models/tiny /adapters/expert --lora-paths support=/adapters/kt_sft_out
# Requests: model="MODEL_DIR" (base + the global expert adapter) or model="MODEL_DIR:support" (both halves).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
model="${1:?usage: $0 MODEL_DIR [EXPERT_LORA_DIR] [sglang flags...]}"; shift
expert=()
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then expert=(--kt-expert-lora-path "$1"); shift; fi
export SGLANG_USE_CPU_ENGINE=1   # also set by the install's .pth; harmless twice
exec "$py" -m sglang.launch_server --model-path "$model" --device cpu \
  --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}" \
  --max-total-tokens "${MAX_TOTAL_TOKENS:-8192}" \
  --kt-threads "${KT_THREADS:-0}" "${expert[@]}" \
  --enable-lora --lora-backend torch_native --max-loras-per-batch "${MAX_LORAS:-4}" \
  --max-lora-rank "${MAX_LORA_RANK:-64}" --lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj \
  "$@"
