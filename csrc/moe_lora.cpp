// MoELoRA state: memory, packed base weights, adapter slots. The calls live in moe_lora_forward.cpp and
// moe_lora_backward.cpp (overview in moe_lora_internal.h), routing in moe_lora_route.cpp; the arithmetic in
// the per-ISA tables of kernels.h.
#include "moe_lora.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "moe_lora_internal.h"
#include "thread_pool.h"

namespace kt {

namespace {

constexpr size_t kHuge = size_t(2) << 20;

// Zeroed memory; arrays of 2 MiB or more (packed weights, large scratch) are mapped from the OS, 2 MiB-aligned
// and asked for transparent huge pages, so streaming weights walks one TLB entry per 2 MiB rather than per 4 KiB
// (about 15% more read bandwidth on the machines measured, see evals/bench_kernel.py), and freeing them gives
// the memory back to the OS at once (malloc would keep it, and a checkpointed layer's saved state would then
// stay resident after its backward). Returns the rounded-up size.
void* alloc_zeroed(size_t& bytes) {
  // Rounded first, so that free_zeroed, which sees only the rounded size, tells the two kinds apart the same way.
  bytes = static_cast<size_t>(round_up(static_cast<int64_t>(bytes), 64));
#if defined(__linux__)
  if (bytes >= kHuge) {
    bytes = static_cast<size_t>(round_up(static_cast<int64_t>(bytes), static_cast<int64_t>(kHuge)));
    const size_t mapped = bytes + kHuge;
    void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (begin + kHuge - 1) & ~(kHuge - 1);
    if (aligned > begin) munmap(raw, aligned - begin);
    if (begin + mapped > aligned + bytes) munmap(reinterpret_cast<void*>(aligned + bytes), begin + mapped - aligned - bytes);
#ifdef MADV_HUGEPAGE
    madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);  // only a hint: a no-op where THP is off
#endif
    return reinterpret_cast<void*>(aligned);  // anonymous pages read as zero
  }
#endif
  void* p = std::aligned_alloc(64, bytes);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return p;
}

void free_zeroed(void* p, size_t bytes) {
#if defined(__linux__)
  if (bytes >= kHuge) {
    munmap(p, bytes);
    return;
  }
#endif
  std::free(p);
}

}  // namespace

template <typename T>
T* Buffer<T>::get(size_t n) {
  if (n > cap_ || !p_) {
    release();
    size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
    p_ = static_cast<T*>(alloc_zeroed(bytes));
    bytes_ = bytes;
    cap_ = bytes / sizeof(T);
  }
  return p_;
}

template <typename T>
void Buffer<T>::release() {
  if (p_) free_zeroed(p_, bytes_);
  p_ = nullptr;
  cap_ = bytes_ = 0;
}

template class Buffer<bf16>;
template class Buffer<float>;

void PackedWeights::init(int E_, int N_, int K_) {
  E = E_, N = N_, K = K_;
  kp = static_cast<int>(round_up(K, 32));  // K steps of 32: one AMX tile row; input rows are padded to match
  nblocks = ceil_div(N, kBlockN);
  block_elems = static_cast<size_t>(kp) * kBlockN;
  data.get(static_cast<size_t>(E) * nblocks * block_elems);
}

MoELoRA::MoELoRA(int E, int H, int I, const bf16* gate, int64_t gate_es, const bf16* up, int64_t up_es,
                 const bf16* down, int64_t down_es, int max_tokens, int max_slots, const Kernels& kernels)
    : E_(E), H_(H), I_(I), max_tokens_(max_tokens), k_(kernels) {
  if (E < 1 || H < 1 || I < 1) fail("num_experts, hidden and intermediate sizes must be >= 1");
  if (max_slots < 1) fail("max_slots must be >= 1");
  gate_.init(E, I, H);
  up_.init(E, I, H);
  down_.init(E, H, I);
  global_pool()->parallel_for(E, [&](int64_t e) {
    gate_.pack(static_cast<int>(e), [&](int n, int k) { return gate[e * gate_es + static_cast<int64_t>(n) * H + k]; });
    up_.pack(static_cast<int>(e), [&](int n, int k) { return up[e * up_es + static_cast<int64_t>(n) * H + k]; });
    down_.pack(static_cast<int>(e), [&](int n, int k) { return down[e * down_es + static_cast<int64_t>(n) * I + k]; });
  });
  slots_.resize(max_slots);
  grads_.resize(max_slots);
}

MoELoRA::~MoELoRA() = default;

void MoELoRA::check_slot(int slot) const {
  if (slot < 0 || slot >= static_cast<int>(slots_.size()))
    fail("slot " + std::to_string(slot) + " out of range 0.." + std::to_string(slots_.size() - 1));
}

void MoELoRA::set_adapter(int slot, int r, float alpha, const bf16* ga, const bf16* gb, const bf16* ua,
                          const bf16* ub, const bf16* da, const bf16* db) {
  check_slot(slot);
  if (r < 1) fail("LoRA rank must be >= 1");
  auto a = std::make_shared<Adapter>();
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

void MoELoRA::remove_adapter(int slot) {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(slots_mutex_);
  slots_[slot].reset();
}

bool MoELoRA::has_adapter(int slot) const {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(slots_mutex_);
  return static_cast<bool>(slots_[slot]);
}

void MoELoRA::release_saved() {
  std::lock_guard<std::mutex> lk(saved_mutex_);
  if (saved_ && saved_->pending) fail("release_saved: a forward's state is still waiting for its backward");
  saved_.reset();
}

void MoELoRA::set_grad_buffers(int slot, const GradBuffers& g) {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(slots_mutex_);
  grads_[slot] = g;
}

void MoELoRA::ensure_backward_weights() {
  std::lock_guard<std::mutex> lk(backward_weights_mutex_);
  if (have_backward_weights_) return;
  const int kpI = static_cast<int>(round_up(I_, 2));
  down_t_.init(E_, I_, H_);
  gate_up_t_.init(E_, H_, 2 * kpI);
  global_pool()->parallel_for(E_, [&](int64_t e64) {
    const int e = static_cast<int>(e64);
    down_t_.pack(e, [&](int n, int k) { return down_.at(e, k, n); });
    gate_up_t_.pack(e, [&](int n, int k) {
      if (k < I_) return gate_.at(e, k, n);
      if (k >= kpI && k < kpI + I_) return up_.at(e, k - kpI, n);
      return bf16(0);
    });
  });
  have_backward_weights_ = true;
}

}  // namespace kt
