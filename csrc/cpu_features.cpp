// The one place that decides which kernel table runs: CPU feature bits plus OS support for the zmm state.
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace kt {

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  unsigned xcr0_lo, xcr0_hi;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & 0xe6u) != 0xe6u) return false;  // OS saves XMM/YMM/opmask/ZMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool f = b & (1u << 16), bw = b & (1u << 30), vl = b & (1u << 31);
  if (!(f && bw && vl)) return false;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return a & (1u << 5);  // AVX512_BF16
#else
  return false;
#endif
}

const Kernels& select_kernels(const char* requested) {
  std::string want = requested && *requested ? requested : "auto";
  if (want == "auto") {
    const char* env = std::getenv("KT_SERVE_ISA");
    if (env && *env) want = env;
  }
  if (want == "portable") return kernels_portable();
  const Kernels* fast = cpu_has_avx512_bf16() ? kernels_avx512_bf16() : nullptr;
  if (want == "auto") return fast ? *fast : kernels_portable();
  if (want == "avx512_bf16") {
    if (!fast) throw std::invalid_argument("isa 'avx512_bf16' requested but this CPU/OS lacks AVX512-BF16");
    return *fast;
  }
  throw std::invalid_argument("unknown isa '" + want + "' (expected auto, portable or avx512_bf16)");
}

}  // namespace kt

#ifndef KT_HAVE_AVX512_BF16
namespace kt {
const Kernels* kernels_avx512_bf16() { return nullptr; }  // not built for this architecture
}  // namespace kt
#endif
