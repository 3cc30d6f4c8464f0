// A MoE decoder stack's decode step in one call, for Qwen3-MoE and Qwen3.5-MoE: for a batch of B requests (one new
// token each), every layer's input norm (+ residual), token mixer, post-mixer norm (+ residual) and MoE block, then
// the final norm. Two mixers:
//   attention   qkv projection, per-head q / k norm and rotary, paged attention (storing the step's K and V at their
//               cache slots), o projection; with an output gate (Qwen3.5) the q rows hold per head [q | gate] and
//               the attention output is multiplied by sigmoid(gate) before o.
//   gated DeltaNet (Qwen3.5's linear attention)  in_proj_qkvz [q | k | v | z] and in_proj_ba [b | a] projections,
//               the causal conv of q/k/v and the recurrent delta-rule step on the request's states in SGLang's mamba
//               pools (ops/gdn.h), the gated RMSNorm with z, out_proj.
// The MoE block is the router gate, softmax top-k and routed experts with their LoRA slots, plus (Qwen3.5) a shared
// SwiGLU expert scaled by sigmoid(shared_expert_gate · x). Norms are plain RMSNorms (Qwen3) or Gemma's (1 + w,
// Qwen3.5). Each piece is the kernel's own op (ops/norm.h, ops/linear.h, ops/rotary.h, ops/attention.h, ops/gdn.h,
// moe/router.h) called in SGLang's order with SGLang's roundings; what the call saves is the Python between them,
// which at decode runs cold after every weight stream (evals/profile_decode.py --timers). Any projection may carry
// the LoRA of SGLang's memory pool (set_lora), applied with the batch's segments.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "isa/kernels.h"
#include "moe/experts.h"
#include "ops/attention.h"
#include "ops/gdn.h"
#include "ops/linear.h"
#include "ops/lora_segments.h"

namespace kt {

constexpr int kMaxLoRASlices = 4;

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
  int32_t off[kMaxLoRASlices + 1] = {};
};

// A packed projection, its fp32 bias (or null) and LoRA.
struct Projection {
  const PackedLinear* w = nullptr;
  const float* bias = nullptr;
  DenseLoRA lora;
};

// A norm's weight: bf16 w (RMSNorm) or fp32 w1 = 1 + weight (Gemma's RMSNorm, the residual summed in bf16).
struct NormWeight {
  const bf16* w = nullptr;
  const float* w1 = nullptr;
  float eps = 0.f;
};

struct AttentionMixer {
  Projection qkv;  // [(Hq (2 with the output gate) + 2 Hkv) D, H]
  Projection o;    // [H, Hq D]
  int Hq = 0, Hkv = 0, D = 0;
  bool output_gate = false;
  NormWeight q_norm, k_norm;  // [D]
  const float* cos_sin = nullptr;  // fp32 [max_position, rotary_dim]: cos then sin (ops/rotary.h)
  int64_t max_position = 0;
  int rotary_dim = 0;
  bool neox = true;
  bf16* k_cache = nullptr;  // [slots][Hkv][D], ldk values between slots
  int64_t ldk = 0;
  bf16* v_cache = nullptr;
  int64_t ldv = 0;
  int64_t cache_slots = 0;
  float scale = 0.f;
};

struct GdnMixer {
  Projection qkvz;  // [2 Hk Dk + 2 Hv Dv, H]: q | k | v | z
  Projection ba;    // [2 Hv, H]: b | a
  Projection out;   // [H, Hv Dv]
  int Hk = 0, Hv = 0, Dk = 0, Dv = 0, conv_kernel = 0;
  const bf16* conv_w = nullptr;  // [2 Hk Dk + Hv Dv][conv_kernel]
  const bf16* conv_bias = nullptr;
  bool conv_silu = true;
  GdnConvStates conv = {};
  GdnStates ssm = {};
  HeadParam A_log = {}, dt_bias = {};
  const float* norm_w = nullptr;  // fp32 [Dv]
  float norm_eps = 0.f;
  bool sigmoid_gate = false;  // the gated norm's activation: sigmoid, else SiLU
};

struct MoEBlock {
  const PackedLinear* gate = nullptr;  // [E, H], no bias
  MoEExperts* experts = nullptr;
  int top_k = 0;
  bool renormalize = true;
  Projection shared_gate_up;  // [2 I, H], w null: no shared expert
  Projection shared_down;     // [H, I]
  const bf16* shared_expert_gate = nullptr;  // [H]: the shared expert's output times sigmoid(x · it); null: none
};

struct DecoderLayer {
  NormWeight input_norm, post_norm;  // [H]
  bool is_gdn = false;
  AttentionMixer attn;
  GdnMixer gdn;
  MoEBlock moe;
};

class DecodeStack {
 public:
  DecodeStack(int H, NormWeight final_norm, const Kernels& k);
  // Each checks the layer's shapes against the stack's (std::invalid_argument naming the part).
  void add_attention_layer(NormWeight input_norm, NormWeight post_norm, const AttentionMixer& attn,
                           const MoEBlock& moe);
  void add_gdn_layer(NormWeight input_norm, NormWeight post_norm, const GdnMixer& gdn, const MoEBlock& moe);
  // Layer i's projection `name` (qkv, o; in_proj_qkvz, in_proj_ba, out_proj; shared_gate_up, shared_down) gets
  // SGLang's LoRA buffers, applied where forward gets LoRA segments.
  void set_lora(int i, const std::string& name, const DenseLoRA& lora);
  int num_layers() const { return static_cast<int>(layers_.size()); }
  bool has_gdn() const;

  // x: bf16 [B][H] token embeddings in, the final norm's output written over them. positions, req_pool_indices,
  // seq_lens (including this step's token), cache_loc: int64 [B]; req_to_token int32 [req_rows] rows ld_req apart;
  // state_slots: int32 [B] each request's slot in the GDN layers' state pools (null without GDN layers). A request
  // index, length or state slot out of range throws before anything is written. slots: int32 [B] expert-LoRA slot
  // per request, or null for uniform_slot everywhere (-1: none). lora: the batch's segments for the projections'
  // LoRA (SGLang's LoRA batch), or null.
  void forward(int B, bf16* x, const int64_t* positions, const int32_t* req_to_token, int64_t req_rows, int64_t ld_req,
               const int64_t* req_pool_indices, const int64_t* seq_lens, const int64_t* cache_loc,
               const int32_t* state_slots, const int32_t* slots, int uniform_slot, const LoRASegments* lora) const;

 private:
  void check_moe(const MoEBlock& moe, int i) const;
  // Layer l with its norms and MoE block appended, after the checks both layer kinds share.
  void push(NormWeight input_norm, NormWeight post_norm, DecoderLayer& l, const MoEBlock& moe);
  void attention(const AttentionMixer& a, int B, const bf16* h, const int64_t* positions, const PagedKV& kv_rows,
                 const int64_t* req_pool_indices, const int64_t* seq_lens, const int64_t* cache_loc,
                 const LoRASegments* lora, bf16* out) const;
  void gated_delta_net(const GdnMixer& g, int B, const bf16* h, const int32_t* state_slots, const LoRASegments* lora,
                       bf16* out) const;
  void moe_block(const MoEBlock& m, int B, const bf16* h, const int32_t* slots, int uniform_slot,
                 const LoRASegments* lora, bf16* out) const;

  int H_;
  NormWeight final_norm_;
  const Kernels& k_;
  std::vector<DecoderLayer> layers_;
};

}  // namespace kt
