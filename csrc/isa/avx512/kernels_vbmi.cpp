// The fp8 row decoders for AVX512 CPUs with VBMI (Ice Lake, Sapphire Rapids, Zen 4), two of them:
// - lookup (Fp8RowVbmi): two 128-entry byte lookups (vpermi2b) give each e4m3 magnitude's bf16 high and low
//   bytes, the sign is OR-ed into the high byte, and two cross-lane byte permutes interleave them into words: five
//   instructions per 64 weights, against about twenty for the shift decoder (isa/avx512/quant.inc's Fp8Row),
//   so on Zen 4 fp8 decode streams weights as fast as int8.
// - lanes (Fp8RowLanes): the bf16 bytes of normal codes by shifts and an add, a one-source lookup (vpermb) only
//   for the codes with exponent 0 (zeros, subnormals), in-lane unpacks into words; columns then sit in the
//   accumulators in another order, put back once per scale group (unpermute). It takes no NaN codes (0x7f /
//   0xff): PackedWeights::pack_fp8 refuses them. For Intel, whose two-source byte permutes are slow: on a
//   2-core Sapphire Rapids-class Xeon VM, one core ran the pair microkernel at 7.3 ns per 128-byte row with the
//   lookup decoder, 5.8 ns with this one and 3.7 ns with no decode at all; MoE decode at T=1 with every expert
//   in L3 ran 1.15x faster (1.10 against 1.28 ms), from DRAM 1.3x with the prefetch below.
// Built with the AVX512-BF16 table's flags plus -mavx512vbmi; only called after cpu_has_avx512_vbmi() said yes.
#include <immintrin.h>

#include <array>

#include "isa/generic.inc"
#include "isa/avx512/quant.inc"
#include "common/prefetch.h"

namespace {

// bf16 bits of the e4m3 magnitude code c (< 128): normal values move their exponent from bias 7 to bias 127;
// subnormals m · 2^-9 are renormalised; 0x7f (NaN) stays NaN.
constexpr uint16_t e4m3_bf16_bits(int c) {
  const int e = c >> 3, m = c & 7;
  if (c == 0x7f) return 0x7fc0;
  if (e > 0) return static_cast<uint16_t>(((e + 120) << 7) | (m << 4));
  if (m == 0) return 0;
  const int p = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // m = 2^p · (1 + f)
  return static_cast<uint16_t>(((118 + p) << 7) | ((m - (1 << p)) << (7 - p)));
}

struct Tables {
  alignas(64) std::array<uint8_t, 128> lo{}, hi{};
  alignas(64) std::array<uint8_t, 64> ilv0{}, ilv1{};  // byte j of words [0, 32) / [32, 64): lo[i] or 64 + hi[i]
};

constexpr Tables make_tables() {
  Tables t;
  for (int c = 0; c < 128; ++c) {
    t.lo[c] = static_cast<uint8_t>(e4m3_bf16_bits(c) & 0xff);
    t.hi[c] = static_cast<uint8_t>(e4m3_bf16_bits(c) >> 8);
  }
  for (int i = 0; i < 32; ++i) {
    t.ilv0[2 * i] = static_cast<uint8_t>(i), t.ilv0[2 * i + 1] = static_cast<uint8_t>(64 + i);
    t.ilv1[2 * i] = static_cast<uint8_t>(32 + i), t.ilv1[2 * i + 1] = static_cast<uint8_t>(96 + i);
  }
  return t;
}

constexpr Tables kTables = make_tables();  // constant data: no initialiser runs on CPUs without these instructions

struct Fp8RowVbmi {
  static constexpr int kRowBytes = 128;
  static constexpr bool kLaneOrder = false;
  static void load(const uint8_t* row, __m512bh (&w)[4]) {
    const __m512i lo0 = _mm512_load_si512(kTables.lo.data()), lo1 = _mm512_load_si512(kTables.lo.data() + 64);
    const __m512i hi0 = _mm512_load_si512(kTables.hi.data()), hi1 = _mm512_load_si512(kTables.hi.data() + 64);
    const __m512i ilv0 = _mm512_load_si512(kTables.ilv0.data()), ilv1 = _mm512_load_si512(kTables.ilv1.data());
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int h = 0; h < 2; ++h) {
      const __m512i b = _mm512_loadu_si512(row + 64 * h);
      const __m512i lo = _mm512_permutex2var_epi8(lo0, b, lo1);  // index bits 0-6: the magnitude; bit 7 ignored
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, b, hi1), b, sign, 0xf8);  // | b & 0x80
      w[2 * h] = (__m512bh)_mm512_permutex2var_epi8(lo, ilv0, hi);
      w[2 * h + 1] = (__m512bh)_mm512_permutex2var_epi8(lo, ilv1, hi);
    }
  }
};

// Per 64 bytes: the 32 bytes of each 128-bit lane in order (value i = 16·lane + t) become words
// {0-7, 16-23, 32-39, 48-55} (unpacklo) and {8-15, 24-31, 40-47, 56-63} (unpackhi), so vector 2h holds columns
// {0-3, 8-11, 16-19, 24-27} + 32h and vector 2h + 1 the other 16 of that half.
struct Fp8RowLanes {
  static constexpr int kRowBytes = 128;
  static constexpr bool kLaneOrder = true;
  // Rows are prefetched into L1 2 KiB ahead: with as many instructions per byte as this decode takes, too few
  // loads are in flight for the hardware prefetchers (MoE decode T=1 from DRAM: 2.21 -> 1.65-1.70 ms; 1-4 KiB
  // within 4%; into L2 8 KiB ahead 1.81 ms; int8's rows gained nothing from the same).
  static constexpr int kPrefetchAhead = 2048;
  static void load(const uint8_t* row, __m512bh (&w)[4]) {
    const __m512i lo_special = _mm512_load_si512(kTables.lo.data());
    const __m512i hi_special = _mm512_load_si512(kTables.hi.data());
    const __m512i low4 = _mm512_set1_epi8(static_cast<char>(0xf0)), exp3 = _mm512_set1_epi8(7);
    const __m512i bias = _mm512_set1_epi8(60), sign = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i exp_bits = _mm512_set1_epi8(0x78);
    kt::prefetch_l1(row + kPrefetchAhead);  // the row's two lines, kPrefetchAhead bytes on
    kt::prefetch_l1(row + kPrefetchAhead + 64);
    for (int h = 0; h < 2; ++h) {
      const __m512i b = _mm512_loadu_si512(row + 64 * h);
      // normal codes: bf16 exponent e + 120 (bias 7 -> 127), split over the bytes as (e & 1) << 7 | m << 4 and
      // 60 + (e >> 1) (120 is even)
      __m512i lo = _mm512_and_si512(_mm512_slli_epi16(b, 4), low4);
      __m512i hi = _mm512_add_epi8(_mm512_and_si512(_mm512_srli_epi16(b, 4), exp3), bias);
      // exponent 0 (zero, subnormals): vpermb reads the low 6 bits, m for these codes, so entries 0-7 of the tables
      const __mmask64 e0 = _mm512_testn_epi8_mask(b, exp_bits);
      lo = _mm512_mask_permutexvar_epi8(lo, e0, b, lo_special);
      hi = _mm512_mask_permutexvar_epi8(hi, e0, b, hi_special);
      hi = _mm512_ternarylogic_epi32(hi, b, sign, 0xf8);  // | b & 0x80
      w[2 * h] = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
      w[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
    }
  }
  // acc[2h] lanes 4j..4j+3 hold columns 8j..8j+3 of half h, acc[2h + 1] columns 8j+4..8j+7: back to columns in order
  static void unpermute(__m512 (&acc)[4]) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int h = 0; h < 2; ++h) {
      const __m512 a = acc[2 * h], b = acc[2 * h + 1];
      acc[2 * h] = _mm512_permutex2var_ps(a, first, b);
      acc[2 * h + 1] = _mm512_permutex2var_ps(a, second, b);
    }
  }
};

}  // namespace

namespace kt {

bool kernels_avx512_vbmi_built() { return true; }

void qgemm_fp8_vbmi(bool lanes, int M, const bf16* A, int64_t lda, const Layout& l, Block b, float* C,
                    int64_t ldc) {
  if (lanes) return qgemm_rows<Fp8RowLanes>(M, A, lda, l, b, C, ldc);
  qgemm_rows<Fp8RowVbmi>(M, A, lda, l, b, C, ldc);
}

void qgemm_pair_fp8_vbmi(bool lanes, int M, const bf16* A0, const bf16* A1, int64_t lda, const Layout& l, Block b0,
                         Block b1, float* C0, float* C1, int64_t ldc) {
  if (lanes) return qgemm_pair_rows<Fp8RowLanes>(M, A0, A1, lda, l, b0, b1, C0, C1, ldc);
  qgemm_pair_rows<Fp8RowVbmi>(M, A0, A1, lda, l, b0, b1, C0, C1, ldc);
}

void decode_fp8_vbmi(const uint8_t* w, int kk0, int kk1, bf16* out) { decode_float_rows<Fp8RowVbmi>(w, kk0, kk1, out); }

}  // namespace kt
