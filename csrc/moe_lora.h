// Routed SwiGLU experts with per-expert LoRA on gate, up and down, several adapters at once.
//
// SHAPES  x/out [T, H] bf16 · topk ids [T, k] int32|int64 · topk weights [T, k] fp32 · per-token slot [T] int32
//         base gate/up [E, I, H], down [E, H, I] (or fused gate_up [E, 2I, H]) bf16, nn.Linear layout
//         LoRA (KT layout) gate/up A [E, r, H], B [E, I, r]; down A [E, r, I], B [E, H, r]
// MATH    s = alpha / r
//         g = x Wgᵀ + s (x Agᵀ) Bgᵀ     u = x Wuᵀ + s (x Auᵀ) Buᵀ     h = silu(g) u
//         y = h Wdᵀ + s (h Adᵀ) Bdᵀ     out[t] = Σ_k w[t,k] y_k      (ids < 0 or >= E skipped; no routed scaling)
//         training forwards may drop the LoRA inputs: x Agᵀ, x Auᵀ, h Adᵀ become dropout(x) Agᵀ … (dropout.h)
// REGULARITIES  T may be 0 or odd; H, I need not be multiples of anything; one expert may take every token;
//         tokens of one batch may use different adapters (slots) or none (-1).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "dropout.h"
#include "kernels.h"

namespace kt {

// An aligned, zero-initialised array that is reused across calls (grows, never shrinks; freed with its owner).
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { release(); }
  T* get(size_t n);  // at least n elements, contents unspecified (zeroed on growth)
  T* data() const { return p_; }

 private:
  void release();
  T* p_ = nullptr;
  size_t cap_ = 0, bytes_ = 0;
};

// W [N, K] packed per expert in the kernels.h block layout.
struct PackedWeights {
  int E = 0, N = 0, K = 0, kp = 0, nblocks = 0;
  size_t block_elems = 0;  // kp * 64
  Buffer<bf16> data;
  const bf16* block(int e, int b) const { return data.data() + (static_cast<size_t>(e) * nblocks + b) * block_elems; }
  void init(int E, int N, int K);
  // Packs expert e from get(n, k) = W[n][k].
  template <typename Get>
  void pack(int e, Get&& get) {
    bf16* dst = data.data() + static_cast<size_t>(e) * nblocks * block_elems;
    for (int b = 0; b < nblocks; ++b)
      for (int kk = 0; kk < kp / 2; ++kk)
        for (int c = 0; c < kBlockN; ++c)
          for (int j = 0; j < 2; ++j) {
            const int n = b * kBlockN + c, k = 2 * kk + j;
            *dst++ = (n < N && k < K) ? get(n, k) : bf16(0);
          }
  }
  bf16 at(int e, int n, int k) const {
    return block(e, n / kBlockN)[(static_cast<size_t>(k / 2) * kBlockN + n % kBlockN) * 2 + k % 2];
  }
};

// One adapter (slot content), immutable once built; shared with calls in flight.
struct Adapter {
  int rank = 0;
  float scale = 0.f;  // alpha / rank
  // bf16 as given, per expert: A ([r, in]) and B transposed ([r, out]); the same two arrays serve the forward
  // (t = x Aᵀ, y += s t Bᵀ) and the backward (t' = dy B, dx += s t' A).
  std::vector<bf16> gate_a, gate_bt, up_a, up_bt, down_a, down_bt;
};

struct GradBuffers {  // caller-owned fp32 tensors in the KT layout; accumulated into
  float *gate_a = nullptr, *gate_b = nullptr, *up_a = nullptr, *up_b = nullptr, *down_a = nullptr,
        *down_b = nullptr;
};

class MoELoRA {
 public:
  // gate/up/down point at expert 0; experts are *_estride elements apart, rows contiguous (a fused gate_up
  // [E, 2I, H] is gate = p, up = p + I·H, estride 2·I·H). The weights are copied (packed); callers may free theirs.
  MoELoRA(int num_experts, int hidden, int intermediate, const bf16* gate, int64_t gate_estride, const bf16* up,
          int64_t up_estride, const bf16* down, int64_t down_estride, int max_tokens, int max_slots,
          const Kernels& kernels);
  ~MoELoRA();

  int num_experts() const { return E_; }
  int hidden() const { return H_; }
  int intermediate() const { return I_; }
  int max_slots() const { return static_cast<int>(slots_.size()); }
  const char* isa() const { return k_.name; }

  void set_adapter(int slot, int rank, float alpha, const bf16* gate_a, const bf16* gate_b, const bf16* up_a,
                   const bf16* up_b, const bf16* down_a, const bf16* down_b);
  void remove_adapter(int slot);
  bool has_adapter(int slot) const;
  void set_grad_buffers(int slot, const GradBuffers& g);

  // ids are int64 when ids64, else int32. slots: one slot per token, or null: every token uses uniform_slot
  // (-1 = base only). dropout (training) regenerates its masks from the seed in backward.
  void forward(int T, int k, const bf16* x, const void* ids, bool ids64, const float* weights, const int32_t* slots,
               int uniform_slot, bf16* out, bool save_for_backward, const Dropout& dropout = {});
  void backward(const bf16* grad_out, bf16* grad_x, float* grad_weights);
  // Frees what the last forward saved (none pending a backward): under gradient checkpointing a layer's saved
  // state then exists only between its recompute and its backward.
  void release_saved();

  struct Route;
  struct Saved;

 private:
  void check_slot(int slot) const;
  void ensure_backward_weights();

  const int E_, H_, I_, max_tokens_;
  const Kernels& k_;
  PackedWeights gate_, up_, down_;        // forward: Wg, Wu [I, H]; Wd [H, I]
  PackedWeights down_t_, gate_up_t_;      // backward, built on first use: Wdᵀ [I, H]; [Wg | Wu]ᵀ [H, 2·kpI]
  std::mutex backward_weights_mutex_;
  bool have_backward_weights_ = false;

  mutable std::mutex slots_mutex_;
  std::vector<std::shared_ptr<const Adapter>> slots_;
  std::vector<GradBuffers> grads_;

  std::unique_ptr<Saved> saved_;  // what backward needs, from the last forward with save_for_backward
  std::mutex saved_mutex_;
};

}  // namespace kt
