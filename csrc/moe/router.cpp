#include "moe/router.h"

#include <cmath>
#include <stdexcept>
#include <string>

#include "common/buffer.h"

namespace kt {

void softmax_topk(int T, int E, const bf16* logits, int64_t ld, int k, bool renormalize, int32_t* ids,
                  float* weights) {
  if (k < 1 || k > E) throw std::invalid_argument("softmax_topk: k = " + std::to_string(k) + " for " +
                                                  std::to_string(E) + " experts");
  for (int t = 0; t < T; ++t) {
    const bf16* l = logits + t * ld;
    int32_t* id = ids + static_cast<int64_t>(t) * k;
    float* w = weights + static_cast<int64_t>(t) * k;
    float mx = -INFINITY;
    for (int e = 0; e < E; ++e) mx = std::fmax(mx, bf16_to_f32(l[e]));
    float denom = 0.f;
    for (int e = 0; e < E; ++e) denom += std::exp(bf16_to_f32(l[e]) - mx);
    // Insertion into the k best so far: E is a few hundred at most and k a few, so this beats a heap or a sort.
    int n = 0;
    for (int e = 0; e < E; ++e) {
      const float v = bf16_to_f32(l[e]);
      if (n == k && !(v > w[k - 1])) continue;  // a NaN never displaces a number
      int j = n < k ? n++ : k - 1;
      for (; j > 0 && v > w[j - 1]; --j) w[j] = w[j - 1], id[j] = id[j - 1];
      w[j] = v, id[j] = e;
    }
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += (w[j] = std::exp(w[j] - mx) / denom);
    if (renormalize)
      for (int j = 0; j < k; ++j) w[j] /= sum + 1e-20f;
  }
}

namespace {
thread_local Buffer<bf16> tl_logits;
thread_local Buffer<int32_t> tl_ids;
thread_local Buffer<float> tl_weights;
}  // namespace

void route_and_forward(const PackedLinear& gate, MoEExperts& experts, int T, int k, bool renormalize, const bf16* x,
                       const int32_t* slots, int uniform_slot, bf16* out) {
  const int E = experts.num_experts(), H = experts.hidden();
  if (gate.in_features() != H || gate.out_features() != E)
    throw std::invalid_argument("route_and_forward: gate is [" + std::to_string(gate.out_features()) + ", " +
                                std::to_string(gate.in_features()) + "], the experts want [" + std::to_string(E) +
                                ", " + std::to_string(H) + "]");
  if (T <= 0) return;
  bf16* logits = tl_logits.get(static_cast<size_t>(T) * E);
  gate.forward(T, x, H, nullptr, logits, E, false);  // bf16 logits, as SGLang's bf16 gate gives them
  route_logits_and_forward(experts, T, k, renormalize, x, logits, E, slots, uniform_slot, out);
}

void route_logits_and_forward(MoEExperts& experts, int T, int k, bool renormalize, const bf16* x, const bf16* logits,
                              int64_t ld, const int32_t* slots, int uniform_slot, bf16* out) {
  if (T <= 0) return;
  int32_t* ids = tl_ids.get(static_cast<size_t>(T) * k);
  float* weights = tl_weights.get(static_cast<size_t>(T) * k);
  softmax_topk(T, experts.num_experts(), logits, ld, k, renormalize, ids, weights);
  experts.forward(T, k, x, ids, false, weights, slots, uniform_slot, out, false, Dropout{0.0, 0});
}

}  // namespace kt
