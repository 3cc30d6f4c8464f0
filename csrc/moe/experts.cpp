// MoEExperts state: memory, packed base weights, adapter slots. The calls live in moe/forward.cpp and
// moe/backward.cpp (overview in moe/experts_internal.h), routing in moe/route.cpp; the arithmetic in
// the per-ISA tables of isa/kernels.h.
#include "moe/experts.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/thread_pool.h"
#include "moe/experts_internal.h"

namespace kt {

namespace {

// fp32 values of the 256 e4m3 codes: decoding a checkpoint's fp8 experts is one lookup per element.
const float* e4m3_table() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = e4m3_to_f32(static_cast<uint8_t>(b));
    return t;
  }();
  return table.data();
}

// Packs one matrix of every expert: N × K values at src + e·estride (bf16 or e4m3 + block scales).
void pack_matrix(PackedWeights& W, const char* what, const ExpertWeights& w, const void* src, int64_t estride,
                 const float* scale, int64_t sstride) {
  const int K = W.K, bn = w.block_n, bk = w.block_k;
  const int64_t ld_scale = (K + bk - 1) / bk;
  global_pool()->parallel_for(W.E, [&](int64_t e) {
    const int ei = static_cast<int>(e);
    if (!w.fp8) {
      const bf16* p = static_cast<const bf16*>(src) + e * estride;
      W.pack(ei, [&](int n, float* row) { bf16_row_to_f32(p + static_cast<int64_t>(n) * K, K, row); });
      return;
    }
    const uint8_t* p = static_cast<const uint8_t*>(src) + e * estride;
    const float* s = scale + e * sstride;
    if (W.layout.fmt == Format::fp8) return W.pack_fp8(ei, p, K, s, ld_scale, bn, what);
    const float* lut = e4m3_table();
    W.pack(ei, [&](int n, float* row) {
      const uint8_t* q = p + static_cast<int64_t>(n) * K;
      const float* block_scale = s + (n / bn) * ld_scale;
      for (int k0 = 0; k0 < K; k0 += bk) {
        const float scale_k = block_scale[k0 / bk];
        for (int k = k0; k < std::min(K, k0 + bk); ++k) row[k] = lut[q[k]] * scale_k;
      }
    });
  });
}

}  // namespace

MoEExperts::MoEExperts(int E, int H, int I, const ExpertWeights& w, Format fmt, int group, int max_tokens, int max_slots,
                 const Kernels& kernels)
    : E_(E), H_(H), I_(I), max_tokens_(max_tokens), k_(kernels) {
  if (E < 1 || H < 1 || I < 1) fail("num_experts, hidden and intermediate sizes must be >= 1");
  if (max_slots < 1) fail("max_slots must be >= 1");  // before packing: a bad argument costs no minutes
  if (!w.gate || !w.up || !w.down) fail("gate, up and down weights are required");
  if (w.fp8) {
    if (!w.gate_scale || !w.up_scale || !w.down_scale) fail("fp8 weights need their block scales");
    if (w.block_n < 1 || w.block_k < 1) fail("fp8 weight blocks must be >= 1 × 1");
    if (fmt == Format::fp8) group = w.block_k;  // the checkpoint's K blocks become the scale groups
  }
  gate_.init(E, I, H, fmt, group);
  up_.init(E, I, H, fmt, group);
  down_.init(E, H, I, fmt, group);
  pack_matrix(gate_, "gate_proj", w, w.gate, w.gate_estride, w.gate_scale, w.gate_sstride);
  pack_matrix(up_, "up_proj", w, w.up, w.up_estride, w.up_scale, w.up_sstride);
  pack_matrix(down_, "down_proj", w, w.down, w.down_estride, w.down_scale, w.down_sstride);
  init_slots(max_slots);
}

MoEExperts::MoEExperts(int E, int H, int I, Format fmt, int group, int max_tokens, int max_slots, const Kernels& kernels)
    : E_(E), H_(H), I_(I), max_tokens_(max_tokens), k_(kernels) {
  if (E < 1 || H < 1 || I < 1) fail("num_experts, hidden and intermediate sizes must be >= 1");
  gate_.init(E, I, H, fmt, group);
  up_.init(E, I, H, fmt, group);
  down_.init(E, H, I, fmt, group);
  init_slots(max_slots);
}

void MoEExperts::init_slots(int max_slots) {
  if (max_slots < 1) fail("max_slots must be >= 1");
  slots_.resize(max_slots);
  grads_.resize(max_slots);
}

std::vector<std::pair<uint8_t*, size_t>> MoEExperts::packed_regions() {
  std::vector<std::pair<uint8_t*, size_t>> out;
  for (PackedWeights* W : {&gate_, &up_, &down_})
    out.emplace_back(W->data.data(), static_cast<size_t>(W->E) * W->nblocks * W->layout.block_bytes());
  for (PackedWeights* W : {&gate_, &up_, &down_})
    if (W->layout.fmt != Format::bf16)
      out.emplace_back(reinterpret_cast<uint8_t*>(W->scales.data()),
                       static_cast<size_t>(W->E) * W->nblocks * W->layout.block_scales() * sizeof(float));
  return out;
}

MoEExperts::~MoEExperts() = default;

void MoEExperts::dequantize(int proj, float* out) const {
  if (proj < 0 || proj > 2) fail("proj must be 0 (gate), 1 (up) or 2 (down)");
  const PackedWeights& W = proj == 0 ? gate_ : proj == 1 ? up_ : down_;
  global_pool()->parallel_for(E_, [&](int64_t e) {
    float* o = out + e * W.N * W.K;
    for (int n = 0; n < W.N; ++n)
      for (int k = 0; k < W.K; ++k) o[static_cast<int64_t>(n) * W.K + k] = W.at(static_cast<int>(e), n, k);
  });
}

void MoEExperts::check_slot(int slot) const {
  if (slot < 0 || slot >= static_cast<int>(slots_.size()))
    fail("slot " + std::to_string(slot) + " out of range 0.." + std::to_string(slots_.size() - 1));
}

void MoEExperts::set_adapter(int slot, int r, float alpha, const bf16* ga, const bf16* gb, const bf16* ua,
                          const bf16* ub, const bf16* da, const bf16* db) {
  check_slot(slot);
  if (r < 1) fail("LoRA rank must be >= 1");
  std::shared_ptr<Adapter> a;
  {
    // An adapter pool replaces an evicted adapter with the next one, mostly of the same rank: when no call holds the
    // old one, its buffers are rewritten in place (no new allocation, no page faults on the copy). The slot reads
    // empty until the new adapter is in; a call in flight holding the old one makes this a fresh allocation.
    std::lock_guard<std::mutex> lk(slots_mutex_);
    if (slots_[slot] && slots_[slot].use_count() == 1 && slots_[slot]->rank == r)
      a = std::const_pointer_cast<Adapter>(std::move(slots_[slot]));
  }
  if (!a) a = std::make_shared<Adapter>();
  a->rank = r;
  a->scale = alpha / static_cast<float>(r);
  // A [E, r, in] kept as is; B [E, out, r] stored transposed as [E, r, out].
  auto copy_a = [&](std::vector<bf16>& dst, const bf16* src, int in) {
    dst.assign(src, src + static_cast<size_t>(E_) * r * in);
  };
  auto copy_bt = [&](std::vector<bf16>& dst, const bf16* src, int out) {
    dst.resize(static_cast<size_t>(E_) * r * out);
    for (int e = 0; e < E_; ++e)
      for (int n = 0; n < out; ++n)
        for (int j = 0; j < r; ++j)
          dst[(static_cast<size_t>(e) * r + j) * out + n] = src[(static_cast<size_t>(e) * out + n) * r + j];
  };
  copy_a(a->gate_a, ga, H_);
  copy_bt(a->gate_bt, gb, I_);
  copy_a(a->up_a, ua, H_);
  copy_bt(a->up_bt, ub, I_);
  copy_a(a->down_a, da, I_);
  copy_bt(a->down_bt, db, H_);
  std::lock_guard<std::mutex> lk(slots_mutex_);
  slots_[slot] = std::move(a);  // calls in flight keep the previous adapter alive through Route::keep
}

void MoEExperts::remove_adapter(int slot) {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(slots_mutex_);
  slots_[slot].reset();
}

bool MoEExperts::has_adapter(int slot) const {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(slots_mutex_);
  return static_cast<bool>(slots_[slot]);
}

void MoEExperts::release_saved() {
  std::lock_guard<std::mutex> lk(saved_mutex_);
  if (saved_ && saved_->pending) fail("release_saved: a forward's state is still waiting for its backward");
  saved_.reset();
}

void MoEExperts::set_grad_buffers(int slot, const GradBuffers& g) {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(slots_mutex_);
  grads_[slot] = g;
}

}  // namespace kt
