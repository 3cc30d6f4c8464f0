#!/usr/bin/env bash
# Serve a MoE model with attention (and shared experts, router, non-expert LoRA) on the GPU and the routed
# experts on the CPU in the kt_serve kernel (activations copied in/out per MoE layer).
# Needs a CUDA sglang==0.5.23 install (its own requirements) plus `pip install -e .` of kt_serve; no CPU shims.
# CUDA graphs: the plugin turns them off (logged), since the CPU expert call cannot be captured yet; check the host
# first with launch/check_gpu.sh (python -m kt_serve.check).
# Usage: launch/serve_gpu.sh MODEL_DIR [EXPERT_LORA_DIR] [extra sglang flags...]
set -euo pipefail
model="${1:?usage: $0 MODEL_DIR [EXPERT_LORA_DIR] [sglang flags...]}"; shift
expert=()
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then expert=(--kt-expert-lora-path "$1"); shift; fi
exec "${PYTHON:-python}" -m sglang.launch_server --model-path "$model" \
  --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}" \
  --kt-threads "${KT_THREADS:-0}" "${expert[@]}" \
  --enable-lora --max-loras-per-batch "${MAX_LORAS:-4}" \
  --max-lora-rank "${MAX_LORA_RANK:-64}" --lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj \
  "$@"
