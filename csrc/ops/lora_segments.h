// SGLang's segmented LoRA for the dense layers of a CPU host (its torch_native LoRA backend runs each segment's
// shrink and each slice's expand as separate torch ops in Python loops: about a hundred dispatches per layer at 8
// decode streams with mixed adapters). Tokens come in consecutive segments; segment s has seg_lens[s] tokens and
// uses adapter weight_indices[s], whose rank is ranks[adapter] (0: no LoRA) and scaling scalings[adapter].
// Arithmetic in fp32, one rounding to bf16 per output, as torch's bf16 addmm.
#pragma once
#include <cstdint>
#include <stdexcept>

#include "isa/kernels.h"

namespace kt {

struct LoRASegments {
  int n;                           // segments
  int adapters;                    // weight_indices must be below this
  const int32_t* seg_lens;         // [n]
  const int32_t* weight_indices;   // [n]
  const int32_t* ranks;            // per adapter
  const float* scalings;           // per adapter
};

// Shrink: out[t][0, slices·r) = scaling · x[t] · W[a][0, slices·r)ᵀ (r: the adapter's rank), the rest of the
// row's w_rows values zero. x bf16 [T, K] rows ldx apart; W bf16 [adapters, w_rows, K] contiguous (an adapter's
// slices stacked, r rows each); out bf16 rows ldo apart.
void lora_shrink(const Kernels& k, const LoRASegments& s, int T, int K, const bf16* x, int64_t ldx, const bf16* W,
                 int w_rows, int slices, bf16* out, int64_t ldo);

// Expand, added in place (off: int32, as SGLang keeps its slice offsets): for each slice i, y[t][off[i], off[i+1]) += a[t][i·r, (i+1)·r) · W[a][off[i], off[i+1])
// [0, r)ᵀ. a bf16 [T, lda] (the shrink's output); W bf16 [adapters, w_rows ≥ off[slices], max_rank] contiguous;
// y bf16 rows ldy apart.
void lora_expand(const Kernels& k, const LoRASegments& s, int T, const bf16* a, int64_t lda, const bf16* W,
                 int64_t w_rows, int max_rank, const int32_t* off, int slices, bf16* y, int64_t ldy);
// Both throw std::invalid_argument, naming the field, for segments beyond T tokens, an adapter index out of range,
// a rank the weights (or a) have no room for, or slice offsets that do not rise from 0.

}  // namespace kt
