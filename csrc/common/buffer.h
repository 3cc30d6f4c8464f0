// An aligned, zero-initialised array that is reused across calls (grows, never shrinks; freed with its owner).
// Arrays of 2 MiB or more are mapped from the OS on 2 MiB boundaries with transparent huge pages asked for.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kt {

template <typename T>
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { release(); }
  T* get(size_t n);  // at least n elements, contents unspecified (zeroed on growth)
  T* data() const { return p_; }
  size_t bytes() const { return bytes_; }
  void release();

 private:
  T* p_ = nullptr;
  size_t cap_ = 0, bytes_ = 0;
};

}  // namespace kt
