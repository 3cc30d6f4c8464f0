// The small elementwise steps around Qwen3.5's projections, with the roundings of SGLang's CPU ops: the decode stack
// (ops/decode_stack.h) and SGLang's layer loop (through the plugin's op hooks) call these same functions, so a
// request's tokens do not depend on which of the two ran its step.
#pragma once
#include <cstdint>

#include "isa/kernels.h"

namespace kt {

// x[i] = bf16(x[i] · sigmoid(gate[i])) for i < n (Qwen3.5's attention output gate, fused_sigmoid_mul).
void sigmoid_mul(int64_t n, bf16* x, const bf16* gate);

// out[m][j] = bf16(bf16(silu(gu[m][j])) · gu[m][I + j]) for M rows of gu (2 I values, ldg apart) into out (I values,
// ldo apart): SGLang's SiluAndMul.forward_native on bf16 (the SiLU rounded, then the product), the SiLU through
// kern's SwiGLU.
void silu_mul(int M, int I, const bf16* gu, int64_t ldg, bf16* out, int64_t ldo, const Kernels& kern);

// out[m][j] = bf16(out[m][j] + bf16(sigmoid(x[m] · w + delta[m]) · shared[m][j])) for M rows of H (all dense): the
// shared expert's gate (fused_gate_sigmoid_mul_add). delta: fp32 [M] logit deltas (the gate's LoRA) or null.
void shared_expert_gate_add(int M, int H, const bf16* x, const bf16* w, const float* delta, const bf16* shared,
                            bf16* out);

}  // namespace kt
