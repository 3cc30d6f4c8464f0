// Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): decode steps (one new token per request, the request's
// conv and recurrent states updated in place in SGLang's mamba pools) and the prefill's delta rule over whole
// prompts. The semantics are those of the torch ops in kt_serve/sglang_plugin/models/qwen35_gdn.py (the readable
// reference; the tests hold both to transformers' GDN), in fp32. The decode steps are plain C++ (compiled for the
// baseline ISA and vectorized by the compiler): a step reads each request's state once or twice, which the memory
// system bounds, not the arithmetic. The prefill keeps a state block in L1 for many tokens, so its arithmetic
// runs in the kernel table's gdn_scan_columns (compiled per ISA).
#pragma once
#include <cstdint>

#include "isa/kernels.h"

namespace kt {

// Conv states [slots][dim][K - 1], bf16, oldest input first; strides in elements.
struct GdnConvStates {
  bf16* data;
  int64_t slots, slot_stride, dim_stride, tap_stride;
};

// Causal depthwise conv of one token per request. For request n with s = slots[n] >= 0:
//   out[n][c] = act(x[n][c] · w[c][K-1] + Σ_{j < K-1} state[s][c][j] · w[c][j] + bias[c])   (fp32; act: SiLU or none)
// then state[s][c] = (state[s][c][1:], x[n][c]). slots[n] < 0 is a padding row: its output row is zero and no
// state is read or written. w: [dim][K] bf16 rows; bias: [dim] bf16 or null. Throws, before anything is written,
// if a slot is >= states.slots.
// kern: the table whose SwiGLU computes the SiLU (its vector e^x; scalar e^x was most of the op's time).
void gdn_conv_update(int B, int dim, int K, const bf16* x, int64_t ldx, const GdnConvStates& states,
                     const int32_t* slots, const bf16* w, const bf16* bias, bool silu, bf16* out, int64_t ldo,
                     const Kernels& kern);

// Prefill conv of N sequences packed in T rows (sequence n: rows cu[n] .. cu[n + 1]; x, out [T][dim] bf16, rows
// ldx / ldo apart): for each sequence the conv of gdn_conv_update token by token, starting from its state when
// has_initial[n] (else from zeros), and the state left holding its last K-1 inputs (its initial state's where it
// is shorter). slots[n] < 0: from zeros, no state written. Throws, before anything is written, if a slot is
// >= states.slots.
void gdn_conv_prefill(int N, const int64_t* cu, int dim, int K, const bf16* x, int64_t ldx,
                      const GdnConvStates& states, const int32_t* slots, const uint8_t* has_initial, const bf16* w,
                      const bf16* bias, bool silu, bf16* out, int64_t ldo, const Kernels& kern);

// Recurrent states [slots][Hv][Dk][Dv] fp32, read as S[k][v]; strides in elements.
struct GdnStates {
  float* data;
  int64_t slots, slot_stride, head_stride, k_stride, v_stride;
};

// A per-head parameter as the model holds it, fp32 or bf16 (read as stored: no per-call conversion).
struct HeadParam {
  const void* data;
  bool is_bf16;
  float at(int h) const {
    return is_bf16 ? bf16_to_f32(static_cast<const bf16*>(data)[h]) : static_cast<const float*>(data)[h];
  }
};

// One token per request: q, k [B][Hk][Dk], v [B][Hv][Dv] (bf16; heads D values apart, requests ld apart), gate
// inputs a, b [B][Hv] (bf16, requests ld apart), per value head A_log and dt_bias.
struct GdnStepInputs {
  const bf16 *q, *k, *v, *a, *b;
  int64_t ldq, ldk, ldv, lda, ldb;
  HeadParam A_log, dt_bias;
};

// For request n, value head h (key head h / (Hv / Hk)), state S = states[slots[n]][h]:
//   q, k l2-normalised (when l2norm; eps 1e-6), q · Dk^-0.5;
//   g = -e^A_log · softplus(a + dt_bias) (softplus_beta, softplus_threshold as torch's), decay = e^g,
//   beta = sigmoid(b); δ = beta · (v - decay · Sᵀk); out = decay · Sᵀq + (q·k) δ  (bf16, [B][Hv][Dv]);
//   S ← decay · S + k δᵀ.
// slots[n] < 0: a padding row (zero output, no state touched). Throws, before anything is written, if a slot is
// >= states.slots.
void gdn_recurrent_step(int B, int Hk, int Hv, int Dk, int Dv, const GdnStepInputs& in, const GdnStates& states,
                        const int32_t* slots, bool l2norm, float softplus_beta, float softplus_threshold, bf16* out);

// Prefill: N sequences packed in T rows (sequence n: rows cu[n] .. cu[n + 1]), the rule of gdn_recurrent_step
// token by token with the gates given as SGLang's fused_gdn_gating makes them: g [T][Hv] fp32 (the log decay, rows
// ldg apart) and beta [T][Hv] (bf16 or fp32, rows ldbeta apart). q, k [T][Hk][Dk], v [T][Hv][Dv] bf16; l2norm with
// eps as transformers' l2norm. Sequence n starts from states[slots[n]] and leaves its final state there; slots[n]
// < 0: from a zero state, the pool untouched. final (null, or [N][Hv][Dk][Dv] fp32 packed): every sequence's final
// state. out [T][Hv][Dv] bf16. Recurrent, not chunked: with the state block in L1 a token costs one pass over it,
// fewer operations than the chunked form's and none of its padding to 64-token chunks. Throws, before anything is
// written, if a slot is >= states.slots.
struct GdnScanInputs {
  const bf16 *q, *k, *v;
  int64_t ldq, ldk, ldv;
  const float* g;
  int64_t ldg;
  const void* beta;
  bool beta_bf16;
  int64_t ldbeta;
};
void gdn_scan(int N, const int64_t* cu, int Hk, int Hv, int Dk, int Dv, const GdnScanInputs& in,
              const GdnStates& states, const int32_t* slots, bool l2norm, float eps, float* final, bf16* out,
              const Kernels& kern);

}  // namespace kt
