#include "ops/decode_stack.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/buffer.h"
#include "common/thread_pool.h"
#include "moe/router.h"
#include "ops/activation.h"
#include "ops/norm.h"
#include "ops/rotary.h"

namespace kt {

namespace {
// A step's activations, reused across steps (per thread: one stack may serve several servers' threads).
struct Scratch {
  Buffer<bf16> h, residual, out, proj, proj2, q, gate, attn, mixed, z, shrunk, act;
};
thread_local Scratch tl;

void expect(bool ok, const std::string& what, int layer) {
  if (!ok) throw std::invalid_argument("DecodeStack layer " + std::to_string(layer) + ": " + what);
}

bool valid(const NormWeight& n) { return (n.w != nullptr) != (n.w1 != nullptr); }

// y = norm(x (+ residual)) over rows of H, residual_out = the sum (ops/norm.h); plain or Gemma by the weight.
void norm(const NormWeight& n, int M, int H, const bf16* x, const bf16* residual, bf16* y, bf16* residual_out) {
  if (n.w1)
    rms_norm_gemma(M, H, x, residual, H, n.w1, n.eps, y, residual_out);
  else
    rms_norm(M, H, x, residual, H, n.w, n.eps, y, residual_out);
}

void norm_heads(const NormWeight& n, int T, int heads, int D, bf16* x, int64_t ld) {
  if (n.w1)
    rms_norm_heads_gemma(T, heads, D, x, ld, n.w1, n.eps);
  else
    rms_norm_heads(T, heads, D, x, ld, n.w, n.eps);
}

// y (bf16 rows ldy apart) = x Wᵀ + bias, plus the projection's LoRA as SGLang's LoRA wrapper adds it.
void project(const Kernels& k, const Projection& p, const LoRASegments* segs, int B, const bf16* x, int64_t ldx, bf16* y,
             int64_t ldy) {
  p.w->forward(B, x, ldx, p.bias, y, ldy, false);
  const DenseLoRA& l = p.lora;
  if (!segs || !l.a) return;
  LoRASegments s = *segs;
  s.adapters = std::min(s.adapters, l.adapters);
  bf16* shrunk = tl.shrunk.get(static_cast<size_t>(B) * l.a_rows);
  lora_shrink(k, s, B, p.w->in_features(), x, ldx, l.a, l.a_rows, l.slices, shrunk, l.a_rows);
  lora_expand(k, s, B, shrunk, l.a_rows, l.b, l.b_rows, l.max_rank, l.off, l.slices, y, ldy);
}

bool shaped(const Projection& p, int64_t out, int64_t in) {
  return p.w && p.w->out_features() == out && p.w->in_features() == in;
}
}  // namespace

DecodeStack::DecodeStack(int H, NormWeight final_norm, const Kernels& k) : H_(H), final_norm_(final_norm), k_(k) {
  if (H <= 0 || !valid(final_norm))
    throw std::invalid_argument("DecodeStack: hidden size " + std::to_string(H) +
                                " must be positive, with one final norm weight (bf16 w or Gemma's fp32 1 + w)");
}

bool DecodeStack::has_gdn() const {
  return std::any_of(layers_.begin(), layers_.end(), [](const DecoderLayer& l) { return l.is_gdn; });
}

void DecodeStack::check_moe(const MoEBlock& m, int i) const {
  expect(m.experts && m.experts->hidden() == H_, "routed experts of another hidden size", i);
  expect(m.gate && m.gate->in_features() == H_ && m.gate->out_features() == m.experts->num_experts(),
         "router gate is not [experts, hidden]", i);
  expect(m.top_k >= 1 && m.top_k <= m.experts->num_experts(), "top_k outside 1..experts", i);
  if (!m.shared_gate_up.w) {
    expect(!m.shared_down.w && !m.shared_expert_gate, "a shared expert without its gate_up projection", i);
    return;
  }
  const int I2 = m.shared_gate_up.w->out_features();
  expect(I2 % 2 == 0 && shaped(m.shared_gate_up, I2, H_) && shaped(m.shared_down, H_, I2 / 2),
         "shared expert projections are not [2 I, hidden] and [hidden, I]", i);
}

void DecodeStack::add_attention_layer(NormWeight input_norm, NormWeight post_norm, const AttentionMixer& a,
                                      const MoEBlock& moe) {
  const int i = num_layers();
  expect(valid(a.q_norm) && valid(a.k_norm), "each norm needs one weight (bf16 w or Gemma's fp32 1 + w)", i);
  expect(a.Hq > 0 && a.Hkv > 0 && a.D > 0 && a.D <= kMaxHeadDim && a.Hq % a.Hkv == 0,
         "q heads must be a multiple of kv heads, head_dim in 1.." + std::to_string(kMaxHeadDim), i);
  const int64_t q_rows = static_cast<int64_t>(a.Hq) * a.D * (a.output_gate ? 2 : 1);
  expect(shaped(a.qkv, q_rows + 2LL * a.Hkv * a.D, H_),
         "qkv projection is not [(q_heads (x2 with the output gate) + 2 kv_heads) * head_dim, hidden]", i);
  expect(shaped(a.o, H_, static_cast<int64_t>(a.Hq) * a.D), "o projection is not [hidden, q_heads * head_dim]", i);
  expect(a.rotary_dim > 0 && a.rotary_dim <= a.D && a.rotary_dim % 2 == 0 && a.cos_sin && a.max_position > 0,
         "rotary_dim must be even and in (0, head_dim], with a cos/sin cache", i);
  expect(a.k_cache && a.v_cache && a.ldk >= a.Hkv * a.D && a.ldv >= a.Hkv * a.D && a.cache_slots > 0,
         "KV cache rows must hold kv_heads * head_dim values", i);
  DecoderLayer l;
  l.attn = a;
  push(input_norm, post_norm, l, moe);
}

void DecodeStack::add_gdn_layer(NormWeight input_norm, NormWeight post_norm, const GdnMixer& g, const MoEBlock& moe) {
  const int i = num_layers();
  expect(g.norm_w != nullptr, "the gated norm's weight is missing", i);
  expect(g.Hk > 0 && g.Hv > 0 && g.Hv % g.Hk == 0 && g.Dk > 0 && g.Dv > 0 && g.conv_kernel >= 2 && g.conv_w,
         "GDN heads: value heads must be a multiple of key heads, a conv of 2 taps or more", i);
  const int64_t key_dim = static_cast<int64_t>(g.Hk) * g.Dk, value_dim = static_cast<int64_t>(g.Hv) * g.Dv;
  expect(shaped(g.qkvz, 2 * key_dim + 2 * value_dim, H_), "in_proj_qkvz is not [2 key_dim + 2 value_dim, hidden]", i);
  expect(shaped(g.ba, 2LL * g.Hv, H_), "in_proj_ba is not [2 value_heads, hidden]", i);
  expect(shaped(g.out, H_, value_dim), "out_proj is not [hidden, value_dim]", i);
  expect(g.conv.data && g.conv.slots > 0 && g.ssm.data && g.ssm.slots > 0 && g.A_log.data && g.dt_bias.data,
         "GDN state pools, A_log and dt_bias are required", i);
  DecoderLayer l;
  l.is_gdn = true;
  l.gdn = g;
  push(input_norm, post_norm, l, moe);
}

void DecodeStack::push(NormWeight input_norm, NormWeight post_norm, DecoderLayer& l, const MoEBlock& moe) {
  const int i = num_layers();
  expect(valid(input_norm) && valid(post_norm), "each norm needs one weight (bf16 w or Gemma's fp32 1 + w)", i);
  check_moe(moe, i);
  l.input_norm = input_norm;
  l.post_norm = post_norm;
  l.moe = moe;
  layers_.push_back(l);
}

void DecodeStack::set_lora(int i, const std::string& name, const DenseLoRA& l) {
  expect(i >= 0 && i < num_layers(), "no such layer", i);
  DecoderLayer& layer = layers_[i];
  Projection* p = nullptr;
  if (!layer.is_gdn && name == "qkv") p = &layer.attn.qkv;
  if (!layer.is_gdn && name == "o") p = &layer.attn.o;
  if (layer.is_gdn && name == "in_proj_qkvz") p = &layer.gdn.qkvz;
  if (layer.is_gdn && name == "in_proj_ba") p = &layer.gdn.ba;
  if (layer.is_gdn && name == "out_proj") p = &layer.gdn.out;
  if (name == "shared_gate_up" && layer.moe.shared_gate_up.w) p = &layer.moe.shared_gate_up;
  if (name == "shared_down" && layer.moe.shared_down.w) p = &layer.moe.shared_down;
  expect(p != nullptr, "no projection " + name + " in this layer", i);
  if (l.a) {
    expect(l.b && l.slices >= 1 && l.slices <= kMaxLoRASlices && l.max_rank > 0 &&
               l.a_rows == l.slices * l.max_rank && l.adapters > 0 && l.off[0] == 0,
           name + " LoRA buffers: A must hold slices x max_rank rows per adapter", i);
    for (int j = 0; j < l.slices; ++j) expect(l.off[j + 1] >= l.off[j], name + " LoRA slice offsets must rise", i);
    expect(l.off[l.slices] <= p->w->out_features() && l.b_rows >= l.off[l.slices],
           name + " LoRA B rows must lie within the projection's output", i);
  }
  p->lora = l;
}

void DecodeStack::attention(const AttentionMixer& a, int B, const bf16* h, const int64_t* positions,
                            const PagedKV& kv_rows, const int64_t* req_pool_indices, const int64_t* seq_lens,
                            const int64_t* cache_loc, const LoRASegments* lora, bf16* out) const {
  const int64_t n_q = static_cast<int64_t>(a.Hq) * a.D, n_kv = static_cast<int64_t>(a.Hkv) * a.D;
  const int64_t q_rows = a.output_gate ? 2 * n_q : n_q, n_qkv = q_rows + 2 * n_kv;
  bf16* qkv = tl.proj.get(static_cast<size_t>(B) * n_qkv);
  project(k_, a.qkv, lora, B, h, H_, qkv, n_qkv);
  bf16* q = qkv;
  int64_t ldq = n_qkv;
  bf16* gate = nullptr;
  if (a.output_gate) {  // per head [q | gate]: q heads gathered dense for the attention, gates beside
    q = tl.q.get(static_cast<size_t>(B) * n_q);
    gate = tl.gate.get(static_cast<size_t>(B) * n_q);
    ldq = n_q;
    for (int b = 0; b < B; ++b)
      for (int hd = 0; hd < a.Hq; ++hd) {
        const bf16* src = qkv + b * n_qkv + 2LL * hd * a.D;
        std::copy(src, src + a.D, q + b * n_q + static_cast<int64_t>(hd) * a.D);
        std::copy(src + a.D, src + 2 * a.D, gate + b * n_q + static_cast<int64_t>(hd) * a.D);
      }
  }
  bf16* k = qkv + q_rows;
  norm_heads(a.q_norm, B, a.Hq, a.D, q, ldq);
  norm_heads(a.k_norm, B, a.Hkv, a.D, k, n_qkv);
  rotary_embedding(B, positions, a.cos_sin, a.max_position, a.rotary_dim, a.D, a.neox, {q, ldq, a.Hq},
                   {k, n_qkv, a.Hkv});
  PagedKV kv = kv_rows;
  kv.k = a.k_cache;
  kv.ldk = a.ldk;
  kv.v = a.v_cache;
  kv.ldv = a.ldv;
  kv.slots = a.cache_slots;
  const NewKV fresh{k, n_qkv, k + n_kv, n_qkv, cache_loc};
  bf16* attn = tl.attn.get(static_cast<size_t>(B) * n_q);
  decode_attention(B, a.Hq, a.Hkv, a.D, a.D, q, ldq, kv, &fresh, req_pool_indices, seq_lens, a.scale, attn, n_q, k_);
  if (gate) sigmoid_mul(B * n_q, attn, gate);
  project(k_, a.o, lora, B, attn, n_q, out, H_);
}

void DecodeStack::gated_delta_net(const GdnMixer& g, int B, const bf16* h, const int32_t* state_slots,
                                  const LoRASegments* lora, bf16* out) const {
  const int64_t key_dim = static_cast<int64_t>(g.Hk) * g.Dk, value_dim = static_cast<int64_t>(g.Hv) * g.Dv;
  const int64_t conv_dim = 2 * key_dim + value_dim, n_qkvz = conv_dim + value_dim, n_ba = 2LL * g.Hv;
  bf16* qkvz = tl.proj.get(static_cast<size_t>(B) * n_qkvz);
  bf16* ba = tl.proj2.get(static_cast<size_t>(B) * n_ba);
  project(k_, g.qkvz, lora, B, h, H_, qkvz, n_qkvz);
  project(k_, g.ba, lora, B, h, H_, ba, n_ba);
  bf16* mixed = tl.mixed.get(static_cast<size_t>(B) * conv_dim);
  gdn_conv_update(B, static_cast<int>(conv_dim), g.conv_kernel, qkvz, n_qkvz, g.conv, state_slots, g.conv_w,
                  g.conv_bias, g.conv_silu, mixed, conv_dim, k_);
  const GdnStepInputs in{mixed,    mixed + key_dim, mixed + 2 * key_dim, ba + g.Hv, ba, conv_dim, conv_dim, conv_dim,
                         n_ba,     n_ba,            g.A_log,             g.dt_bias};
  bf16* core = tl.attn.get(static_cast<size_t>(B) * value_dim);
  gdn_recurrent_step(B, g.Hk, g.Hv, g.Dk, g.Dv, in, g.ssm, state_slots, true, 1.f, 20.f, core);
  bf16* z = tl.z.get(static_cast<size_t>(B) * value_dim);  // the gated norm reads z rows dense
  for (int b = 0; b < B; ++b) std::copy(qkvz + b * n_qkvz + conv_dim, qkvz + (b + 1) * n_qkvz, z + b * value_dim);
  rms_norm_gated(B * g.Hv, g.Dv, g.Dv, core, z, g.norm_w, nullptr, g.norm_eps, g.sigmoid_gate, core, k_);
  project(k_, g.out, lora, B, core, value_dim, out, H_);
}

void DecodeStack::moe_block(const MoEBlock& m, int B, const bf16* h, const int32_t* slots, int uniform_slot,
                            const LoRASegments* lora, bf16* out) const {
  route_and_forward(*m.gate, *m.experts, B, m.top_k, m.renormalize, h, slots, uniform_slot, out);
  if (!m.shared_gate_up.w) return;
  const int I = m.shared_down.w->in_features();
  bf16* gate_up = tl.proj.get(static_cast<size_t>(B) * 2 * I);
  project(k_, m.shared_gate_up, lora, B, h, H_, gate_up, 2LL * I);
  bf16* act = tl.act.get(static_cast<size_t>(B) * I);
  silu_mul(B, I, gate_up, 2LL * I, act, I, k_);
  bf16* shared = tl.proj2.get(static_cast<size_t>(B) * H_);
  project(k_, m.shared_down, lora, B, act, I, shared, H_);
  if (m.shared_expert_gate)
    shared_expert_gate_add(B, H_, h, m.shared_expert_gate, nullptr, shared, out);
  else
    for (size_t j = 0; j < static_cast<size_t>(B) * H_; ++j)
      out[j] = f32_to_bf16(bf16_to_f32(out[j]) + bf16_to_f32(shared[j]));
}

void DecodeStack::forward(int B, bf16* x, const int64_t* positions, const int32_t* req_to_token, int64_t req_rows,
                          int64_t ld_req, const int64_t* req_pool_indices, const int64_t* seq_lens,
                          const int64_t* cache_loc, const int32_t* state_slots, const int32_t* slots,
                          int uniform_slot, const LoRASegments* lora) const {
  if (B <= 0) return;
  for (int b = 0; b < B; ++b)
    if (req_pool_indices[b] < 0 || req_pool_indices[b] >= req_rows || seq_lens[b] < 0 || seq_lens[b] > ld_req)
      throw std::invalid_argument("DecodeStack: request " + std::to_string(b) + " (row " +
                                  std::to_string(req_pool_indices[b]) + ", length " + std::to_string(seq_lens[b]) +
                                  ") outside req_to_token [" + std::to_string(req_rows) + ", " +
                                  std::to_string(ld_req) + "]");
  for (const DecoderLayer& l : layers_) {
    if (!l.is_gdn) continue;
    if (!state_slots) throw std::invalid_argument("DecodeStack: GDN layers need each request's state slot");
    for (int b = 0; b < B; ++b)
      if (state_slots[b] >= std::min(l.gdn.conv.slots, l.gdn.ssm.slots))
        throw std::invalid_argument("DecodeStack: request " + std::to_string(b) + "'s state slot " +
                                    std::to_string(state_slots[b]) + " is outside the GDN state pools");
  }
  const size_t rows = static_cast<size_t>(B) * H_;
  bf16 *h = tl.h.get(rows), *residual = tl.residual.get(rows), *out = tl.out.get(rows);
  const PagedKV kv_rows{nullptr, 0, nullptr, 0, 0, req_to_token, ld_req};
  const bf16* layer_out = x;  // the previous layer's MoE output; the embeddings before layer 0
  for (int i = 0; i < num_layers(); ++i) {
    const DecoderLayer& l = layers_[i];
    // SGLang's input_layernorm: layer 0 takes the embeddings as its residual, later layers add the MoE output.
    norm(l.input_norm, B, H_, layer_out, i ? residual : nullptr, h, i ? residual : nullptr);
    if (!i) std::copy(x, x + rows, residual);
    if (l.is_gdn)
      gated_delta_net(l.gdn, B, h, state_slots, lora, out);
    else
      attention(l.attn, B, h, positions, kv_rows, req_pool_indices, seq_lens, cache_loc, lora, out);
    norm(l.post_norm, B, H_, out, residual, h, residual);
    moe_block(l.moe, B, h, slots, uniform_slot, lora, out);
    layer_out = out;
  }
  const bool any = num_layers() > 0;
  norm(final_norm_, B, H_, layer_out, any ? residual : nullptr, x, any ? residual : nullptr);
}

}  // namespace kt
