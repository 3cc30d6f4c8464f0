// The router of a Qwen2/Qwen3-style MoE block in C++, so a decode step's MoE block is one call from Python: gate
// logits (a packed dense layer), softmax top-k, then the routed experts. SGLang runs the same block as a gate
// GEMV, a chain of torch ops for the top-k and a dispatch through its MoE layer; at decode those Python and
// dispatch costs add up to more than the top-k itself, since the experts' weight stream has just evicted the
// interpreter's working set from the caches.
#pragma once
#include <cstdint>

#include "moe/experts.h"
#include "ops/linear.h"

namespace kt {

// Softmax top-k of T tokens over E experts, as SGLang's torch-native top-k computes it from bf16 gate logits:
// the k largest logits (ties: the lower expert id first), in descending order; weights = softmax over all E
// experts in fp32, divided by their sum over the k (+ 1e-20) when renormalize. logits rows ld apart.
void softmax_topk(int T, int E, const bf16* logits, int64_t ld, int k, bool renormalize, int32_t* ids,
                  float* weights);

// out = experts(x) routed by softmax_topk(gate(x)): T tokens, x and out bf16 [T, H]; slots as MoEExperts::forward.
void route_and_forward(const PackedLinear& gate, MoEExperts& experts, int T, int k, bool renormalize, const bf16* x,
                       const int32_t* slots, int uniform_slot, bf16* out);

// The same from the gate's bf16 logits [T, E] (rows ld apart) computed elsewhere: SGLang's gate module with the
// router LoRA of the requests' adapters, so such a batch routes with the same arithmetic as one without.
void route_logits_and_forward(MoEExperts& experts, int T, int k, bool renormalize, const bf16* x, const bf16* logits,
                              int64_t ld, const int32_t* slots, int uniform_slot, bf16* out);

}  // namespace kt
