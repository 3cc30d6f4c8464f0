// Buffer: aligned, zeroed, reusable arrays (large ones mapped from the OS, see alloc_zeroed).
#include "common/buffer.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kt {

namespace {

inline int64_t round_up64(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

constexpr size_t kHuge = size_t(2) << 20;

// Zeroed memory; arrays of 2 MiB or more (packed weights, large scratch) are mapped from the OS, 2 MiB-aligned
// and asked for transparent huge pages, so streaming weights walks one TLB entry per 2 MiB rather than per 4 KiB
// (about 15% more read bandwidth on the machines measured, see evals/bench_kernel.py), and freeing them gives
// the memory back to the OS at once (malloc would keep it, and a checkpointed layer's saved state would then
// stay resident after its backward). Returns the rounded-up size.
void* alloc_zeroed(size_t& bytes) {
  // Rounded first, so that free_zeroed, which sees only the rounded size, tells the two kinds apart the same way.
  bytes = static_cast<size_t>(round_up64(static_cast<int64_t>(bytes), 64));
#if defined(__linux__)
  if (bytes >= kHuge) {
    bytes = static_cast<size_t>(round_up64(static_cast<int64_t>(bytes), static_cast<int64_t>(kHuge)));
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

template class Buffer<uint16_t>;
template class Buffer<float>;
template class Buffer<uint8_t>;
template class Buffer<int16_t>;
template class Buffer<int32_t>;

}  // namespace kt
