// AVX512-BF16 table (Cooper Lake, Sapphire Rapids and later, Zen 4 and later). Built with
// -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni; only called after cpu_has_avx512_bf16() said yes.
// Hand-written: the packed GEMM block (vdpbf16ps), the LoRA dot products and SwiGLU (vector exp); the rest is
// the generic code vectorised by the compiler for this ISA.
#include <immintrin.h>

#include <cstdlib>
#include <string>

#include "isa/generic.inc"
#include "isa/avx512/quant.inc"

namespace {

using kt::bf16;
using kt::kBlockN;

// MR rows × 64 columns of NB blocks (1, or 2 streamed side by side): MR×NB×4 zmm accumulators; per K pair,
// 4 loads of each block shared by MR broadcasts of that block's A rows. No software prefetch (here and in
// isa/avx512/quant.inc): a block's rows are contiguous and the hardware prefetchers stream them. On Zen 4,
// prefetching 2 KiB ahead into L1 and 8 KiB into L2 as well ran MoE decode (T=1) at 0.79x a plain streaming sum
// over the same bytes, without it at 0.99x (calls interleaved with the sum, evals/bench_kernel.py's stream column).
template <int MR, int NB>
inline void gemm_micro(const bf16* const (&A)[NB], int64_t lda, const bf16* const (&blocks)[NB], int kp,
                       float* const (&C)[NB], int64_t ldc) {
  __m512 acc[NB][MR][4];
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 4; ++v) acc[n][m][v] = _mm512_setzero_ps();
  const int kk_n = kp / 2;
  for (int kk = 0; kk < kk_n; ++kk) {
    for (int n = 0; n < NB; ++n) {
      const bf16* b = blocks[n] + static_cast<int64_t>(kk) * kBlockN * 2;
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 32);
      const __m512bh b2 = (__m512bh)_mm512_loadu_si512(b + 64);
      const __m512bh b3 = (__m512bh)_mm512_loadu_si512(b + 96);
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, A[n] + m * lda + 2 * kk, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        acc[n][m][0] = _mm512_dpbf16_ps(acc[n][m][0], a, b0);
        acc[n][m][1] = _mm512_dpbf16_ps(acc[n][m][1], a, b1);
        acc[n][m][2] = _mm512_dpbf16_ps(acc[n][m][2], a, b2);
        acc[n][m][3] = _mm512_dpbf16_ps(acc[n][m][3], a, b3);
      }
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 4; ++v) _mm512_storeu_ps(C[n] + m * ldc + 16 * v, acc[n][m][v]);
}

template <int MR>
inline void gemm_rows(const bf16* A, int64_t lda, const bf16* block, int kp, float* C, int64_t ldc) {
  gemm_micro<MR, 1>({A}, lda, {block}, kp, {C}, ldc);
}

void gemm_block_avx512(int M, const bf16* A, int64_t lda, const bf16* block, int kp, float* C, int64_t ldc) {
  constexpr int MR = 6;  // 24 accumulators + 4 block registers + 1 broadcast fit the 32 zmm registers
  int m = 0;
  for (; m + MR <= M; m += MR) gemm_rows<MR>(A + m * lda, lda, block, kp, C + m * ldc, ldc);
  switch (M - m) {
    case 5: gemm_rows<5>(A + m * lda, lda, block, kp, C + m * ldc, ldc); break;
    case 4: gemm_rows<4>(A + m * lda, lda, block, kp, C + m * ldc, ldc); break;
    case 3: gemm_rows<3>(A + m * lda, lda, block, kp, C + m * ldc, ldc); break;
    case 2: gemm_rows<2>(A + m * lda, lda, block, kp, C + m * ldc, ldc); break;
    case 1: gemm_rows<1>(A + m * lda, lda, block, kp, C + m * ldc, ldc); break;
    default: break;
  }
}

// Up to kPairRows = 3 rows the blocks are streamed side by side (24 accumulators); more rows reuse each loaded
// block enough that one block at a time with 6-row tiles is faster.
static_assert(kt::kPairRows == 3, "gemm_block_pair_avx512 has micro-kernels for 1..3 rows");
void gemm_block_pair_avx512(int M, const bf16* A0, const bf16* A1, int64_t lda, const bf16* block0,
                            const bf16* block1, int kp, float* C0, float* C1, int64_t ldc) {
  switch (M) {
    case 0: return;
    case 1: return gemm_micro<1, 2>({A0, A1}, lda, {block0, block1}, kp, {C0, C1}, ldc);
    case 2: return gemm_micro<2, 2>({A0, A1}, lda, {block0, block1}, kp, {C0, C1}, ldc);
    case 3: return gemm_micro<3, 2>({A0, A1}, lda, {block0, block1}, kp, {C0, C1}, ldc);
    default:
      gemm_block_avx512(M, A0, lda, block0, kp, C0, ldc);
      gemm_block_avx512(M, A1, lda, block1, kp, C1, ldc);
  }
}

bool g_vbmi = false;  // set with the table: the CPU has AVX512-VBMI, fp8 rows take a VBMI decoder
bool g_fp8_lanes = false;  // which one decodes the rows of decode (isa/avx512/kernels_vbmi.cpp): lanes, else lookup

void qgemm_block_avx512(int M, const bf16* A, int64_t lda, const kt::Int16Rows* X, const kt::Layout& l, kt::Block b,
                        float* C, int64_t ldc) {
  switch (l.fmt) {
    case kt::Format::int8: return igemm_rows<Int8W>(M, A, lda, X, l, b, C, ldc);
    case kt::Format::int4: return igemm_rows<Int4W>(M, A, lda, X, l, b, C, ldc);
    case kt::Format::fp8:
      return g_vbmi ? kt::qgemm_fp8_vbmi(g_fp8_lanes, M, A, lda, l, b, C, ldc)
                    : qgemm_rows<Fp8Row>(M, A, lda, l, b, C, ldc);
    case kt::Format::bf16: return gemm_block_avx512(M, A, lda, reinterpret_cast<const bf16*>(b.w), l.kp, C, ldc);
  }
}

void decode_rows_avx512(const kt::Layout& l, const uint8_t* w, int kk0, int kk1, bf16* out) {
  switch (l.fmt) {
    case kt::Format::int8: return decode_int_rows<Int8W>(w, kk0, kk1, out);
    case kt::Format::int4: return decode_int_rows<Int4W>(w, kk0, kk1, out);
    case kt::Format::fp8:
      return g_vbmi ? kt::decode_fp8_vbmi(w, kk0, kk1, out) : decode_float_rows<Fp8Row>(w, kk0, kk1, out);
    case kt::Format::bf16: return decode_rows_generic(l, w, kk0, kk1, out);
  }
}

// transpose_pairs_generic in 8 × 8 transposes of 64-bit groups: 8 rows of v give, for each of 8 pair rows p of
// Wᵀ, 64 contiguous bytes (K positions [2·r0, 2·r0 + 16)). rows is a multiple of 8 (kp is a multiple of 32).
void transpose_pairs_avx512(int rows, const bf16* v, bf16* dst) {
  const __m512i swap = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
  const __m512i lanes02 = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), lanes13 = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  const __m512i lo4 = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), hi4 = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
  for (int r0 = 0; r0 < rows; r0 += 8)
    for (int p0 = 0; p0 < kBlockN / 2; p0 += 8) {
      __m512i a[8], b[8], c[8];  // a[i]: groups p0..p0+7 of row r0 + i
      for (int i = 0; i < 8; ++i) a[i] = _mm512_shuffle_epi8(_mm512_loadu_si512(v + (r0 + i) * 2 * kBlockN + 4 * p0), swap);
      for (int i = 0; i < 8; i += 2)  // b[i]: rows i, i+1 of groups 0, 2, 4, 6; b[i + 1]: of groups 1, 3, 5, 7
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 1]), b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 1]);
      for (int h = 0; h < 8; h += 4)  // c[h + q]: rows h..h+3 of groups q and q + 4
        for (int t = 0; t < 2; ++t) {
          c[h + t] = _mm512_permutex2var_epi64(b[h + t], lanes02, b[h + 2 + t]);
          c[h + 2 + t] = _mm512_permutex2var_epi64(b[h + t], lanes13, b[h + 2 + t]);
        }
      for (int q = 0; q < 4; ++q) {
        _mm512_storeu_si512(dst + (p0 + q) * 2 * kBlockN + 4 * r0, _mm512_permutex2var_epi64(c[q], lo4, c[4 + q]));
        _mm512_storeu_si512(dst + (p0 + q + 4) * 2 * kBlockN + 4 * r0, _mm512_permutex2var_epi64(c[q], hi4, c[4 + q]));
      }
    }
}

void qgemm_block_pair_avx512(int M, const bf16* A0, const bf16* A1, int64_t lda, const kt::Int16Rows* X0,
                             const kt::Int16Rows* X1, const kt::Layout& l, kt::Block b0, kt::Block b1, float* C0,
                             float* C1, int64_t ldc) {
  switch (l.fmt) {
    case kt::Format::int8: return igemm_pair_rows<Int8W>(M, A0, A1, lda, X0, X1, l, b0, b1, C0, C1, ldc);
    case kt::Format::int4: return igemm_pair_rows<Int4W>(M, A0, A1, lda, X0, X1, l, b0, b1, C0, C1, ldc);
    case kt::Format::fp8:
      return g_vbmi ? kt::qgemm_pair_fp8_vbmi(g_fp8_lanes, M, A0, A1, lda, l, b0, b1, C0, C1, ldc)
                    : qgemm_pair_rows<Fp8Row>(M, A0, A1, lda, l, b0, b1, C0, C1, ldc);
    case kt::Format::bf16:
      return gemm_block_pair_avx512(M, A0, A1, lda, reinterpret_cast<const bf16*>(b0.w),
                                    reinterpret_cast<const bf16*>(b1.w), l.kp, C0, C1, ldc);
  }
}

inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const bf16* p, __mmask16 k) {
  const __m256i v = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// T[m][j] = Σ_k X[m][k] A[j][k], fp32 rows X (the dropout path): four A rows at a time share each load of X.
void lora_a_f32_avx512(int M, const float* X, int64_t ldx, const bf16* A, int r, int K, float* T, int64_t ldt) {
  for (int m = 0; m < M; ++m) {
    const float* x = X + m * ldx;
    for (int j = 0; j < r; j += 4) {
      const int nj = r - j < 4 ? r - j : 4;
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
        const __m512 xv = load16(x + k, mask);
        for (int q = 0; q < nj; ++q)
          acc[q] = _mm512_fmadd_ps(xv, load16(A + static_cast<int64_t>(j + q) * K + k, mask), acc[q]);
      }
      for (int q = 0; q < nj; ++q) T[m * ldt + j + q] = _mm512_reduce_add_ps(acc[q]);
    }
  }
}

// The same for bf16 rows X: vdpbf16ps takes 32 K values of a row and of an A row as they are (the fp32 loop
// above converts both, 16 values at a time: MoE T=512 spent 7.6% of its time there). MR rows (2, or 1 for the
// last) share each load of up to 8 A rows; a row's sums do not depend on the rows it is computed with.
template <int MR>
void lora_a_rows(const bf16* X, int64_t ldx, const bf16* A, int r, int K, float* T, int64_t ldt) {
  for (int j = 0; j < r; j += 8) {
    const int nj = r - j < 8 ? r - j : 8;
    __m512 acc[MR][8];
    for (int i = 0; i < MR; ++i)
      for (int q = 0; q < 8; ++q) acc[i][q] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
      const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : __mmask32((1u << (K - k)) - 1);
      __m512bh x[MR];
      for (int i = 0; i < MR; ++i) x[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, X + i * ldx + k);
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        if (q >= nj) break;
        const __m512bh a = (__m512bh)_mm512_maskz_loadu_epi16(mask, A + static_cast<int64_t>(j + q) * K + k);
        for (int i = 0; i < MR; ++i) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], x[i], a);
      }
    }
    __m512 sums[MR][8];
    spill_sums(acc, sums);
    for (int i = 0; i < MR; ++i)
      for (int q = 0; q < nj; ++q) T[i * ldt + j + q] = _mm512_reduce_add_ps(sums[i][q]);
  }
}

void lora_a_bf16_avx512(int M, const bf16* X, int64_t ldx, const bf16* A, int r, int K, float* T, int64_t ldt) {
  int m = 0;
  for (; m + 2 <= M; m += 2) lora_a_rows<2>(X + m * ldx, ldx, A, r, K, T + m * ldt, ldt);
  if (m < M) lora_a_rows<1>(X + m * ldx, ldx, A, r, K, T + m * ldt, ldt);
}

// e^x for x in about [-87, 88] (outside: clamped), rel. error ~2e-7: 2^n · p(r) with x = n ln2 + r, |r| <= ln2/2.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 sigmoid512(__m512 g) {
  return _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

inline void store_bf16(bf16* p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(p, k, (__m256i)_mm512_cvtneps_pbh(v));
}

inline __mmask16 tail_mask(int left) {
  return left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

inline __m512 load_bf16x16(const bf16* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

// C[m][c] += s·T[m][j]·BT[j][c] with the 64 columns of a row in registers across the rank (the generic loop
// round-trips C through memory once per j), in j order with one FMA per term, as the reference does. Up to four
// rows share each conversion of a BT row to fp32 (one row at a time, converting was most of the work).
void lora_b_add_avx512(int M, const float* T, int64_t ldt, int r, const bf16* BT, int64_t ldb, int nc, float s,
                       float* C, int64_t ldc) {
  constexpr int MR = 4;
  for (int c0 = 0; c0 < nc; c0 += 64) {
    __mmask16 k[4];
    for (int v = 0; v < 4; ++v) k[v] = tail_mask(nc - c0 - 16 * v);
    for (int m0 = 0; m0 < M; m0 += MR) {
      const int mr = M - m0 < MR ? M - m0 : MR;
      __m512 acc[MR][4];
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < 4; ++v)
          acc[i][v] = i < mr ? _mm512_maskz_loadu_ps(k[v], C + (m0 + i) * ldc + c0 + 16 * v) : _mm512_setzero_ps();
      for (int j = 0; j < r; ++j) {
        const bf16* b = BT + j * ldb + c0;
        __m512 bv[4];
        for (int v = 0; v < 4; ++v) bv[v] = load_bf16x16(b + 16 * v, k[v]);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          if (i >= mr) break;
          const __m512 t = _mm512_set1_ps(s * T[(m0 + i) * ldt + j]);
          for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_fmadd_ps(t, bv[v], acc[i][v]);
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        if (i >= mr) break;
        for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(C + (m0 + i) * ldc + c0 + 16 * v, k[v], acc[i][v]);
      }
    }
  }
}

// G[j][k] += s·Q[m][j]·X[m][k] with a 4 × 64 tile of G in registers across the rows (the generic loop reads and
// writes G once per row and j: 5% of a T=512 forward + backward), each row's 64 values converted once per 4 j,
// one fused multiply-add per term in row order, as the generic loop does.
template <typename TX>
void outer_acc_avx512(int M, const float* Q, int64_t ldq, int r, const TX* X, int64_t ldx, int nk, float s,
                      float* G, int64_t ldg) {
  for (int k0 = 0; k0 < nk; k0 += 64) {
    __mmask16 km[4];
    for (int v = 0; v < 4; ++v) km[v] = tail_mask(nk - k0 - 16 * v);
    for (int j0 = 0; j0 < r; j0 += 4) {
      const int nj = r - j0 < 4 ? r - j0 : 4;
      __m512 acc[4][4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        for (int v = 0; v < 4; ++v)
          acc[j][v] = j < nj ? _mm512_maskz_loadu_ps(km[v], G + (j0 + j) * ldg + k0 + 16 * v) : _mm512_setzero_ps();
      for (int m = 0; m < M; ++m) {
        __m512 xv[4];
        for (int v = 0; v < 4; ++v) xv[v] = load16(X + m * ldx + k0 + 16 * v, km[v]);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          if (j >= nj) break;
          const __m512 q = _mm512_set1_ps(s * Q[m * ldq + j0 + j]);
          for (int v = 0; v < 4; ++v) acc[j][v] = _mm512_fmadd_ps(q, xv[v], acc[j][v]);
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        if (j >= nj) break;
        for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(G + (j0 + j) * ldg + k0 + 16 * v, km[v], acc[j][v]);
      }
    }
  }
}

void outer_acc_bf16_avx512(int M, const float* Q, int64_t ldq, int r, const bf16* X, int64_t ldx, int nk, float s,
                           float* G, int64_t ldg) {
  outer_acc_avx512<bf16>(M, Q, ldq, r, X, ldx, nk, s, G, ldg);
}
void outer_acc_f32_avx512(int M, const float* Q, int64_t ldq, int r, const float* X, int64_t ldx, int nk, float s,
                          float* G, int64_t ldg) {
  outer_acc_avx512<float>(M, Q, ldq, r, X, ldx, nk, s, G, ldg);
}

void swiglu_avx512(int n, const float* g, const float* u, bf16* h) {
  for (int c = 0; c < n; c += 16) {
    const __mmask16 k = tail_mask(n - c);
    const __m512 gv = _mm512_maskz_loadu_ps(k, g + c), uv = _mm512_maskz_loadu_ps(k, u + c);
    store_bf16(h + c, _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid512(gv)), uv), k);
  }
}

float swiglu_backward_avx512(int n, float w, const float* q, const bf16* h, float* g, float* u, bf16* dg16,
                             bf16* du16) {
  __m512 dot = _mm512_setzero_ps();
  const __m512 wv = _mm512_set1_ps(w), one = _mm512_set1_ps(1.f);
  for (int c = 0; c < n; c += 16) {
    const __mmask16 k = tail_mask(n - c);
    const __m512 qv = _mm512_maskz_loadu_ps(k, q + c), gv = _mm512_maskz_loadu_ps(k, g + c);
    const __m512 uv = _mm512_maskz_loadu_ps(k, u + c);
    dot = _mm512_fmadd_ps(qv, load16(h + c, k), dot);
    const __m512 dh = _mm512_mul_ps(wv, qv), sg = sigmoid512(gv), silu = _mm512_mul_ps(gv, sg);
    const __m512 du = _mm512_mul_ps(dh, silu);
    const __m512 dsilu = _mm512_mul_ps(sg, _mm512_fmadd_ps(gv, _mm512_sub_ps(one, sg), one));
    const __m512 dg = _mm512_mul_ps(_mm512_mul_ps(dh, uv), dsilu);
    _mm512_mask_storeu_ps(g + c, k, dg);
    _mm512_mask_storeu_ps(u + c, k, du);
    store_bf16(dg16 + c, dg, k);
    store_bf16(du16 + c, du, k);
  }
  return _mm512_reduce_add_ps(dot);
}

// ------------------------------------------------------------------------------------------------ attention

float exp_shifted_avx512(int n, float* x, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 e = exp512(_mm512_sub_ps(load16(x + j, k), mv));
    sum = _mm512_mask_add_ps(sum, k, sum, e);
    _mm512_mask_storeu_ps(x + j, k, e);
  }
  return _mm512_reduce_add_ps(sum);
}

}  // namespace

namespace kt {

const Kernels* kernels_avx512_bf16() {
  // KT_SERVE_AVX512_VBMI=0 keeps the shift decoder (how the tests reach it on a VBMI machine)
  const char* vbmi = std::getenv("KT_SERVE_AVX512_VBMI");
  g_vbmi = cpu_has_avx512_vbmi() && kernels_avx512_vbmi_built() && !(vbmi && std::string(vbmi) == "0");
  g_fp8_lanes = fp8_lanes_decoder();
  static const Kernels k{"avx512_bf16",         gemm_block_avx512,      gemm_block_pair_avx512, lora_a_bf16_avx512,
                         lora_a_f32_avx512,     lora_b_add_avx512,      outer_acc_bf16_avx512,
                         outer_acc_f32_avx512, swiglu_avx512,          swiglu_backward_avx512, qgemm_block_avx512,
                         qgemm_block_pair_avx512, decode_rows_avx512, decode_transposed_generic<decode_rows_avx512, transpose_pairs_avx512>, quantize_rows_generic, gemm_block_scaled_generic<gemm_block_avx512>, kNeverDecode,
                         attn_scores_generic, exp_shifted_avx512, attn_values_generic,
                         gdn_scan_columns_generic};
  return &k;
}

}  // namespace kt
