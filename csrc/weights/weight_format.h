// Weight formats of the packed experts. Every format keeps isa/kernels.h's block layout: a matrix W [N, K] is cut
// into blocks of 64 output columns, K padded to kp (a multiple of 32) and walked in pairs; within one K pair
// ("row" of a block) the 128 values are numbered i = 2c + j (column c, K offset j), the order vdpbf16ps reads.
// What a format changes is how the 128 values of a row are stored, and whether they carry scales:
//
//   bf16  value i as bf16 at bytes [2i, 2i + 2)                                          256 bytes a row
//   int8  value i as int8 at byte i; W = q · s[c], one scale per output column (per row of W)    128 bytes
//   fp8   value i as e4m3 (OCP "fn": bias 7, no infinities, 448 max) at byte i;              128 bytes
//         W = q · s[g][c], one scale per (K group g, column): the checkpoint's block scale of that element
//   int4  value i = 32·v + l (v < 4, l < 32) as a code q in [0, 15] in bits [4v, 4v + 4) of the little-endian
//         16-bit word l; W = q · s[g][c] + min[g][c] (asymmetric: the group's range mapped onto 16 steps), s and
//         min bf16                                                                            64 bytes a row
//
// So one 64-byte load of an int4 row yields four 32-value vectors by shift-and-mask alone. Scales are 32-bit words
// per block, [ngroups][64], group g covering K values [g·group, (g + 1)·group) (int8 has one group, group = kp):
// fp32 scales, but for int4 two bf16 in each, the scale in the low half and the minimum in the high half: as fp32
// pairs they were 1/9 of int4's bytes at group 128, and MoE decode streams bytes (E=64 top-8, T=1, from DRAM,
// 2-core Sapphire Rapids-class VM, processes alternated: 0.95-0.99 -> 0.88-0.92 ms at best, medians 4% down).
// How values are quantized is in weights/packed_weights.cpp (and restated by tests/test_kernel_formats.py).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace kt {

enum class Format : int { bf16 = 0, int8 = 1, int4 = 2, fp8 = 3 };

const char* format_name(Format f);
Format parse_format(const std::string& name);  // "bf16", "int8", "int4", "fp8"; anything else throws

// The shape of one packed 64-column block.
struct Layout {
  Format fmt = Format::bf16;
  int kp = 0;     // K padded to 32
  int group = 0;  // K values per scale group (bf16, int8: kp)

  bool integer() const { return fmt == Format::int8 || fmt == Format::int4; }
  int ngroups() const { return group > 0 ? (kp + group - 1) / group : 0; }
  int row_bytes() const { return fmt == Format::bf16 ? 256 : fmt == Format::int4 ? 64 : 128; }
  size_t block_bytes() const { return static_cast<size_t>(kp / 2) * row_bytes(); }
  static constexpr int kScaleWords = 64;  // scale words of one group: one a column
  size_t block_scales() const { return fmt == Format::bf16 ? 0 : static_cast<size_t>(ngroups()) * kScaleWords; }
};

// One packed block: its rows, and its scales (null for bf16).
struct Block {
  const uint8_t* w = nullptr;
  const float* s = nullptr;
};

// ---------------------------------------------------------------------------------------------- scalar codecs

// e4m3 (fn) -> fp32, exact. e = 0 encodes m · 2^-9 (subnormal); 0x7f / 0xff are NaN.
inline float e4m3_to_f32(uint8_t b) {
  const int e = (b >> 3) & 0xf, m = b & 7;
  float v;
  if ((b & 0x7f) == 0x7f)
    v = NAN;
  else
    v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  return (b & 0x80) ? -v : v;
}

// fp32 -> e4m3 (fn), round to nearest even, saturating at ±448 (what quantizers do before casting).
inline uint8_t f32_to_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  float a = std::fabs(x);
  if (!(a < 448.f)) return sign | 0x7e;  // also NaN -> the largest value: weights are finite
  if (a < std::ldexp(1.f, -6)) return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, 9)));  // 8 -> 0x08
  int ex;
  std::frexp(a, &ex);  // a = f · 2^ex, f in [0.5, 1)
  const int e = ex - 1;
  int m = static_cast<int>(std::nearbyint((std::ldexp(a, -e) - 1.f) * 8.f));
  int code = ((e + 7) << 3) + m;  // m = 8 carries into the exponent
  if (code > 0x7e) code = 0x7e;
  return sign | static_cast<uint8_t>(code);
}

// The unscaled value i (< 128) of row kk of a block, as fp32 (exact for every format).
inline float block_value(const Layout& l, const uint8_t* block, int kk, int i) {
  const uint8_t* row = block + static_cast<size_t>(kk) * l.row_bytes();
  switch (l.fmt) {
    case Format::bf16: {
      uint16_t v;
      std::memcpy(&v, row + 2 * i, 2);
      const uint32_t u = static_cast<uint32_t>(v) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    case Format::int8: return static_cast<float>(static_cast<int8_t>(row[i]));
    case Format::fp8: return e4m3_to_f32(row[i]);
    case Format::int4: {
      const int v = i / 32, lane = i % 32;
      const int word = row[2 * lane] | (row[2 * lane + 1] << 8);
      return static_cast<float>((word >> (4 * v)) & 0xf);
    }
  }
  return 0.f;
}

// int4's scale word of a column and group: its bf16 scale (low half) and minimum (high half), and back.
inline uint32_t int4_scale_word(uint16_t scale_bf16, uint16_t min_bf16) {
  return static_cast<uint32_t>(scale_bf16) | static_cast<uint32_t>(min_bf16) << 16;
}
inline uint32_t int4_word_bits(const float* word) {
  uint32_t u;
  std::memcpy(&u, word, 4);
  return u;
}
inline float f32_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float int4_scale(const float* word) { return f32_of_bits(int4_word_bits(word) << 16); }
inline float int4_min(const float* word) { return f32_of_bits(int4_word_bits(word) & 0xffff0000u); }

// Scale and offset of value i of a row in group g: W = value · scale + offset (offset 0 but for int4).
inline float block_scale(const Layout& l, const Block& b, int g, int i) {
  const float* word = b.s + g * Layout::kScaleWords + i / 2;
  return l.fmt == Format::bf16 ? 1.f : l.fmt == Format::int4 ? int4_scale(word) : *word;
}
inline float block_offset(const Layout& l, const Block& b, int g, int i) {
  return l.fmt == Format::int4 ? int4_min(b.s + g * Layout::kScaleWords + i / 2) : 0.f;
}

}  // namespace kt
