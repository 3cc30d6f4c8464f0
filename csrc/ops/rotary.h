// Rotary position embedding of a CPU decode step in one pass (SGLang's RotaryEmbedding.forward_native runs it as
// about thirty torch ops per layer, each a dispatch): for token t at position p = positions[t], the first
// rotary_dim values of every head rotate by row p of the cache, cos = cache[p][0, rotary_dim/2), sin =
// cache[p][rotary_dim/2, rotary_dim); neox pairs value i with i + rotary_dim/2, GPT-J style pairs 2i with 2i+1.
// In place; fp32 math, one rounding to bf16; the rest of each head is left as it is.
#pragma once
#include <cstdint>
#include <stdexcept>

#include "isa/kernels.h"

namespace kt {

struct RotaryHeads {
  bf16* x;  // [T] rows ld apart, each `heads` dense heads of head_size values
  int64_t ld;
  int heads;
};

// Throws std::invalid_argument for a position outside [0, max_position).
void rotary_embedding(int T, const int64_t* positions, const float* cos_sin, int64_t max_position, int rotary_dim,
                      int head_size, bool neox, RotaryHeads q, RotaryHeads k);

}  // namespace kt
