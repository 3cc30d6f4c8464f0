#include "ops/rotary.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/thread_pool.h"

namespace kt {

namespace {

template <bool kNeox>  // a compile-time pairing, so the neox loop (unit strides) vectorizes
void rotate_head(bf16* x, const float* cos, const float* sin, int half) {
  // neox: (x[i], x[i + half]); GPT-J: (x[2i], x[2i + 1])
  const int a_step = kNeox ? 1 : 2, b_off = kNeox ? half : 1;
  for (int i = 0; i < half; ++i) {
    const int a = i * a_step, b = a + b_off;
    const float x1 = bf16_to_f32(x[a]), x2 = bf16_to_f32(x[b]);
    x[a] = f32_to_bf16(x1 * cos[i] - x2 * sin[i]);
    x[b] = f32_to_bf16(x2 * cos[i] + x1 * sin[i]);
  }
}
}  // namespace

void rotary_embedding(int T, const int64_t* positions, const float* cos_sin, int64_t max_position, int rotary_dim,
                      int head_size, bool neox, RotaryHeads q, RotaryHeads k) {
  for (int t = 0; t < T; ++t)
    if (positions[t] < 0 || positions[t] >= max_position)
      throw std::invalid_argument("rotary_embedding: position " + std::to_string(positions[t]) + " of token " +
                                  std::to_string(t) + " is outside the cache's [0, " + std::to_string(max_position) +
                                  ")");
  const int half = rotary_dim / 2;
  auto tokens = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* cos = cos_sin + positions[t] * rotary_dim;
      for (const RotaryHeads* h : {&q, &k})
        for (int j = 0; j < h->heads; ++j)
          (neox ? rotate_head<true> : rotate_head<false>)(h->x + t * h->ld + static_cast<int64_t>(j) * head_size,
                                                          cos, cos + half, half);
    }
  };
  parallel_rows(T, static_cast<int64_t>(T) * (q.heads + k.heads) * head_size, tokens);
}

}  // namespace kt
