// AVX2 + FMA table (Haswell and later, Zen 1-3: CPUs without AVX512-BF16). Built with -mavx2 -mfma; only called
// after cpu_has_avx2_fma() said yes. Reads the same packed "VNNI" blocks as the other tables: a 32-byte load of
// a block row holds 8 columns × 2 consecutive K values; the even-K values become fp32 by shifting each 32-bit
// lane left by 16, the odd-K values by clearing its low 16 bits.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "isa/generic.inc"
#include "common/prefetch.h"

namespace {

using kt::bf16;
using kt::kBlockN;

// ------------------------------------------------------------------------------------------------ vector helpers

inline __m256 bf16x8_to_f32(__m128i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)); }

inline __m256i tail_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 values from p, of which the first n (< 8: the rest read as 0, nothing past them is touched) are valid.
inline __m256 load8(const float* p, int n) { return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask(n)); }
inline __m256 load8(const bf16* p, int n) {
  if (n >= 8) return bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) bf16 t[8] = {};
  std::memcpy(t, p, sizeof(bf16) * std::max(n, 0));
  return bf16x8_to_f32(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}
inline void store8(float* p, __m256 v, int n) {
  if (n >= 8) return _mm256_storeu_ps(p, v);
  _mm256_maskstore_ps(p, tail_mask(n), v);
}

// Round to nearest even exactly as kt::f32_to_bf16 (NaN stays NaN), first n of 8 values stored.
inline void store_bf16x8(bf16* p, __m256 v, int n) {
  const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_add_epi32(u, bias), 16),
                                       _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  if (n >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  alignas(16) bf16 t[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(t), h);
  std::memcpy(p, t, sizeof(bf16) * std::max(n, 0));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// ------------------------------------------------------------------------------------------------ packed GEMM

// K is walked in chunks of kKC values: the chunk's A rows are converted to fp32 once (so a broadcast is one load)
// and the chunk's rows of each block stay in L1 while the column passes and row groups go over it. Scale groups
// of the quantized formats are multiples of kKC, so a chunk has one scale. One block at a time, each row read
// whole by one pass where the registers allow: on Zen 3 (EPYC Milan), MoE decode ran 11-14% (T=1) and 6-11%
// (T=8) faster that way than with two blocks streamed side by side in passes over parts of each row.
constexpr int kKC = 64;

// Fixed-count loops over accumulators are unrolled before scalar replacement runs, or GCC keeps the accumulator
// array in memory and stores it every K step.
#define KT_UNROLL _Pragma("GCC unroll 16")

// Row decoders of the fp32 path (bf16, fp8; weights/weight_format.h): column group v (< 8) of one K-pair row of a block
// as fp32 times 2^-kExponentShift, its even-K values in `even` and odd-K values in `odd` (8 columns each), exact.
struct Bf16Row {
  static constexpr int kRowBytes = 256;
  static constexpr int kExponentShift = 0;
  static constexpr int kPrefetchAhead = 0;  // measured no faster with the fp8 rows' prefetch
  static void split(const uint8_t* row, int v, __m256& even, __m256& odd) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * v));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
};
// e4m3 bits placed in an fp32: value · 2^-120 (subnormals exact as fp32 denormals), sign from the sign extension.
// The 2^120 is not multiplied in here: the input rows carry it (prescale_rows), two multiplies fewer per 16
// weights. A one-row pass (decode) reads rows 2 KiB ahead into L1: with this many instructions per byte too few
// loads are in flight for the hardware prefetchers. MoE decode, AVX2 table on a Sapphire Rapids-class Xeon VM:
// T=1 3.77 -> 3.30 ms (prescale) -> 2.26 ms (and prefetch), T=8 22.4 -> 15.6 ms; 1 or 4 KiB ahead the same.
struct Fp8Row {
  static constexpr int kRowBytes = 128;
  static constexpr int kExponentShift = 120;
  static constexpr int kPrefetchAhead = 2048;
  static void split(const uint8_t* row, int v, __m256& even, __m256& odd) {
    const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v)));
    const __m256i mask = _mm256_set1_epi32(static_cast<int>(0x87F00000u));
    even = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, 20), mask));
    odd = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, 4), mask));
  }
};

// Multiplies n fp32 values (n a multiple of 8) by 2^k, k = min(shift, 127 - the largest exponent among them) so
// that none overflows, and returns 2^(shift - k), the factor left for the scales. Powers of two change no
// rounding: a · 2^k times w · 2^-shift, summed and times s · 2^(shift - k), is a · w summed and times s, bit for
// bit, as long as the products stay normal (|a · w| ≥ 2^-126 at k = shift, which bf16 activations of a
// checkpoint's weights do).
inline float prescale_rows(int n, float* x, int shift) {
  __m256i top = _mm256_setzero_si256();
  for (int i = 0; i < n; i += 8)
    top = _mm256_max_epi32(top, _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(x + i)),
                                                 _mm256_set1_epi32(0x7f800000)));
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), top);
  const int exponent = (*std::max_element(lanes, lanes + 8) >> 23) - 127;
  const int k = std::min(shift, 127 - exponent);
  const __m256 up = _mm256_castsi256_ps(_mm256_set1_epi32((127 + k) << 23));
  for (int i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), up));
  return std::ldexp(1.f, shift - k);
}

// The first of several column passes over a chunk asks for all of each row, so the lines the later passes read
// arrive with the ones it reads (the prefetchers would see every other line of a block).
template <int RowBytes>
inline void prefetch_whole_row(const uint8_t* row) {
  for (int q = 64; q < RowBytes; q += 64) kt::prefetch_l1(row + q);
}

// One column pass over a K chunk: MR rows × NC groups of 8 columns (groups v0 .. v0 + NC). a: fp32 rows (stride
// kc), b: the block's first row of the chunk, c: the output at the pass's first column. Per K pair each
// accumulator takes two FMAs (even-K, odd-K). Scaled (quantized) chunks accumulate from zero and add acc · s into
// C; bf16 ones continue C unless first. Register budget (16 ymm): the accumulators, two decoder constants, and
// either the decoded block values (2·NC, with the broadcasts streamed; when MR > NC) or the broadcasts (2·MR).
template <class D, int MR, int NC>
inline void gemm_pass(const float* a, int kc, const uint8_t* b, int v0, float* c, const float* s, float rescale,
                      int64_t ldc, bool first) {
  constexpr bool kHoldB = MR > NC;
  static_assert(MR * NC + 2 * (kHoldB ? NC : MR) + 3 <= 16, "tile does not fit the 16 ymm registers");
  const bool carry = s == nullptr && !first;
  __m256 acc[MR][NC];
  KT_UNROLL
  for (int m = 0; m < MR; ++m)
    KT_UNROLL
    for (int v = 0; v < NC; ++v) acc[m][v] = carry ? _mm256_loadu_ps(c + m * ldc + 8 * v) : _mm256_setzero_ps();
  for (int kk = 0; kk < kc / 2; ++kk) {
    const uint8_t* row = b + static_cast<int64_t>(kk) * D::kRowBytes;
    const float* ar = a + 2 * kk;
    if (NC < 8 && v0 == 0) prefetch_whole_row<D::kRowBytes>(row);
    if (NC == 8 && D::kPrefetchAhead > 0)
      for (int q = 0; q < D::kRowBytes; q += 64) kt::prefetch_l1(row + D::kPrefetchAhead + q);
    if constexpr (kHoldB) {
      __m256 even[NC], odd[NC];
      KT_UNROLL
      for (int v = 0; v < NC; ++v) D::split(row, v0 + v, even[v], odd[v]);
      KT_UNROLL
      for (int m = 0; m < MR; ++m) {
        const __m256 a0 = _mm256_broadcast_ss(ar + m * kc), a1 = _mm256_broadcast_ss(ar + m * kc + 1);
        KT_UNROLL
        for (int v = 0; v < NC; ++v) {
          acc[m][v] = _mm256_fmadd_ps(a0, even[v], acc[m][v]);
          acc[m][v] = _mm256_fmadd_ps(a1, odd[v], acc[m][v]);
        }
      }
    } else {
      __m256 a0[MR], a1[MR];
      KT_UNROLL
      for (int m = 0; m < MR; ++m) {
        a0[m] = _mm256_broadcast_ss(ar + m * kc);
        a1[m] = _mm256_broadcast_ss(ar + m * kc + 1);
      }
      KT_UNROLL
      for (int v = 0; v < NC; ++v) {
        __m256 even, odd;
        D::split(row, v0 + v, even, odd);
        KT_UNROLL
        for (int m = 0; m < MR; ++m) {
          acc[m][v] = _mm256_fmadd_ps(a0[m], even, acc[m][v]);
          acc[m][v] = _mm256_fmadd_ps(a1[m], odd, acc[m][v]);
        }
      }
    }
  }
  __m256 sums[MR][NC];
  spill_sums(acc, sums);
  KT_UNROLL
  for (int m = 0; m < MR; ++m)
    KT_UNROLL
    for (int v = 0; v < NC; ++v) {
      float* out = c + m * ldc + 8 * v;
      __m256 r = sums[m][v];
      if (s) {
        const __m256 sv = _mm256_mul_ps(_mm256_loadu_ps(s + 8 * (v0 + v)), _mm256_set1_ps(rescale));
        r = first ? _mm256_mul_ps(r, sv) : _mm256_fmadd_ps(r, sv, _mm256_loadu_ps(out));
      }
      _mm256_storeu_ps(out, r);
    }
}

// All 64 columns of one K chunk, 8 / NC passes.
template <class D, int MR, int NC>
void gemm_chunk(const float* a, int kc, const uint8_t* b, float* c, const float* s, float rescale, int64_t ldc,
                bool first) {
  static_assert(kBlockN % (8 * NC) == 0, "passes must tile the 64 columns");
  for (int p = 0; p < kBlockN / (8 * NC); ++p)
    gemm_pass<D, MR, NC>(a, kc, b, p * NC, c + p * NC * 8, s, rescale, ldc, first);
}

// rows × kc bf16 values (kc a multiple of 32, the padding included) to fp32 rows of stride kc.
void rows_to_f32(int rows, const bf16* A, int64_t lda, int kc, float* out) {
  for (int m = 0; m < rows; ++m)
    for (int k = 0; k < kc; k += 8)
      _mm256_storeu_ps(out + m * kc + k,
                       bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(A + m * lda + k))));
}

// The scales of the chunk at K offset k0 (null for bf16).
inline const float* chunk_scales(const float* s, int group, int k0) { return s ? s + (k0 / group) * kBlockN : nullptr; }

// 4 rows × 16 columns is the widest FMA-to-conversion ratio the registers allow (16 FMAs per 2 shifts + 2 ANDs
// per K pair); 1-3 leftover rows take wider column passes, one row all 64 columns in one pass.
template <class D>
void gemm_rows(int M, const bf16* A, int64_t lda, const uint8_t* block, const float* scales, int group, int kp,
               float* C, int64_t ldc) {
  alignas(32) float buf[4 * kKC];
  for (int k0 = 0; k0 < kp; k0 += kKC) {
    const int kc = std::min(kKC, kp - k0);
    const uint8_t* b = block + static_cast<int64_t>(k0 / 2) * D::kRowBytes;
    const float* s = chunk_scales(scales, group, k0);
    for (int m0 = 0; m0 < M; m0 += 4) {
      const int mr = std::min(4, M - m0);
      rows_to_f32(mr, A + m0 * lda + k0, lda, kc, buf);
      const float rescale = D::kExponentShift ? prescale_rows(mr * kc, buf, D::kExponentShift) : 1.f;
      float* c = C + m0 * ldc;
      const bool first = k0 == 0;
      switch (mr) {
        case 4: gemm_chunk<D, 4, 2>(buf, kc, b, c, s, rescale, ldc, first); break;
        case 3: gemm_chunk<D, 3, 2>(buf, kc, b, c, s, rescale, ldc, first); break;
        case 2: gemm_chunk<D, 2, 4>(buf, kc, b, c, s, rescale, ldc, first); break;
        default: gemm_chunk<D, 1, 8>(buf, kc, b, c, s, rescale, ldc, first); break;
      }
    }
  }
}

inline const uint8_t* bytes(const bf16* p) { return reinterpret_cast<const uint8_t*>(p); }

void gemm_block_avx2(int M, const bf16* A, int64_t lda, const bf16* block, int kp, float* C, int64_t ldc) {
  gemm_rows<Bf16Row>(M, A, lda, bytes(block), nullptr, kp, kp, C, ldc);
}

// The pair contract (Kernels::gemm_block_pair) is met one block after the other (see kKC).
void gemm_block_pair_avx2(int M, const bf16* A0, const bf16* A1, int64_t lda, const bf16* block0, const bf16* block1,
                          int kp, float* C0, float* C1, int64_t ldc) {
  gemm_block_avx2(M, A0, lda, block0, kp, C0, ldc);
  gemm_block_avx2(M, A1, lda, block1, kp, C1, ldc);
}

// Integer formats (int8, int4): weights decoded to int16 in registers, input rows quantized to int16 once per call
// (Kernels::quantize_rows), vpmaddwd + vpaddd sum the products exactly in int32; per chunk of K (int_chunk) and column
// C (+)= s_x · (s_w · Σ q_x q_w + min_w · Σ q_x), as the AVX512 table does.
// load(row, v) gives what the tiles multiply for column group v: kDotUnit[v]⁻¹ · its values.
// kPrefetchAhead: how far ahead (bytes) the one-row and first column passes prefetch. MoE decode (E=64 top-8,
// H 2048, I 768, from DRAM, 2-core Zen 2 VM, processes alternated): int8 T=1 1.68 -> 1.43 ms and T=8 9.4 ->
// 7.7 ms at 512 bytes (384-768 the same) against the next 16 KiB chunk's row as before (1.5-4 KiB: 1.56-1.71);
// int4 best from 3 to 6 KiB (0.83-0.86 ms; 1 KiB 0.89, 512 bytes 0.95, none 1.05). On a Zen 3 (Milan) VM, int4
// T=1 with calls interleaved in one process: 2-16 KiB and the T0/T1/T2 hints within 6% of each other, none 10% slower.
struct Int8W {  // column group v: 16 bytes (8 columns × the K pair) sign-extended
  static constexpr int kRowBytes = 128;
  static constexpr int kPrefetchAhead = 512;
  static constexpr bool kOffsets = false;
  static constexpr float kDotUnit[8] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
  static __m256i load(const uint8_t* row, int v) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v)));
  }
};
struct Int4W {  // column group v: nibble v / 2 of words 16 (v % 2) ..
  static constexpr int kRowBytes = 64;
  static constexpr int kPrefetchAhead = 4096;
  static constexpr bool kOffsets = true;
  // As in the AVX512 table, nibble 1 is multiplied where it lies (16 · code; int_chunk keeps the int32 sums in
  // range) and nibble 3 needs no mask: 5 instructions per 32 bytes instead of 7 beside the 4 vpmaddwd, which
  // Zen 2 runs on one port. With the accumulators kept in registers (CMakeLists.txt: -fno-tree-pre), MoE T=1
  // with the weights in L3 (H 1024, I 256, 8 experts, Zen 2, one thread) went 0.216 -> 0.182 ms; from DRAM
  // (E=64, H 2048, I 768, two threads) T=1 and T=8 ran as fast as before or slightly faster, bound there by the
  // memory path (bf16 and int4 experts stream at the same bytes per second).
  static constexpr float kDotUnit[8] = {1.f, 1.f, 1.f / 16, 1.f / 16, 1.f, 1.f, 1.f, 1.f};
  static __m256i load(const uint8_t* row, int v) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * (v % 2)));
    switch (v / 2) {
      case 0: return _mm256_and_si256(w, _mm256_set1_epi16(0xf));
      case 1: return _mm256_and_si256(w, _mm256_set1_epi16(0xf0));
      case 2: return _mm256_and_si256(_mm256_srli_epi16(w, 8), _mm256_set1_epi16(0xf));
      default: return _mm256_srli_epi16(w, 12);
    }
  }
};

// MR rows × NC column groups (V0 ..) of one K chunk [k0, k1); the weights of a chunk stay in L1 across passes.
// V0 is a template argument so that each column group's decode (Int4W::load) is fixed at compile time.
template <class D, int MR, int NC, int V0>
inline void igemm_pass(const kt::Int16Rows& X, const kt::Layout& l, kt::Block b, int k0, int k1, float* C,
                       int64_t ldc) {
  __m256i acc[MR][NC];
  KT_UNROLL
  for (int m = 0; m < MR; ++m)
    KT_UNROLL
    for (int v = 0; v < NC; ++v) acc[m][v] = _mm256_setzero_si256();
  for (int kk = k0 / 2; kk < k1 / 2; ++kk) {
    const uint8_t* row = b.w + static_cast<int64_t>(kk) * D::kRowBytes;
    if (V0 == 0)  // the first pass brings a row further on towards L1
      for (int q = 0; q < D::kRowBytes; q += 64)  // the builtin: an asm statement here spilled the accumulators
        _mm_prefetch(reinterpret_cast<const char*>(row + D::kPrefetchAhead + q), _MM_HINT_T0);
    __m256i a[MR];
    KT_UNROLL
    for (int m = 0; m < MR; ++m) a[m] = _mm256_set1_epi32(X.pair(m, kk));
    KT_UNROLL
    for (int v = 0; v < NC; ++v) {
      const __m256i w = D::load(row, V0 + v);
      KT_UNROLL
      for (int m = 0; m < MR; ++m) acc[m][v] = _mm256_add_epi32(acc[m][v], _mm256_madd_epi16(a[m], w));
    }
  }
  __m256i sums[MR][NC];
  spill_sums(acc, sums);
  const int g = k0 / l.group;
  for (int m = 0; m < MR; ++m) {
    const __m256 xsum = _mm256_set1_ps(D::kOffsets ? X.scale[m] * X.sum(m, k0, k1) : 0.f);
    for (int v = 0; v < NC; ++v) {
      // int8: fp32 scales; int4: scale words, bf16 scale in the low half and minimum in the high half
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.s + g * kt::Layout::kScaleWords + 8 * (V0 + v)));
      const __m256 s = _mm256_castsi256_ps(D::kOffsets ? _mm256_slli_epi32(raw, 16) : raw);
      const __m256 sx = _mm256_set1_ps(X.scale[m] * D::kDotUnit[V0 + v]);  // exact: a power of two
      __m256 r = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[m][v]), _mm256_mul_ps(s, sx));
      if (D::kOffsets)
        r = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u)))), xsum, r);
      float* c = C + m * ldc + 8 * (V0 + v);
      _mm256_storeu_ps(c, k0 == 0 ? r : _mm256_add_ps(r, _mm256_loadu_ps(c)));
    }
  }
}

template <class D, int MR, int NC, int V0 = 0>
inline void igemm_passes(const kt::Int16Rows& X, const kt::Layout& l, kt::Block b, int k0, int k1, float* C, int64_t ldc) {
  igemm_pass<D, MR, NC, V0>(X, l, b, k0, k1, C, ldc);
  if constexpr (V0 + NC < 8) igemm_passes<D, MR, NC, V0 + NC>(X, l, b, k0, k1, C, ldc);
}

template <class D, int MR, int NC>
void igemm_tile(const kt::Int16Rows& X, const kt::Layout& l, kt::Block b, float* C, int64_t ldc) {
  const int chunk = int_chunk(l);
  for (int k0 = 0; k0 < l.kp; k0 += chunk) igemm_passes<D, MR, NC>(X, l, b, k0, std::min(k0 + chunk, l.kp), C, ldc);
}

// Tiles of up to 4 rows; the fewer the rows, the more column groups a pass holds (16 ymm registers).
template <class D>
void igemm_rows(int M, const bf16* A, int64_t lda, const kt::Int16Rows* Xq, const kt::Layout& l, kt::Block b,
                float* C, int64_t ldc) {
  const kt::Int16Rows X = rows_or_quantize(Xq, 0, M, A, lda, l.kp);
  for (int m0 = 0; m0 < M; m0 += 4) {
    const kt::Int16Rows Xm = X.from(m0);
    float* Cm = C + m0 * ldc;
    switch (std::min(4, M - m0)) {
      case 4: igemm_tile<D, 4, 2>(Xm, l, b, Cm, ldc); break;
      case 3: igemm_tile<D, 3, 2>(Xm, l, b, Cm, ldc); break;
      case 2: igemm_tile<D, 2, 4>(Xm, l, b, Cm, ldc); break;
      default: igemm_tile<D, 1, 8>(Xm, l, b, Cm, ldc); break;
    }
  }
}

void qgemm_block_avx2(int M, const bf16* A, int64_t lda, const kt::Int16Rows* X, const kt::Layout& l, kt::Block b,
                      float* C, int64_t ldc) {
  switch (l.fmt) {
    case kt::Format::int8: return igemm_rows<Int8W>(M, A, lda, X, l, b, C, ldc);
    case kt::Format::int4: return igemm_rows<Int4W>(M, A, lda, X, l, b, C, ldc);
    case kt::Format::fp8: return gemm_rows<Fp8Row>(M, A, lda, b.w, b.s, l.group, l.kp, C, ldc);
    case kt::Format::bf16: return gemm_rows<Bf16Row>(M, A, lda, b.w, nullptr, l.kp, l.kp, C, ldc);
  }
}

void qgemm_block_pair_avx2(int M, const bf16* A0, const bf16* A1, int64_t lda, const kt::Int16Rows* X0,
                           const kt::Int16Rows* X1, const kt::Layout& l, kt::Block b0, kt::Block b1, float* C0,
                           float* C1, int64_t ldc) {
  qgemm_block_avx2(M, A0, lda, X0, l, b0, C0, ldc);
  qgemm_block_avx2(M, A1, lda, X1, l, b1, C1, ldc);
}

// ------------------------------------------------------------------------------------------------ LoRA

// T[m][j] = Σ_k X[m][k] A[j][k]: four A rows at a time share each load of X (a rank not a multiple of 4 repeats
// its last row in the spare lanes, results dropped).
template <typename TX>
void lora_a_avx2(int M, const TX* X, int64_t ldx, const bf16* A, int r, int K, float* T, int64_t ldt) {
  for (int m = 0; m < M; ++m) {
    const TX* x = X + m * ldx;
    for (int j = 0; j < r; j += 4) {
      const bf16* ar[4];
      for (int q = 0; q < 4; ++q) ar[q] = A + static_cast<int64_t>(std::min(j + q, r - 1)) * K;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      auto step = [&](int k, int n) {
        const __m256 xv = load8(x + k, n);
        for (int q = 0; q < 4; ++q) acc[q] = _mm256_fmadd_ps(xv, load8(ar[q] + k, n), acc[q]);
      };
      int k = 0;
      for (; k + 8 <= K; k += 8) step(k, 8);
      if (k < K) step(k, K - k);
      for (int q = 0; q < 4 && j + q < r; ++q) T[m * ldt + j + q] = hsum(acc[q]);
    }
  }
}

void lora_a_bf16_avx2(int M, const bf16* X, int64_t ldx, const bf16* A, int r, int K, float* T, int64_t ldt) {
  lora_a_avx2<bf16>(M, X, ldx, A, r, K, T, ldt);
}
void lora_a_f32_avx2(int M, const float* X, int64_t ldx, const bf16* A, int r, int K, float* T, int64_t ldt) {
  lora_a_avx2<float>(M, X, ldx, A, r, K, T, ldt);
}

// NG groups of 8 columns of one output row (n columns valid): c += Σ_j (s·t[j]) · BT[j] in j order, as the
// reference does. A full 64-column tile keeps 8 independent FMA chains in flight.
template <int NG>
inline void lora_b_cols(int r, const float* t, float s, const bf16* BT, int64_t ldb, int n, float* c) {
  __m256 acc[NG];
  for (int g = 0; g < NG; ++g) acc[g] = load8(c + 8 * g, n - 8 * g);
  for (int j = 0; j < r; ++j) {
    const __m256 tv = _mm256_set1_ps(s * t[j]);
    for (int g = 0; g < NG; ++g) acc[g] = _mm256_fmadd_ps(tv, load8(BT + j * ldb + 8 * g, n - 8 * g), acc[g]);
  }
  for (int g = 0; g < NG; ++g) store8(c + 8 * g, acc[g], n - 8 * g);
}

void lora_b_add_avx2(int M, const float* T, int64_t ldt, int r, const bf16* BT, int64_t ldb, int nc, float s, float* C,
                     int64_t ldc) {
  for (int m = 0; m < M; ++m) {
    int c0 = 0;
    for (; c0 + 64 <= nc; c0 += 64) lora_b_cols<8>(r, T + m * ldt, s, BT + c0, ldb, 64, C + m * ldc + c0);
    for (; c0 < nc; c0 += 8) lora_b_cols<1>(r, T + m * ldt, s, BT + c0, ldb, nc - c0, C + m * ldc + c0);
  }
}

// JR rows of G × NG groups of 8 columns (n valid): G[j] += Σ_m (s·Q[m][j]) · X[m] in m order, as the reference
// does; each converted X vector feeds JR FMAs.
template <int JR, int NG, typename TX>
inline void outer_cols(int M, const float* Q, int64_t ldq, const TX* X, int64_t ldx, int n, float s, float* G,
                       int64_t ldg) {
  __m256 acc[JR][NG];
  for (int j = 0; j < JR; ++j)
    for (int g = 0; g < NG; ++g) acc[j][g] = load8(G + j * ldg + 8 * g, n - 8 * g);
  for (int m = 0; m < M; ++m) {
    __m256 xv[NG];
    for (int g = 0; g < NG; ++g) xv[g] = load8(X + m * ldx + 8 * g, n - 8 * g);
    for (int j = 0; j < JR; ++j) {
      const __m256 q = _mm256_set1_ps(s * Q[m * ldq + j]);
      for (int g = 0; g < NG; ++g) acc[j][g] = _mm256_fmadd_ps(q, xv[g], acc[j][g]);
    }
  }
  for (int j = 0; j < JR; ++j)
    for (int g = 0; g < NG; ++g) store8(G + j * ldg + 8 * g, acc[j][g], n - 8 * g);
}

template <int JR, typename TX>
inline void outer_rows(int M, const float* Q, int64_t ldq, const TX* X, int64_t ldx, int nk, float s, float* G,
                       int64_t ldg) {
  int k = 0;
  for (; k + 32 <= nk; k += 32) outer_cols<JR, 4>(M, Q, ldq, X + k, ldx, 32, s, G + k, ldg);
  for (; k < nk; k += 8) outer_cols<JR, 1>(M, Q, ldq, X + k, ldx, nk - k, s, G + k, ldg);
}

template <typename TX>
void outer_acc_avx2(int M, const float* Q, int64_t ldq, int r, const TX* X, int64_t ldx, int nk, float s, float* G,
                    int64_t ldg) {
  int j = 0;
  for (; j + 2 <= r; j += 2) outer_rows<2>(M, Q + j, ldq, X, ldx, nk, s, G + j * ldg, ldg);
  if (j < r) outer_rows<1>(M, Q + j, ldq, X, ldx, nk, s, G + j * ldg, ldg);
}

void outer_acc_bf16_avx2(int M, const float* Q, int64_t ldq, int r, const bf16* X, int64_t ldx, int nk, float s,
                         float* G, int64_t ldg) {
  outer_acc_avx2<bf16>(M, Q, ldq, r, X, ldx, nk, s, G, ldg);
}
void outer_acc_f32_avx2(int M, const float* Q, int64_t ldq, int r, const float* X, int64_t ldx, int nk, float s,
                        float* G, int64_t ldg) {
  outer_acc_avx2<float>(M, Q, ldq, r, X, ldx, nk, s, G, ldg);
}

// ------------------------------------------------------------------------------------------------ SwiGLU

// e^x as the AVX-512 table computes it (same clamp, reduction and polynomial; rel. error ~2e-7). 2^n is built
// in the exponent field: n in [-126, 127] after the clamp, always a normal float.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 sigmoid256(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

void swiglu_avx2(int n, const float* g, const float* u, bf16* h) {
  for (int c = 0; c < n; c += 8) {
    const __m256 gv = load8(g + c, n - c), uv = load8(u + c, n - c);
    store_bf16x8(h + c, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid256(gv)), uv), n - c);
  }
}

float swiglu_backward_avx2(int n, float w, const float* q, const bf16* h, float* g, float* u, bf16* dg16, bf16* du16) {
  __m256 dot = _mm256_setzero_ps();
  const __m256 wv = _mm256_set1_ps(w), one = _mm256_set1_ps(1.f);
  for (int c = 0; c < n; c += 8) {
    const int left = n - c;
    const __m256 qv = load8(q + c, left), gv = load8(g + c, left), uv = load8(u + c, left);
    dot = _mm256_fmadd_ps(qv, load8(h + c, left), dot);
    const __m256 dh = _mm256_mul_ps(wv, qv), sg = sigmoid256(gv), silu = _mm256_mul_ps(gv, sg);
    const __m256 du = _mm256_mul_ps(dh, silu);
    const __m256 dsilu = _mm256_mul_ps(sg, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, sg), one));
    const __m256 dg = _mm256_mul_ps(_mm256_mul_ps(dh, uv), dsilu);
    store8(g + c, dg, left);
    store8(u + c, du, left);
    store_bf16x8(dg16 + c, dg, left);
    store_bf16x8(du16 + c, du, left);
  }
  return hsum(dot);
}

// ------------------------------------------------------------------------------------------------ attention

float exp_shifted_avx2(int n, float* x, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < n; j += 8) {
    const int left = n - j;
    // lanes past n load as 0 and would add e^-m: mask them out of the sum
    __m256 e = exp256(_mm256_sub_ps(load8(x + j, left), mv));
    if (left < 8) e = _mm256_and_ps(e, _mm256_castsi256_ps(tail_mask(left)));
    sum = _mm256_add_ps(sum, e);
    store8(x + j, e, left);
  }
  return hsum(sum);
}

}  // namespace

namespace kt {

const Kernels* kernels_avx2() {
  static const Kernels k{"avx2",             gemm_block_avx2,     gemm_block_pair_avx2, lora_a_bf16_avx2,
                         lora_a_f32_avx2,    lora_b_add_avx2,     outer_acc_bf16_avx2,  outer_acc_f32_avx2,
                         swiglu_avx2,        swiglu_backward_avx2, qgemm_block_avx2,
                         qgemm_block_pair_avx2, decode_rows_generic, decode_transposed_generic<decode_rows_generic>, quantize_rows_generic, gemm_block_scaled_generic<gemm_block_avx2>, kNeverDecode,
                         attn_scores_generic, exp_shifted_avx2, attn_values_generic,
                         gdn_scan_columns_generic};
  return &k;
}

}  // namespace kt
