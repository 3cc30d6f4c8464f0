// A Qwen3-MoE decoder stack's decode step in one call: for a batch of B requests (one new token each), every
// layer's input RMSNorm (+ residual), qkv projection, per-head q / k RMSNorm and rotary, paged attention (storing
// the step's K and V at their cache slots), o projection, post-attention RMSNorm (+ residual) and MoE block (router
// gate, softmax top-k, routed experts with their LoRA slots), then the final RMSNorm. Each piece is the kernel's own
// op (ops/norm.h, ops/linear.h, ops/rotary.h, ops/attention.h, moe/router.h) called in SGLang's order with SGLang's
// roundings, so a step gives what the ops give called one by one from Python; what it saves is the Python between
// them, which at decode runs cold after every weight stream (evals/profile_decode.py --timers).
#pragma once
#include <cstdint>
#include <vector>

#include "isa/kernels.h"
#include "moe/experts.h"
#include "ops/attention.h"
#include "ops/linear.h"
#include "ops/lora_segments.h"

namespace kt {

// A projection's LoRA in SGLang's memory-pool layout (ops/lora_segments.h): A [adapters][a_rows][in] (slices stacked,
// max_rank rows each), B [adapters][b_rows][max_rank]; output columns of slice i are [off[i], off[i+1]).
struct DenseLoRA {
  const bf16* a = nullptr;  // null: no LoRA on this projection
  int a_rows = 0;
  const bf16* b = nullptr;
  int64_t b_rows = 0;
  int max_rank = 0;
  int adapters = 0;
  int slices = 0;
  int32_t off[4] = {};
};

// One decoder layer's weights and KV cache. Norm weights bf16 [H] (q / k norms [D]); biases fp32 or null.
struct DecoderLayer {
  const bf16* input_norm;
  float input_eps;
  const PackedLinear* qkv;  // [(Hq + 2 Hkv) D, H]
  const float* qkv_bias;
  const bf16* q_norm;
  float q_eps;
  const bf16* k_norm;
  float k_eps;
  const float* cos_sin;  // fp32 [max_position, rotary_dim]: cos then sin (ops/rotary.h)
  int64_t max_position;
  int rotary_dim;
  bool neox;
  bf16* k_cache;  // [slots][Hkv][D], ldk values between slots
  int64_t ldk;
  bf16* v_cache;  // [slots][Hkv][D]
  int64_t ldv;
  int64_t cache_slots;
  float scale;
  const PackedLinear* o_proj;  // [H, Hq D]
  const float* o_bias;
  const bf16* post_norm;
  float post_eps;
  const PackedLinear* gate;  // [E, H], no bias
  MoEExperts* experts;
  int top_k;
  bool renormalize;
  DenseLoRA qkv_lora = {}, o_lora = {};  // set_lora
};

class DecodeStack {
 public:
  // H hidden size; Hq / Hkv query and KV heads of D values; final_norm bf16 [H].
  DecodeStack(int H, int Hq, int Hkv, int D, const bf16* final_norm, float final_eps, const Kernels& k);
  void add_layer(const DecoderLayer& layer);  // checks its shapes against the stack's
  // Layer i's q/k/v (3 slices) and o (1 slice) LoRA buffers, applied where forward gets LoRA segments.
  void set_lora(int i, const DenseLoRA& qkv, const DenseLoRA& o);
  int num_layers() const { return static_cast<int>(layers_.size()); }

  // x: bf16 [B][H] token embeddings in, the final norm's output written over them. positions, req_pool_indices,
  // seq_lens (including this step's token), cache_loc: int64 [B]; req_to_token int32 [req_rows] rows ld_req apart
  // (a request index or length outside it throws before anything is written). slots:
  // int32 [B] expert-LoRA slot per request, or null for uniform_slot everywhere (-1: none). lora: the batch's
  // segments for the layers' q/k/v and o LoRA (SGLang's LoRA batch), or null.
  void forward(int B, bf16* x, const int64_t* positions, const int32_t* req_to_token, int64_t req_rows, int64_t ld_req,
               const int64_t* req_pool_indices, const int64_t* seq_lens, const int64_t* cache_loc,
               const int32_t* slots, int uniform_slot, const LoRASegments* lora) const;

 private:
  int H_, Hq_, Hkv_, D_;
  const bf16* final_norm_;
  float final_eps_;
  const Kernels& k_;
  std::vector<DecoderLayer> layers_;
};

}  // namespace kt
