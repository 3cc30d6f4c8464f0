// The floating-point mode the kernels run in: denormals kept, neither flushed to zero (FTZ) nor read as zero (DAZ).
// A caller may have set either (torch.set_flush_denormal(True), a library built with -ffast-math); the fp8 shift
// decoders build subnormal e4m3 values as fp32 denormals before rescaling them, which those flags would zero.
// Held by the pool's workers for their lifetime and by a caller for the span of one parallel_for.
#pragma once
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace kt {

class ExactDenormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  ExactDenormals() : saved_(_mm_getcsr()) {
    constexpr unsigned kFlushToZero = 1u << 15, kDenormalsAreZero = 1u << 6;
    if (saved_ & (kFlushToZero | kDenormalsAreZero)) _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero));
  }
  ~ExactDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#else
  ExactDenormals() = default;
#endif
 public:
  ExactDenormals(const ExactDenormals&) = delete;
  ExactDenormals& operator=(const ExactDenormals&) = delete;
};

}  // namespace kt
