#include "ops/norm.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "common/thread_pool.h"

namespace kt {

namespace {
inline float weight_f32(bf16 w) { return bf16_to_f32(w); }
inline float weight_f32(float w) { return w; }

// kRoundSum: the sum x + r rounded to bf16 before it is normalised (Gemma's norm adds in the activation dtype).
template <bool kRoundSum, typename W>
void norm_row(int H, const bf16* x, const bf16* r, const W* w, float eps, bf16* y, bf16* r_out, float* s) {
  float ss = 0.f;
  for (int i = 0; i < H; ++i) {
    float v = bf16_to_f32(x[i]) + (r ? bf16_to_f32(r[i]) : 0.f);
    if (kRoundSum && r) v = bf16_to_f32(f32_to_bf16(v));
    s[i] = v;
    ss += v * v;
  }
  if (r_out)
    for (int i = 0; i < H; ++i) r_out[i] = f32_to_bf16(s[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int i = 0; i < H; ++i) y[i] = f32_to_bf16(s[i] * inv * weight_f32(w[i]));
}

template <bool kRoundSum, typename W>
void norm_rows(int M, int H, const bf16* x, const bf16* residual, int64_t ld, const W* w, float eps, bf16* y,
               bf16* residual_out) {
  auto rows = [&](int64_t m0, int64_t m1) {
    thread_local std::vector<float> s;
    s.resize(H);
    for (int64_t m = m0; m < m1; ++m)
      norm_row<kRoundSum>(H, x + m * ld, residual ? residual + m * ld : nullptr, w, eps, y + m * ld,
                          residual ? residual_out + m * ld : nullptr, s.data());
  };
  parallel_rows(M, static_cast<int64_t>(M) * H, rows);
}
}  // namespace

void rms_norm(int M, int H, const bf16* x, const bf16* residual, int64_t ld, const bf16* w, float eps, bf16* y,
              bf16* residual_out) {
  norm_rows<false>(M, H, x, residual, ld, w, eps, y, residual_out);
}

void rms_norm_gemma(int M, int H, const bf16* x, const bf16* residual, int64_t ld, const float* w1, float eps,
                    bf16* y, bf16* residual_out) {
  norm_rows<true>(M, H, x, residual, ld, w1, eps, y, residual_out);
}

void rms_norm_gated(int M, int N, int group, const bf16* x, const bf16* z, const float* w, const float* b, float eps,
                    bool sigmoid_gate, bf16* out, const Kernels& kern) {
  if (group <= 0 || N % group != 0) throw std::invalid_argument("gated RMSNorm: the group must divide the row");
  auto rows = [&](int64_t m0, int64_t m1) {
    thread_local std::vector<float> y, zf;
    y.resize(N);
    zf.resize(N);
    for (int64_t m = m0; m < m1; ++m) {
      const bf16* xr = x + m * N;
      const bf16* zr = z + m * N;
      for (int g0 = 0; g0 < N; g0 += group) {
        float ss = 0.f;
        for (int i = g0; i < g0 + group; ++i) {
          y[i] = bf16_to_f32(xr[i]);
          ss += y[i] * y[i];
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(group) + eps);
        for (int i = g0; i < g0 + group; ++i) y[i] = y[i] * inv * w[i] + (b ? b[i] : 0.f);
      }
      for (int i = 0; i < N; ++i) zf[i] = bf16_to_f32(zr[i]);
      bf16* o = out + m * N;
      if (sigmoid_gate)
        for (int i = 0; i < N; ++i) o[i] = f32_to_bf16(y[i] / (1.f + std::exp(-zf[i])));
      else
        kern.swiglu(N, zf.data(), y.data(), o);  // silu(z) · y
    }
  };
  parallel_rows(M, static_cast<int64_t>(M) * N, rows);
}

namespace {
template <typename W>
void norm_heads(int T, int heads, int D, bf16* x, int64_t ld, const W* w, float eps) {
  auto tokens = [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> s;
    s.resize(D);
    for (int64_t t = t0; t < t1; ++t)
      for (int h = 0; h < heads; ++h) {
        bf16* row = x + t * ld + static_cast<int64_t>(h) * D;
        norm_row<false>(D, row, nullptr, w, eps, row, nullptr, s.data());
      }
  };
  parallel_rows(T, static_cast<int64_t>(T) * heads * D, tokens);
}
}  // namespace

void rms_norm_heads(int T, int heads, int D, bf16* x, int64_t ld, const bf16* w, float eps) {
  norm_heads(T, heads, D, x, ld, w, eps);
}

void rms_norm_heads_gemma(int T, int heads, int D, bf16* x, int64_t ld, const float* w1, float eps) {
  norm_heads(T, heads, D, x, ld, w1, eps);
}

}  // namespace kt
