// Compute primitives of the MoE-LoRA kernel, one table per ISA, chosen once at run time (isa/cpu_features.cpp).
//
// Packed base weight layout (shared by every ISA): a matrix W [N, K] in nn.Linear layout (y = x Wᵀ) is stored
// as blocks of kBlockN = 64 output columns with K in pairs,
//     block[b][kk][c][j] = W[b*64 + c][2*kk + j]        (zero where b*64+c >= N or 2*kk+j >= K)
// i.e. the "VNNI" layout: one 64-byte row of a block holds 16 columns × 2 consecutive K values, exactly what
// vdpbf16ps consumes, and also what an AMX B tile reads with a 256-byte stride.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "weights/weight_format.h"

namespace kt {

using bf16 = uint16_t;
constexpr int kBlockN = 64;
// Value columns of a GDN state that one gdn_scan_columns call carries (two AVX512 vectors a row).
constexpr int kGdnCols = 32;
constexpr int kPairRows = 3;
constexpr int kScaledRows = 80;  // rows of one GEMM call on a quantized block at most (a MoE task's run of rows)

inline float bf16_to_f32(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void bf16_row_to_f32(const bf16* src, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

inline bf16 f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}

// Input rows of the integer formats (int8, int4): x ≈ scale · q with q int16, rows ld values apart, one scale per
// row, and the sums of q over each 32 K values (rows ld / 32 apart; what int4's minimums multiply). A call's
// rows are quantized once (Kernels::quantize_rows) and read by every block of the matrix.
struct Int16Rows {
  const int16_t* q = nullptr;
  const int32_t* sums = nullptr;
  const float* scale = nullptr;
  int64_t ld = 0;

  int32_t pair(int m, int kk) const {  // the K pair (2kk, 2kk + 1) of row m, as vpdpwssd / vpmaddwd take it
    int32_t v;
    std::memcpy(&v, q + m * ld + 2 * kk, 4);
    return v;
  }
  int32_t sum(int m, int k0, int k1) const {  // Σ q over K values [k0, k1) of row m (multiples of 32)
    int32_t s = 0;
    for (int c = k0 / 32; c < k1 / 32; ++c) s += sums[m * (ld / 32) + c];
    return s;
  }
  Int16Rows from(int m0) const { return {q + m0 * ld, sums + m0 * (ld / 32), scale + m0, ld}; }
};

constexpr int kMaxHeadDim = 1024;  // decode attention's D and Dv: the primitives hold one K or V row in fp32 on the stack
constexpr int kNeverDecode = 1 << 30;  // Kernels::int_decode_min_rows of the tables whose integer path always wins

struct Kernels {
  const char* name;

  // C[m][c] = Σ_k A[m][k] · W[c][k] for one packed block (64 columns), m < M. A: bf16 rows with stride lda,
  // holding kp (= K rounded up to 32, see PackedWeights) values, the padding zero. C: fp32, stride ldc, 64 columns written.
  void (*gemm_block)(int M, const bf16* A, int64_t lda, const bf16* block, int kp, float* C, int64_t ldc);

  // Two gemm_blocks of M rows each: C0 = A0 · block0, C1 = A1 · block1 (A0 may equal A1). With few rows a
  // block is streamed from memory once; reading two blocks side by side keeps twice the loads in flight
  // (up to kPairRows rows; with more, each block is reused enough that the tables do one after the other). The
  // AVX2 table always does one after the other: on Zen 3 two side-by-side streams ran slower (isa/avx2/kernels.cpp).
  void (*gemm_block_pair)(int M, const bf16* A0, const bf16* A1, int64_t lda, const bf16* block0,
                          const bf16* block1, int kp, float* C0, float* C1, int64_t ldc);

  // LoRA weights stay bf16 as given (half the bytes to read); all LoRA arithmetic is fp32.
  // LoRA down-projection: T[m][j] = Σ_k X[m][k] · A[j][k], j < r. A bf16 [r, K].
  void (*lora_a_bf16)(int M, const bf16* X, int64_t ldx, const bf16* A, int r, int K, float* T, int64_t ldt);
  void (*lora_a_f32)(int M, const float* X, int64_t ldx, const bf16* A, int r, int K, float* T, int64_t ldt);

  // LoRA up-projection added to an output tile: C[m][c] += s · Σ_j T[m][j] · BT[j][c], c < nc. BT bf16 rows
  // with stride ldb (BT = Bᵀ, i.e. [r, N]).
  void (*lora_b_add)(int M, const float* T, int64_t ldt, int r, const bf16* BT, int64_t ldb, int nc, float s,
                     float* C, int64_t ldc);

  // Rank-r gradient accumulation: G[j][k] += s · Σ_m Q[m][j] · X[m][k] for j < r, k < nk. G fp32 rows with
  // stride ldg; Q fp32 [M, r] (stride ldq); X bf16 or fp32 rows (stride ldx). LoRA A gradients have this form
  // directly, B gradients after a transpose (see moe/experts.cpp).
  void (*outer_acc_bf16)(int M, const float* Q, int64_t ldq, int r, const bf16* X, int64_t ldx, int nk, float s,
                         float* G, int64_t ldg);
  void (*outer_acc_f32)(int M, const float* Q, int64_t ldq, int r, const float* X, int64_t ldx, int nk, float s,
                        float* G, int64_t ldg);

  // SwiGLU: h[c] = bf16(silu(g[c]) · u[c]), c < n.
  void (*swiglu)(int n, const float* g, const float* u, bf16* h);
  // Its backward for one row, in place: with dh = w · q, g ← dg = dh · u · silu'(g), u ← du = dh · silu(g); also
  // writes bf16 copies of dg and du. Returns Σ q[c] · h[c] (this row's share of the routing-weight gradient).
  float (*swiglu_backward)(int n, float w, const float* q, const bf16* h, float* g, float* u, bf16* dg16, bf16* du16);

  // Quantized blocks (weights/weight_format.h: int8, int4, fp8), for the few rows of decode: the contract of gemm_block
  // and gemm_block_pair with the block's scales applied, values decoded in registers. With many rows
  // weights/packed_weights.cpp decodes a block once (decode_rows) and runs gemm_block instead.
  // X (X0, X1): the integer formats' quantized A rows, or null to have them quantized here.
  void (*qgemm_block)(int M, const bf16* A, int64_t lda, const Int16Rows* X, const Layout& l, Block b, float* C,
                      int64_t ldc);
  void (*qgemm_block_pair)(int M, const bf16* A0, const bf16* A1, int64_t lda, const Int16Rows* X0,
                           const Int16Rows* X1, const Layout& l, Block b0, Block b1, float* C0, float* C1,
                           int64_t ldc);
  // Rows [kk0, kk1) of a quantized block as unscaled bf16 values (exact for every format) in the bf16 layout.
  void (*decode_rows)(const Layout& l, const uint8_t* w, int kk0, int kk1, bf16* out);
  // Rows [kk0, kk0 + rows) (rows <= 32, kk0 a multiple of 32) of block b, dequantized (W = value · scale +
  // offset, one fused multiply-add, rounded to bf16 to nearest even; weights are finite) and transposed into the
  // bf16 block layout of Wᵀ: dst[(c / 2) · 128 + 2q + c % 2] = W[c][2·kk0 + q] for the block's 64 columns c and
  // q < 2·rows. What the backward's dx = dy · W multiplies, a block at a time (weights/packed_weights.cpp).
  void (*decode_transposed)(const Layout& l, Block b, int kk0, int rows, bf16* dst);
  // M rows of kp (a multiple of 32) bf16 values to Int16Rows form: q [M][kp], sums [M][kp / 32], scale [M]
  // (scale = amax / 32767: every bit of a bf16 input kept, error below 2^-15 of the row's largest value).
  void (*quantize_rows)(int M, const bf16* A, int64_t lda, int kp, int16_t* q, int32_t* sums, float* scale);
  // gemm_block over one K chunk of a decoded block (kp: the chunk's length, M <= kScaledRows), with the chunk's
  // scales applied: C[m][c] (+)= (Σ_k A[m][k] · D[c][k]) · s[c] + off[c] · xsum[m] (xsum: the rows' input sums
  // over the chunk; no offset term when off is null), c < 64; C = rather than += when first.
  void (*gemm_block_scaled)(int M, const bf16* A, int64_t lda, const bf16* block, int kp, const float* s,
                            const float* off, const float* xsum, float* C, int64_t ldc, bool first);
  // From this many rows an int8 / int4 block is decoded to bf16 and run through gemm_block rather than the
  // register-decoding qgemm_block. AVX2 (never): its vpmaddwd path outruns its fp32 FMAs on bf16 at any row
  // count. AVX512 (never): on Zen 4, MoE int8 / int4 at T=128 ran 1.25x / 1.17x, at T=256 1.24x / 1.18x and at
  // T=512 1.08x faster in registers than decoded (T=64 the same); the register path had lost 2x before its
  // accumulators stopped being copied every iteration (spill_sums). AMX from 16 rows, where the tiles outrun
  // vpdpwssd. fp8 is decoded from 16 rows always.
  int int_decode_min_rows;

  // Decode attention (ops/attention.cpp), the G query heads of one KV head over n cache slots; K and V rows
  // bf16 at K + slots[j] * ldk (V + slots[j] * ldv), D and Dv <= kMaxHeadDim. Q and O rows are fp32, ldq / ldo
  // apart, zero-padded to a multiple of 8 values.
  // Scores S[g][j] = Σ_d Q[g][d] · K_j[d], S rows lds apart.
  void (*attn_scores)(int n, int G, int D, const float* Q, int64_t ldq, const bf16* K, int64_t ldk,
                      const int32_t* slots, float* S, int64_t lds);
  // Softmax numerators in place, x[j] = e^(x[j] - m); returns their sum.
  float (*exp_shifted)(int n, float* x, float m);
  // O[g][d] += Σ_j P[g][j] · V_j[d], P rows ldp apart.
  void (*attn_values)(int n, int G, int Dv, const float* P, int64_t ldp, const bf16* V, int64_t ldv,
                      const int32_t* slots, float* O, int64_t ldo);

  // The gated delta rule over T tokens of one sequence (ops/gdn.cpp's prefill), on kGdnCols value columns of one
  // head's state S [Dk][kGdnCols] (fp32, rows packed, in L1 for the whole scan). Per token t: q_t, k_t fp32 rows
  // ldqk apart (normalised, q scaled), qk[t] = q_t · k_t, v and o rows [T][kGdnCols] fp32:
  //   δ = beta[t] · (v_t - decay[t] · Sᵀk_t);  o_t = decay[t] · Sᵀq_t + qk[t] · δ;  S ← decay[t] · S + k_t δᵀ.
  // One pass over S a token: the update of token t also reads Sᵀq, Sᵀk for token t + 1.
  void (*gdn_scan_columns)(int T, int Dk, const float* q, const float* k, int64_t ldqk, const float* qk,
                           const float* decay, const float* beta, const float* v, float* S, float* o);
};

const Kernels& kernels_portable();
const Kernels* kernels_avx512_bf16();  // nullptr when this build has no AVX512-BF16 path
const Kernels* kernels_amx_bf16();     // nullptr when this build has no AMX path
const Kernels* kernels_avx2();         // nullptr when this build has no AVX2 path

// The table for this CPU: AMX-BF16, else AVX512-BF16, else AVX2 + FMA, when the CPU and OS support them, else the
// portable one. KT_SERVE_ISA (or the isa argument) names one: "portable", "avx2", "avx512_bf16", "amx_bf16".
const Kernels& select_kernels(const char* requested /* nullptr or "auto" = best */);
bool cpu_has_avx2_fma();
bool cpu_has_avx512_bf16();
bool cpu_has_amx_bf16();            // also obtains the Linux permission to use tile data
bool cpu_has_avx512_vbmi();         // byte permutes: the fp8 row decoders of the AVX512 tables use them
bool kernels_avx512_vbmi_built();   // whether this build has those decoders
// Which VBMI fp8 decoder the AVX512 tables run (isa/avx512/kernels_vbmi.cpp): KT_SERVE_FP8_DECODER=lanes|lookup, by
// default lanes on Intel CPUs (their two-source byte permutes, which the lookup decoder is made of, are slow)
// and lookup elsewhere (measured on Zen 4). Throws on another value.
bool fp8_lanes_decoder();

}  // namespace kt
