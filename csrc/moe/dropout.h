// LoRA dropout on the expert LoRA inputs, PEFT semantics: the LoRA path of a projection sees
// dropout(v) = v ⊙ m / (1 - p), the base path the undropped v; gate, up and down each have their own mask.
//
// The keep mask is a pure function of (seed, proj, row, c) and is never stored: the backward regenerates it
// from the forward's seed. Nothing else enters (ISA, thread count, grouping of pairs), so runs are
// reproducible and a resumed training run is exact. Exactly (all arithmetic on uint64, mod 2^64):
//   proj   0 = gate (v = x_t, c < H), 1 = up (v = x_t, c < H), 2 = down (v = h of the pair, c < I)
//   row    t * k + j for the routed pair (token t, top-k column j)
//   mix(z) = splitmix64 finaliser: z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
//                                  z *= 0x94D049BB133111EB; z ^= z >> 31
//   G      = 0x9E3779B97F4A7C15
//   key    = mix(seed + (proj + 1) * G)
//   rowkey = mix(key + (row + 1) * G)
//   word   = mix(rowkey + ((c >> 2) + 1) * G)         one hash serves 4 consecutive columns
//   lane   = (word >> (16 * (c & 3))) & 0xFFFF
//   keep   = lane >= thr,  thr = min(65535, floor(p * 65536 + 0.5))   so P(drop) = thr / 65536 ≈ p
//   scale  = 1 / (1 - p) for kept elements (0 for dropped ones)
// i.e. splitmix64 streams: one per (seed, proj) over the rows, whose outputs seed one stream per row over
// blocks of 4 columns; one 64-bit multiply-mix per 4 elements.
#pragma once
#include <cstdint>
#include <cstring>

#include "isa/kernels.h"

namespace kt {

struct Dropout {
  double p = 0.0;  // 0 <= p < 1; 0 = off
  uint64_t seed = 0;
  bool on() const { return p > 0.0; }
};

// The mask of one projection.
class DropoutMask {
 public:
  DropoutMask(const Dropout& d, int proj);

  // fn(i, f) for i < n, with f = scale when column c0 + i of row r is kept, else 0. Per span of columns: the
  // hashes, then their lanes read as the words' 16-bit pieces in memory order (little endian: lane l of word q
  // is piece 4q + l) into factors, then fn; each loop on local arrays, branch-free, so the last two vectorise.
  template <typename F>
  void row(int64_t r, int c0, int n, F&& fn) const {
    static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the lanes are read as the words' 16-bit pieces");
    constexpr int kSpan = 64;
    uint64_t w[kSpan / 4 + 1];
    uint16_t lanes[kSpan + 4];
    float f[kSpan];
    const uint64_t rowkey = mix(key_ + (static_cast<uint64_t>(r) + 1) * kGolden);
    const int thr = static_cast<int>(thr_);
    const float scale = scale_;
    for (int s = 0; s < n; s += kSpan) {
      const int len = n - s < kSpan ? n - s : kSpan, first = (c0 + s) >> 2, off = (c0 + s) & 3;
      const int words = (off + len + 3) >> 2;
      uint64_t state = rowkey + (static_cast<uint64_t>(first) + 1) * kGolden;
      for (int q = 0; q < words; ++q, state += kGolden) w[q] = mix(state);
      std::memcpy(lanes, w, sizeof(uint64_t) * words);
      for (int i = 0; i < len; ++i) f[i] = static_cast<int>(lanes[off + i]) >= thr ? scale : 0.f;
      for (int i = 0; i < len; ++i) fn(s + i, f[i]);
    }
  }
  // dst[i] = dropout(src)[i] for columns c0 .. c0 + n of row r.
  void apply(int64_t r, int c0, int n, const bf16* src, float* dst) const;
  // dst[i] += src[i] · m / (1 - p): a LoRA term's gradient carried back through the dropout to its input.
  void add(int64_t r, int c0, int n, const float* src, float* dst) const;

  static constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
  static uint64_t mix(uint64_t z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

 private:
  uint64_t key_;
  uint32_t thr_;
  float scale_;
};

// out[row * cols + c] = keep(seed, proj, row, c) as 0/1, row < rows (= T * k), c < cols.
void dropout_keep_mask(uint64_t seed, int proj, int64_t rows, int cols, double p, uint8_t* out);

}  // namespace kt
