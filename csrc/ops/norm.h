// RMSNorm of a CPU decode step in one pass (SGLang's RMSNorm.forward_native, which runs it as a chain of torch ops,
// each a dispatch and a pass over the rows): for each row, s = x (+ residual) in fp32, residual_out = bf16(s),
// y = bf16(s · rsqrt(mean(s²) + eps) · w).
#pragma once
#include <cstdint>

#include "isa/kernels.h"

namespace kt {

// M rows of H values: x, residual (null: none), y and residual_out (null when residual is) bf16, rows ld apart
// (the same ld for all); w bf16 [H]. y may alias x, residual_out may alias residual.
void rms_norm(int M, int H, const bf16* x, const bf16* residual, int64_t ld, const bf16* w, float eps, bf16* y,
              bf16* residual_out);

// Gemma's RMSNorm (SGLang's GemmaRMSNorm.forward_native, Qwen3.5's layer norms): the residual added in bf16 first,
// s = bf16(x + residual), residual_out = s, y = bf16(s · rsqrt(mean(s²) + eps) · w1) with w1 = 1 + weight in fp32.
void rms_norm_gemma(int M, int H, const bf16* x, const bf16* residual, int64_t ld, const float* w1, float eps,
                    bf16* y, bf16* residual_out);

// fla's gated RMSNorm with the norm before the gate (Qwen3.5's Gated DeltaNet output norm, SGLang's
// layernorm_gated.RMSNorm): per group of `group` values of each of the M rows of N, y = norm(x) · w (+ b), then
// out = bf16(y · act(z)), act SiLU (z · sigmoid(z), through kern's SwiGLU) or sigmoid; fp32 throughout. x, z,
// out: bf16 rows of N, contiguous; w, b: fp32 [N] (b null: none).
void rms_norm_gated(int M, int N, int group, const bf16* x, const bf16* z, const float* w, const float* b, float eps,
                    bool sigmoid_gate, bf16* out, const Kernels& kern);

// RMSNorm of every head in place (Qwen3's q_norm / k_norm, over the q or k part of qkv rows): T token rows ld
// apart, each `heads` dense heads of D values normalised by w bf16 [D].
void rms_norm_heads(int T, int heads, int D, bf16* x, int64_t ld, const bf16* w, float eps);
// The same with Gemma's weight w1 = 1 + weight, fp32 (Qwen3.5's q_norm / k_norm: fp32 throughout, one rounding).
void rms_norm_heads_gemma(int T, int heads, int D, bf16* x, int64_t ld, const float* w1, float eps);

}  // namespace kt
