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

void gdn_conv_prefill(int N, const int64_t* cu, int dim, int K, const bf16* x, int64_t ldx, const GdnConvStates& st,
                      const int32_t* slots, const uint8_t* has_initial, const bf16* w, const bf16* bias,
                      bool silu_act, bf16* out, int64_t ldo, const Kernels& kern) {
  check_slots(N, slots, st.slots, "causal conv1d");
  constexpr int kChannels = 256;  // channels a task: its window and sums stay in L1 while it walks the tokens
  const int64_t chunks = (dim + kChannels - 1) / kChannels;
  run_tasks(N * chunks, (cu[N] - cu[0]) * dim * K, [&](int64_t task) {
    const int n = static_cast<int>(task / chunks), c0 = static_cast<int>(task % chunks) * kChannels;
    const int nc = std::min(dim, c0 + kChannels) - c0, taps = K - 1;
    thread_local std::vector<float> buf, ones;
    buf.resize(static_cast<size_t>(2 * K) * kChannels);  // window (K - 1), wt (K), acc (1)
    ones.resize(kChannels, 1.f);
    // window[j][c]: the input j + 1 steps before the next token's (oldest first); wt[j][c] = w[c0 + c][j]
    float *window = buf.data(), *wt = window + taps * kChannels, *acc = wt + K * kChannels;
    for (int j = 0; j < K; ++j)
      for (int c = 0; c < nc; ++c) wt[j * kChannels + c] = bf16_to_f32(w[static_cast<int64_t>(c0 + c) * K + j]);
    bf16* state = slots[n] >= 0 ? st.data + slots[n] * st.slot_stride : nullptr;
    for (int j = 0; j < taps; ++j)
      for (int c = 0; c < nc; ++c)
        window[j * kChannels + c] =
            state && has_initial[n] ? bf16_to_f32(state[(c0 + c) * st.dim_stride + j * st.tap_stride]) : 0.f;
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
      const bf16* xr = x + t * ldx + c0;
      const float* wl = wt + taps * kChannels;
      for (int c = 0; c < nc; ++c) acc[c] = bf16_to_f32(xr[c]) * wl[c];
      for (int j = 0; j < taps; ++j)
        for (int c = 0; c < nc; ++c) acc[c] += window[j * kChannels + c] * wt[j * kChannels + c];
      if (bias)
        for (int c = 0; c < nc; ++c) acc[c] += bf16_to_f32(bias[c0 + c]);
      if (silu_act)  // the table's SwiGLU with an up projection of ones, as gdn_conv_update
        kern.swiglu(nc, acc, ones.data(), out + t * ldo + c0);
      else
        for (int c = 0; c < nc; ++c) out[t * ldo + c0 + c] = f32_to_bf16(acc[c]);
      for (int j = 0; j + 1 < taps; ++j)
        std::copy(window + (j + 1) * kChannels, window + (j + 1) * kChannels + nc, window + j * kChannels);
      if (taps > 0)
        for (int c = 0; c < nc; ++c) window[(taps - 1) * kChannels + c] = bf16_to_f32(xr[c]);
    }
    if (state && cu[n + 1] > cu[n])  // bf16 inputs round-trip through fp32 exactly
      for (int j = 0; j < taps; ++j)
        for (int c = 0; c < nc; ++c)
          state[(c0 + c) * st.dim_stride + j * st.tap_stride] = f32_to_bf16(window[j * kChannels + c]);
  });
}

namespace {

// Σ x[i] · y[i] in eight interleaved partial sums (vectorisable without reassociating a float chain).
float dot(int D, const float* x, const float* y) {
  float part[8] = {};
  int i = 0;
  for (; i + 8 <= D; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += x[i + j] * y[i + j];
  float sum = 0.f;
  for (; i < D; ++i) sum += x[i] * y[i];
  for (int j = 0; j < 8; ++j) sum += part[j];
  return sum;
}

// q or k of one head to fp32, l2-normalised when asked (x / sqrt(Σx² + eps)), times scale.
void head_f32(int D, const bf16* src, bool l2norm, float scale, float* dst, float eps = 1e-6f) {
  for (int i = 0; i < D; ++i) dst[i] = bf16_to_f32(src[i]);
  const float f = (l2norm ? 1.f / std::sqrt(dot(D, dst, dst) + eps) : 1.f) * scale;
  for (int i = 0; i < D; ++i) dst[i] *= f;
}

// n floats, src and dst values src_stride / dst_stride apart.
void copy_columns(int n, const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  if (src_stride == 1 && dst_stride == 1) {
    std::copy(src, src + n, dst);
    return;
  }
  for (int c = 0; c < n; ++c) dst[c * dst_stride] = src[c * src_stride];
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
    const float qk = dot(Dk, q, k);
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

void gdn_scan(int N, const int64_t* cu, int Hk, int Hv, int Dk, int Dv, const GdnScanInputs& in,
              const GdnStates& st, const int32_t* slots, bool l2norm, float eps, float* final, bf16* out,
              const Kernels& kern) {
  if (Hk <= 0 || Hv % Hk != 0) throw std::invalid_argument("gated delta rule: value heads must be a multiple of key heads");
  check_slots(N, slots, st.slots, "gated delta rule");
  constexpr int C = kGdnCols;
  // Tokens of each sequence a round takes: a round first prepares their q, k (fp32, normalised, scaled), q·k, decay
  // and beta once per key (value) head, then scans them for every (sequence, value head, column block).
  constexpr int64_t kWindow = 256;
  const int rep = Hv / Hk, blocks = (Dv + C - 1) / C;
  const float q_scale = 1.f / std::sqrt(static_cast<float>(Dk));
  const int64_t ldo = static_cast<int64_t>(Hv) * Dv, block_size = static_cast<int64_t>(Dk) * C;
  int64_t longest = 0;
  for (int n = 0; n < N; ++n) longest = std::max(longest, cu[n + 1] - cu[n]);
  // The column blocks' states between rounds, packed, so a scan's block is contiguous (16 KB with Dk 128: in L1).
  // Kept by the calling thread: a prompt's layers reuse the pages (faulting in 2 MB a sequence cost more than its
  // whole 32-token scan).
  // (A thread_local names another thread's copy inside the tasks: they get the caller's buffers by pointer.)
  thread_local std::vector<float> state_buffer, qk_buffer, dot_buffer, gate_buffer;
  state_buffer.resize(static_cast<size_t>(N) * Hv * blocks * block_size);
  float* const states = state_buffer.data();
  std::vector<int64_t> first(N + 1);  // sequence n's tokens of this round: prepared rows first[n] .. first[n + 1]
  // qk_rows, qk_dot, gates per prepared row: [Hk][Dk] q then [Hk][Dk] k; [Hk] q·k; [Hv] decay then [Hv] beta
  for (int64_t w0 = 0; w0 < std::max<int64_t>(longest, 1); w0 += kWindow) {
    first[0] = 0;
    for (int n = 0; n < N; ++n)
      first[n + 1] = first[n] + std::clamp<int64_t>(cu[n + 1] - cu[n] - w0, 0, kWindow);
    const int64_t rows = first[N];
    qk_buffer.resize(static_cast<size_t>(rows) * 2 * Hk * Dk);
    dot_buffer.resize(static_cast<size_t>(rows) * Hk);
    gate_buffer.resize(static_cast<size_t>(rows) * 2 * Hv);
    float *const qk_rows = qk_buffer.data(), *const qk_dot = dot_buffer.data(), *const gates = gate_buffer.data();
    run_tasks(rows, rows * Hk * Dk * 4, [&](int64_t r) {
      const int n = static_cast<int>(std::upper_bound(first.begin(), first.end(), r) - first.begin()) - 1;
      const int64_t t = cu[n] + w0 + (r - first[n]);
      float* qr = qk_rows + r * 2 * Hk * Dk;
      for (int kh = 0; kh < Hk; ++kh) {
        float *q = qr + kh * Dk, *k = qr + (Hk + kh) * Dk;
        head_f32(Dk, in.q + t * in.ldq + static_cast<int64_t>(kh) * Dk, l2norm, q_scale, q, eps);
        head_f32(Dk, in.k + t * in.ldk + static_cast<int64_t>(kh) * Dk, l2norm, 1.f, k, eps);
        qk_dot[r * Hk + kh] = dot(Dk, q, k);
      }
      float* gr = gates + r * 2 * Hv;
      for (int h = 0; h < Hv; ++h) {
        gr[h] = std::exp(in.g[t * in.ldg + h]);
        gr[Hv + h] = in.beta_bf16 ? bf16_to_f32(static_cast<const bf16*>(in.beta)[t * in.ldbeta + h])
                                  : static_cast<const float*>(in.beta)[t * in.ldbeta + h];
      }
    });
    run_tasks(static_cast<int64_t>(N) * Hv * blocks, rows * Hv * Dk * Dv, [&](int64_t task) {
      const int n = static_cast<int>(task / (Hv * blocks)), h = static_cast<int>(task / blocks % Hv);
      const int c0 = static_cast<int>(task % blocks) * C, nc = std::min(C, Dv - c0), kh = h / rep;
      const int64_t len = cu[n + 1] - cu[n], w = first[n + 1] - first[n];
      if (w0 > 0 && w == 0) return;  // sequence done in an earlier round
      float* S = states + task * block_size;
      float* pool = slots[n] >= 0 ? st.data + slots[n] * st.slot_stride + h * st.head_stride : nullptr;
      const int64_t ks = st.k_stride, vs = st.v_stride;
      if (w0 == 0) {  // its columns past Dv zero: they stay zero (their δ is 0)
        std::fill(S, S + block_size, 0.f);
        if (pool)
          for (int i = 0; i < Dk; ++i) copy_columns(nc, pool + i * ks + c0 * vs, vs, S + i * C, 1);
      }
      thread_local std::vector<float> buf;
      buf.resize(4 * kWindow + 2 * kWindow * C);
      float *qk = buf.data(), *decay = qk + kWindow, *beta = decay + kWindow, *v = beta + kWindow,
            *o = v + kWindow * C;
      const int64_t r0 = first[n], ld = 2 * static_cast<int64_t>(Hk) * Dk;
      for (int64_t j = 0; j < w; ++j) {
        const int64_t t = cu[n] + w0 + j;
        qk[j] = qk_dot[(r0 + j) * Hk + kh];
        decay[j] = gates[(r0 + j) * 2 * Hv + h];
        beta[j] = gates[(r0 + j) * 2 * Hv + Hv + h];
        const bf16* vr = in.v + t * in.ldv + static_cast<int64_t>(h) * Dv + c0;
        for (int c = 0; c < C; ++c) v[j * C + c] = c < nc ? bf16_to_f32(vr[c]) : 0.f;
      }
      const float* qrow = qk_rows + r0 * ld + kh * Dk;
      kern.gdn_scan_columns(static_cast<int>(w), Dk, qrow, qrow + Hk * Dk, ld, qk, decay, beta, v, S, o);
      for (int64_t j = 0; j < w; ++j) {
        bf16* orow = out + (cu[n] + w0 + j) * ldo + static_cast<int64_t>(h) * Dv + c0;
        for (int c = 0; c < nc; ++c) orow[c] = f32_to_bf16(o[j * C + c]);
      }
      if (w0 + w < len) return;  // more rounds to come
      if (pool && len > 0)
        for (int i = 0; i < Dk; ++i) copy_columns(nc, S + i * C, 1, pool + i * ks + c0 * vs, vs);
      if (final) {
        float* f = final + (static_cast<int64_t>(n) * Hv + h) * Dk * Dv + c0;
        for (int i = 0; i < Dk; ++i) copy_columns(nc, S + i * C, 1, f + static_cast<int64_t>(i) * Dv, 1);
      }
    });
  }
}

}  // namespace kt
