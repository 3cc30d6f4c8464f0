// Routed SwiGLU experts with per-expert LoRA on gate, up and down, several adapters at once.
//
// SHAPES  x/out [T, H] bf16 · topk ids [T, k] int32|int64 · topk weights [T, k] fp32 · per-token slot [T] int32
//         base gate/up [E, I, H], down [E, H, I] (or fused gate_up [E, 2I, H]) bf16, nn.Linear layout
//         LoRA (KT layout) gate/up A [E, r, H], B [E, I, r]; down A [E, r, I], B [E, H, r]
// MATH    s = alpha / r
//         g = x Wgᵀ + s (x Agᵀ) Bgᵀ     u = x Wuᵀ + s (x Auᵀ) Buᵀ     h = silu(g) u
//         y = h Wdᵀ + s (h Adᵀ) Bdᵀ     out[t] = Σ_k w[t,k] y_k      (ids < 0 or >= E skipped; no routed scaling)
//         training forwards may drop the LoRA inputs: x Agᵀ, x Auᵀ, h Adᵀ become dropout(x) Agᵀ … (moe/dropout.h)
// REGULARITIES  T may be 0 or odd; H, I need not be multiples of anything; one expert may take every token;
//         tokens of one batch may use different adapters (slots) or none (-1).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "isa/kernels.h"
#include "moe/dropout.h"
#include "weights/packed_weights.h"

namespace kt {

// The base weights as the caller holds them: bf16, or fp8 (e4m3) with the fp32 scale of each block_n × block_k
// block, the DeepSeek-V3 / Qwen3-FP8 checkpoint layout. Pointers are at expert 0, experts *_estride elements
// apart (a fused gate_up [E, 2I, H] is gate = p, up = p + I·H, estride 2·I·H); scales row-major
// [ceil(N / block_n), ceil(K / block_k)] per expert, *_sstride floats apart.
struct ExpertWeights {
  bool fp8 = false;
  const void *gate = nullptr, *up = nullptr, *down = nullptr;
  int64_t gate_estride = 0, up_estride = 0, down_estride = 0;
  const float *gate_scale = nullptr, *up_scale = nullptr, *down_scale = nullptr;
  int64_t gate_sstride = 0, up_sstride = 0, down_sstride = 0;
  int block_n = 128, block_k = 128;
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

class MoEExperts {
 public:
  // The weights are packed in `format` (quantized unless they already are in it: an fp8 checkpoint packed as
  // fp8 keeps its bytes and block scales); callers may free theirs. group: K values per scale of int4, and of
  // fp8 packed from bf16 (a multiple of 64).
  MoEExperts(int num_experts, int hidden, int intermediate, const ExpertWeights& weights, Format format, int group,
          int max_tokens, int max_slots, const Kernels& kernels);
  // Packed weights left empty (zero) in `format` with `group` (the packed layout's: fp8 from a checkpoint packs
  // with its K block), to be filled through packed_regions() from a packed-weight cache.
  MoEExperts(int num_experts, int hidden, int intermediate, Format format, int group, int max_tokens, int max_slots,
             const Kernels& kernels);
  ~MoEExperts();

  int num_experts() const { return E_; }
  int hidden() const { return H_; }
  int intermediate() const { return I_; }
  int max_slots() const { return static_cast<int>(slots_.size()); }
  const char* isa() const { return k_.name; }
  Format format() const { return gate_.layout.fmt; }
  // The weights the kernel computes with, dequantized: proj 0 gate, 1 up [E, I, H]; 2 down [E, H, I], fp32.
  void dequantize(int proj, float* out) const;
  size_t weight_bytes() const { return gate_.bytes() + up_.bytes() + down_.bytes(); }  // packed forward weights
  int group() const { return gate_.layout.group; }  // K values per scale group of the packed layout
  // The packed weights' bytes, what a packed-weight cache stores: gate, up, down values, then their scales where the
  // format has them, each as (address, bytes) — the format's layout (weights/weight_format.h), not the allocation.
  std::vector<std::pair<uint8_t*, size_t>> packed_regions();

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
  void init_slots(int max_slots);

  const int E_, H_, I_, max_tokens_;
  const Kernels& k_;
  PackedWeights gate_, up_, down_;        // forward: Wg, Wu [I, H]; Wd [H, I]

  mutable std::mutex slots_mutex_;
  std::vector<std::shared_ptr<const Adapter>> slots_;
  std::vector<GradBuffers> grads_;

  std::unique_ptr<Saved> saved_;  // what backward needs, from the last forward with save_for_backward
  std::mutex saved_mutex_;
};

}  // namespace kt
