// The dropout mask of moe/dropout.h: portable scalar code, shared by every kernel table (the ISA microkernels only
// ever see the already dropped rows).
#include "moe/dropout.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace kt {

DropoutMask::DropoutMask(const Dropout& d, int proj) {
  if (proj < 0 || proj > 2) throw std::invalid_argument("dropout: proj must be 0 (gate), 1 (up) or 2 (down)");
  if (!(d.p >= 0.0 && d.p < 1.0)) throw std::invalid_argument("dropout must be in [0, 1), got " + std::to_string(d.p));
  key_ = mix(d.seed + static_cast<uint64_t>(proj + 1) * kGolden);
  thr_ = static_cast<uint32_t>(std::min(65535.0, std::floor(d.p * 65536.0 + 0.5)));
  scale_ = static_cast<float>(1.0 / (1.0 - d.p));
}

void DropoutMask::apply(int64_t r, int c0, int n, const bf16* src, float* dst) const {
  row(r, c0, n, [&](int i, float f) { dst[i] = bf16_to_f32(src[i]) * f; });
}

void DropoutMask::add(int64_t r, int c0, int n, const float* src, float* dst) const {
  row(r, c0, n, [&](int i, float f) { dst[i] += src[i] * f; });
}

void dropout_keep_mask(uint64_t seed, int proj, int64_t rows, int cols, double p, uint8_t* out) {
  const DropoutMask m(Dropout{p, seed}, proj);
  for (int64_t r = 0; r < rows; ++r)
    m.row(r, 0, cols, [&](int c, float f) { out[r * cols + c] = f != 0.f; });
}

}  // namespace kt
