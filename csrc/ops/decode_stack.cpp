#include "ops/decode_stack.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/buffer.h"
#include "moe/router.h"
#include "ops/norm.h"
#include "ops/rotary.h"

namespace kt {

namespace {
thread_local Buffer<bf16> tl_h, tl_residual, tl_qkv, tl_attn, tl_out, tl_shrunk;

// y (rows ldy apart, the projection's bf16 output) += its LoRA for x [B][K], as SGLang's LoRA wrapper adds it.
void add_lora(const Kernels& k, const DenseLoRA& l, const LoRASegments& segs, int B, int K, const bf16* x,
              int64_t ldx, bf16* y, int64_t ldy) {
  if (!l.a) return;
  LoRASegments s = segs;
  s.adapters = std::min(s.adapters, l.adapters);
  bf16* shrunk = tl_shrunk.get(static_cast<size_t>(B) * l.a_rows);
  lora_shrink(k, s, B, K, x, ldx, l.a, l.a_rows, l.slices, shrunk, l.a_rows);
  lora_expand(k, s, B, shrunk, l.a_rows, l.b, l.b_rows, l.max_rank, l.off, l.slices, y, ldy);
}

void expect(bool ok, const char* what, int layer) {
  if (!ok) throw std::invalid_argument("DecodeStack layer " + std::to_string(layer) + ": " + what);
}
}  // namespace

DecodeStack::DecodeStack(int H, int Hq, int Hkv, int D, const bf16* final_norm, float final_eps, const Kernels& k)
    : H_(H), Hq_(Hq), Hkv_(Hkv), D_(D), final_norm_(final_norm), final_eps_(final_eps), k_(k) {
  if (H <= 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || D > kMaxHeadDim || Hq % Hkv)
    throw std::invalid_argument("DecodeStack: hidden " + std::to_string(H) + ", " + std::to_string(Hq) + " q / " +
                                std::to_string(Hkv) + " kv heads of " + std::to_string(D) +
                                " (q heads must be a multiple of kv heads, head_dim at most " +
                                std::to_string(kMaxHeadDim) + ")");
}

void DecodeStack::add_layer(const DecoderLayer& l) {
  const int i = num_layers();
  expect(l.qkv && l.qkv->in_features() == H_ && l.qkv->out_features() == (Hq_ + 2 * Hkv_) * D_,
         "qkv projection is not [(q_heads + 2 kv_heads) * head_dim, hidden]", i);
  expect(l.o_proj && l.o_proj->in_features() == Hq_ * D_ && l.o_proj->out_features() == H_,
         "o projection is not [hidden, q_heads * head_dim]", i);
  expect(l.experts && l.experts->hidden() == H_, "routed experts of another hidden size", i);
  expect(l.gate && l.gate->in_features() == H_ && l.gate->out_features() == l.experts->num_experts(),
         "router gate is not [experts, hidden]", i);
  expect(l.top_k >= 1 && l.top_k <= l.experts->num_experts(), "top_k outside 1..experts", i);
  expect(l.rotary_dim > 0 && l.rotary_dim <= D_ && l.rotary_dim % 2 == 0 && l.cos_sin && l.max_position > 0,
         "rotary_dim must be even and in (0, head_dim], with a cos/sin cache", i);
  expect(l.k_cache && l.v_cache && l.ldk >= Hkv_ * D_ && l.ldv >= Hkv_ * D_ && l.cache_slots > 0,
         "KV cache rows must hold kv_heads * head_dim values", i);
  expect(l.input_norm && l.post_norm && l.q_norm && l.k_norm, "a norm weight is missing", i);
  layers_.push_back(l);
}

void DecodeStack::set_lora(int i, const DenseLoRA& qkv, const DenseLoRA& o) {
  expect(i >= 0 && i < num_layers(), "no such layer", i);
  const int64_t n_qkv = static_cast<int64_t>(Hq_ + 2 * Hkv_) * D_;
  for (const DenseLoRA* l : {&qkv, &o}) {
    if (!l->a) continue;
    const bool is_qkv = l == &qkv;
    expect(l->b && l->slices == (is_qkv ? 3 : 1) && l->max_rank > 0 && l->a_rows == l->slices * l->max_rank &&
               l->adapters > 0 && l->off[0] == 0,
           "LoRA buffers: A must hold slices x max_rank rows per adapter", i);
    for (int j = 0; j < l->slices; ++j) expect(l->off[j + 1] >= l->off[j], "LoRA slice offsets must rise", i);
    expect(l->off[l->slices] == (is_qkv ? n_qkv : H_) && l->b_rows >= l->off[l->slices],
           "LoRA B rows must cover the projection's output", i);
  }
  layers_[i].qkv_lora = qkv;
  layers_[i].o_lora = o;
}

void DecodeStack::forward(int B, bf16* x, const int64_t* positions, const int32_t* req_to_token, int64_t req_rows,
                          int64_t ld_req, const int64_t* req_pool_indices, const int64_t* seq_lens,
                          const int64_t* cache_loc, const int32_t* slots, int uniform_slot,
                          const LoRASegments* lora) const {
  if (B <= 0) return;
  for (int b = 0; b < B; ++b)
    if (req_pool_indices[b] < 0 || req_pool_indices[b] >= req_rows || seq_lens[b] < 0 || seq_lens[b] > ld_req)
      throw std::invalid_argument("DecodeStack: request " + std::to_string(b) + " (row " +
                                  std::to_string(req_pool_indices[b]) + ", length " + std::to_string(seq_lens[b]) +
                                  ") outside req_to_token [" + std::to_string(req_rows) + ", " +
                                  std::to_string(ld_req) + "]");
  const int64_t n_qkv = static_cast<int64_t>(Hq_ + 2 * Hkv_) * D_, n_q = static_cast<int64_t>(Hq_) * D_;
  const size_t rows = static_cast<size_t>(B) * H_;
  bf16 *h = tl_h.get(rows), *residual = tl_residual.get(rows), *out = tl_out.get(rows);
  bf16* qkv = tl_qkv.get(static_cast<size_t>(B) * n_qkv);
  bf16* attn = tl_attn.get(static_cast<size_t>(B) * n_q);
  const bf16* layer_out = x;  // the previous layer's MoE output; the embeddings before layer 0
  for (int i = 0; i < num_layers(); ++i) {
    const DecoderLayer& l = layers_[i];
    // SGLang's input_layernorm: layer 0 takes the embeddings as its residual, later layers add the MoE output.
    rms_norm(B, H_, layer_out, i ? residual : nullptr, H_, l.input_norm, l.input_eps, h, i ? residual : nullptr);
    if (!i) std::copy(x, x + rows, residual);
    l.qkv->forward(B, h, H_, l.qkv_bias, qkv, n_qkv, false);
    if (lora) add_lora(k_, l.qkv_lora, *lora, B, H_, h, H_, qkv, n_qkv);
    bf16* q = qkv;
    bf16* k = qkv + n_q;
    rms_norm_heads(B, Hq_, D_, q, n_qkv, l.q_norm, l.q_eps);
    rms_norm_heads(B, Hkv_, D_, k, n_qkv, l.k_norm, l.k_eps);
    rotary_embedding(B, positions, l.cos_sin, l.max_position, l.rotary_dim, D_, l.neox, {q, n_qkv, Hq_},
                     {k, n_qkv, Hkv_});
    const PagedKV kv{l.k_cache, l.ldk, l.v_cache, l.ldv, l.cache_slots, req_to_token, ld_req};
    const NewKV fresh{k, n_qkv, k + static_cast<int64_t>(Hkv_) * D_, n_qkv, cache_loc};
    decode_attention(B, Hq_, Hkv_, D_, D_, q, n_qkv, kv, &fresh, req_pool_indices, seq_lens, l.scale, attn, n_q, k_);
    l.o_proj->forward(B, attn, n_q, l.o_bias, out, H_, false);
    if (lora) add_lora(k_, l.o_lora, *lora, B, n_q, attn, n_q, out, H_);
    rms_norm(B, H_, out, residual, H_, l.post_norm, l.post_eps, h, residual);
    route_and_forward(*l.gate, *l.experts, B, l.top_k, l.renormalize, h, slots, uniform_slot, out);
    layer_out = out;
  }
  const bool any = num_layers() > 0;
  rms_norm(B, H_, layer_out, any ? residual : nullptr, H_, final_norm_, final_eps_, x, any ? residual : nullptr);
}

}  // namespace kt
