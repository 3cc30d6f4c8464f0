// A dense linear layer y = x Wᵀ (+ bias) on the MoE kernel's packed weights (weights/packed_weights.h, any format), for
// the non-expert layers of a CPU decode step (attention projections, shared experts, router, lm_head): a few rows
// stream W once through the same decode microkernels as the experts, two 64-column blocks side by side; many rows
// (prefill) take each block once per 64 rows.
#pragma once
#include <cstdint>
#include <string>

#include "isa/kernels.h"
#include "weights/packed_weights.h"

namespace kt {

class PackedLinear {
 public:
  // W [N, K] bf16, rows ldw apart; quantized to fmt (group: K values per int4 / fp8 scale) in parallel.
  PackedLinear(int N, int K, const bf16* w, int64_t ldw, Format fmt, int group, const Kernels& kern);

  // y[m][n] = Σ_k x[m][k] · W[n][k] + bias[n] for m < M. x bf16 rows ldx apart; bias fp32 [N] or null;
  // y bf16 (y_fp32 false) or fp32 rows ldy apart.
  void forward(int M, const bf16* x, int64_t ldx, const float* bias, void* y, int64_t ldy, bool y_fp32) const;

  int out_features() const { return w_.N; }
  int in_features() const { return w_.K; }
  Format format() const { return w_.layout.fmt; }
  size_t weight_bytes() const { return w_.bytes(); }
  std::string isa() const { return k_.name; }
  float at(int n, int k) const { return w_.at(0, n, k); }  // the dequantized W[n][k]

 private:
  const Kernels& k_;
  PackedWeights w_;
};

}  // namespace kt
