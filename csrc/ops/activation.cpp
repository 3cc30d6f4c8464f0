#include "ops/activation.h"

#include <cmath>
#include <vector>

#include "common/thread_pool.h"

namespace kt {

namespace {
inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }
}  // namespace

void sigmoid_mul(int64_t n, bf16* x, const bf16* gate) {
  for (int64_t i = 0; i < n; ++i) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * sigmoid(bf16_to_f32(gate[i])));
}

void silu_mul(int M, int I, const bf16* gu, int64_t ldg, bf16* out, int64_t ldo, const Kernels& kern) {
  auto rows = [&](int64_t m0, int64_t m1) {
    thread_local std::vector<float> g, one;
    thread_local std::vector<bf16> s;
    g.resize(I), one.assign(I, 1.f), s.resize(I);
    for (int64_t m = m0; m < m1; ++m) {
      const bf16* row = gu + m * ldg;
      for (int j = 0; j < I; ++j) g[j] = bf16_to_f32(row[j]);
      kern.swiglu(I, g.data(), one.data(), s.data());  // bf16(silu(g)), exactly rounded
      for (int j = 0; j < I; ++j) out[m * ldo + j] = f32_to_bf16(bf16_to_f32(s[j]) * bf16_to_f32(row[I + j]));
    }
  };
  parallel_rows(M, static_cast<int64_t>(M) * I, rows);
}

void shared_expert_gate_add(int M, int H, const bf16* x, const bf16* w, const float* delta, const bf16* shared,
                            bf16* out) {
  for (int m = 0; m < M; ++m) {
    const bf16* xm = x + static_cast<int64_t>(m) * H;
    float logit = 0.f;
    for (int j = 0; j < H; ++j) logit += bf16_to_f32(xm[j]) * bf16_to_f32(w[j]);
    if (delta) logit += delta[m];  // after the product, as SGLang's gate LoRA adds it
    const float g = sigmoid(logit);
    bf16* o = out + static_cast<int64_t>(m) * H;
    const bf16* s = shared + static_cast<int64_t>(m) * H;
    for (int j = 0; j < H; ++j) o[j] = f32_to_bf16(bf16_to_f32(o[j]) + bf16_to_f32(f32_to_bf16(g * bf16_to_f32(s[j]))));
  }
}

}  // namespace kt
