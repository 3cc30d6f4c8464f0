// The fp8 row decoder for AVX512 CPUs with VBMI (Ice Lake, Sapphire Rapids, Zen 4): two 128-entry byte lookups
// (vpermi2b) give each e4m3 magnitude's bf16 high and low bytes, the sign is OR-ed into the high byte, and two
// cross-lane byte permutes interleave them into words: five instructions per 64 weights, against about twenty
// for the shift decoder (kernels_avx512_quant.inc's Fp8Row), so fp8 decode streams weights as fast as int8.
// Built with the AVX512-BF16 table's flags plus -mavx512vbmi; only called after cpu_has_avx512_vbmi() said yes.
#include <immintrin.h>

#include <array>

#include "kernels_generic.inc"
#include "kernels_avx512_quant.inc"

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

}  // namespace

namespace kt {

bool kernels_avx512_vbmi_built() { return true; }

void qgemm_fp8_vbmi(int M, const bf16* A, int64_t lda, const Layout& l, Block b, float* C, int64_t ldc) {
  qgemm_rows<Fp8RowVbmi>(M, A, lda, l, b, C, ldc);
}

void qgemm_pair_fp8_vbmi(int M, const bf16* A0, const bf16* A1, int64_t lda, const Layout& l, Block b0, Block b1,
                         float* C0, float* C1, int64_t ldc) {
  qgemm_pair_rows<Fp8RowVbmi>(M, A0, A1, lda, l, b0, b1, C0, C1, ldc);
}

void decode_fp8_vbmi(const uint8_t* w, int kk0, int kk1, bf16* out) { decode_float_rows<Fp8RowVbmi>(w, kk0, kk1, out); }

}  // namespace kt
