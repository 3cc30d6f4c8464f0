#include "ops/gdn.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/thread_pool.h"

namespace kt {

namespace {

void check_slots(int B, const int32_t* slots, int64_t pool_slots, const char* what) {
  for (int n = 0; n < B; ++n)
    if (slots[n] >= pool_slots)
      throw std::out_of_range(std::string(what) + ": request " + std::to_string(n) + " names state slot " +
                              std::to_string(slots[n]) + ", the pool holds " + std::to_string(pool_slots));
}

// Runs fn(t) for t < tasks (parallel_rows' runs of tasks), on the pool when the call is worth the hand-off.
template <class Fn>
void run_tasks(int64_t tasks, int64_t values, Fn&& fn) {
  parallel_rows(tasks, values, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(t);
  });
}

float softplus(float x, float beta, float threshold) {  // torch.nn.functional.softplus
  return x * beta > threshold ? x : std::log1p(std::exp(beta * x)) / beta;
}

}  // namespace

void gdn_conv_update(int B, int dim, int K, const bf16* x, int64_t ldx, const GdnConvStates& st,
                     const int32_t* slots, const bf16* w, const bf16* bias, bool silu_act, bf16* out, int64_t ldo,
                     const Kernels& kern) {
  check_slots(B, slots, st.slots, "causal conv1d update");
  constexpr int kChannels = 512;  // channels a task
  const int64_t chunks = (dim + kChannels - 1) / kChannels;
  run_tasks(B * chunks, static_cast<int64_t>(B) * dim * K, [&](int64_t t) {
    const int n = static_cast<int>(t / chunks), c0 = static_cast<int>(t % chunks) * kChannels;
    const int c1 = std::min(dim, c0 + kChannels);
    bf16* o = out + n * ldo;
    if (slots[n] < 0) {
      std::fill(o + c0, o + c1, bf16(0));
      return;
    }
    thread_local std::vector<float> acc, ones;
    acc.resize(kChannels);
    ones.resize(kChannels, 1.f);
    bf16* s = st.data + slots[n] * st.slot_stride;
    const bf16* xr = x + n * ldx;
    for (int c = c0; c < c1; ++c) {
      const bf16* wc = w + static_cast<int64_t>(c) * K;
      bf16* sc = s + c * st.dim_stride;
      float a = bf16_to_f32(xr[c]) * bf16_to_f32(wc[K - 1]);
      for (int j = 0; j < K - 1; ++j) a += bf16_to_f32(sc[j * st.tap_stride]) * bf16_to_f32(wc[j]);
      acc[c - c0] = bias ? a + bf16_to_f32(bias[c]) : a;
      for (int j = 0; j + 1 < K - 1; ++j) sc[j * st.tap_stride] = sc[(j + 1) * st.tap_stride];
      if (K > 1) sc[(K - 2) * st.tap_stride] = xr[c];
    }
    if (silu_act)  // the table's SwiGLU with an up projection of ones: silu(acc) · 1, its vector e^x
      kern.swiglu(c1 - c0, acc.data(), ones.data(), o + c0);
    else
      for (int c = c0; c < c1; ++c) o[c] = f32_to_bf16(acc[c - c0]);
  });
}

namespace {

// q or k of one head to fp32, l2-normalised when asked, times scale.
void head_f32(int D, const bf16* src, bool l2norm, float scale, float* dst) {
  float ss = 0.f;
  for (int i = 0; i < D; ++i) {
    dst[i] = bf16_to_f32(src[i]);
    ss += dst[i] * dst[i];
  }
  const float f = (l2norm ? 1.f / std::sqrt(ss + 1e-6f) : 1.f) * scale;
  for (int i = 0; i < D; ++i) dst[i] *= f;
}

// (Sᵀq, Sᵀk) of a [Dk][Dv] state, rows ks apart, values vs apart.
void read_state(int Dk, int Dv, const float* S, int64_t ks, int64_t vs, const float* q, const float* k, float* rq,
                float* rk) {
  std::fill(rq, rq + Dv, 0.f);
  std::fill(rk, rk + Dv, 0.f);
  for (int i = 0; i < Dk; ++i) {
    const float* row = S + i * ks;
    const float qi = q[i], ki = k[i];
    if (vs == 1) {
      for (int v = 0; v < Dv; ++v) {
        rq[v] += qi * row[v];
        rk[v] += ki * row[v];
      }
    } else {
      for (int v = 0; v < Dv; ++v) {
        rq[v] += qi * row[v * vs];
        rk[v] += ki * row[v * vs];
      }
    }
  }
}

// S ← decay · S + k δᵀ.
void update_state(int Dk, int Dv, float* S, int64_t ks, int64_t vs, float decay, const float* k, const float* delta) {
  for (int i = 0; i < Dk; ++i) {
    float* row = S + i * ks;
    const float ki = k[i];
    if (vs == 1) {
      for (int v = 0; v < Dv; ++v) row[v] = row[v] * decay + ki * delta[v];
    } else {
      for (int v = 0; v < Dv; ++v) row[v * vs] = row[v * vs] * decay + ki * delta[v];
    }
  }
}

}  // namespace

void gdn_recurrent_step(int B, int Hk, int Hv, int Dk, int Dv, const GdnStepInputs& in, const GdnStates& st,
                        const int32_t* slots, bool l2norm, float softplus_beta, float softplus_threshold, bf16* out) {
  if (Hk <= 0 || Hv % Hk != 0) throw std::invalid_argument("gated delta rule: value heads must be a multiple of key heads");
  check_slots(B, slots, st.slots, "gated delta rule");
  const int rep = Hv / Hk;
  const float q_scale = 1.f / std::sqrt(static_cast<float>(Dk));
  run_tasks(static_cast<int64_t>(B) * Hv, static_cast<int64_t>(B) * Hv * Dk * Dv, [&](int64_t t) {
    const int n = static_cast<int>(t / Hv), h = static_cast<int>(t % Hv), kh = h / rep;
    bf16* o = out + (static_cast<int64_t>(n) * Hv + h) * Dv;
    if (slots[n] < 0) {
      std::fill(o, o + Dv, bf16(0));
      return;
    }
    thread_local std::vector<float> scratch;
    scratch.resize(2 * static_cast<size_t>(Dk) + 3 * static_cast<size_t>(Dv));
    float *q = scratch.data(), *k = q + Dk, *rq = k + Dk, *rk = rq + Dv, *delta = rk + Dv;
    head_f32(Dk, in.q + n * in.ldq + static_cast<int64_t>(kh) * Dk, l2norm, q_scale, q);
    head_f32(Dk, in.k + n * in.ldk + static_cast<int64_t>(kh) * Dk, l2norm, 1.f, k);
    float qk = 0.f;
    for (int i = 0; i < Dk; ++i) qk += q[i] * k[i];
    const float a = bf16_to_f32(in.a[n * in.lda + h]) + in.dt_bias.at(h);
    const float decay = std::exp(-std::exp(in.A_log.at(h)) * softplus(a, softplus_beta, softplus_threshold));
    const float beta = 1.f / (1.f + std::exp(-bf16_to_f32(in.b[n * in.ldb + h])));
    float* S = st.data + slots[n] * st.slot_stride + h * st.head_stride;
    read_state(Dk, Dv, S, st.k_stride, st.v_stride, q, k, rq, rk);
    const bf16* v = in.v + n * in.ldv + static_cast<int64_t>(h) * Dv;
    for (int j = 0; j < Dv; ++j) {
      delta[j] = beta * (bf16_to_f32(v[j]) - decay * rk[j]);
      o[j] = f32_to_bf16(decay * rq[j] + qk * delta[j]);
    }
    update_state(Dk, Dv, S, st.k_stride, st.v_stride, decay, k, delta);
  });
}

}  // namespace kt
