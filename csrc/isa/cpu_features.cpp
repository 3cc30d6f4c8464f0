// The one place that decides which kernel table runs: CPU feature bits plus OS support for the ymm/zmm state.
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "isa/kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kt {

// Each detector runs cpuid once: in a VM cpuid traps to the hypervisor (tens of microseconds), and the tables are
// looked up by calls made many times a decode step.
bool cpu_has_avx2_fma() {
  static const bool ok = []() -> bool {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d)) return false;
    if (!(c & (1u << 12)) || !(c & (1u << 27)) || !(c & (1u << 28))) return false;  // FMA, OSXSAVE, AVX
    unsigned xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & 0x6u) != 0x6u) return false;  // OS saves XMM/YMM state
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return b & (1u << 5);  // AVX2
#else
    return false;
#endif
  }();
  return ok;
}

bool cpu_has_avx512_bf16() {
  static const bool ok = []() -> bool {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
    unsigned xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & 0xe6u) != 0xe6u) return false;  // OS saves XMM/YMM/opmask/ZMM state
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
    const bool vnni = c & (1u << 11);  // every AVX512-BF16 CPU has it (Cooper Lake, Sapphire Rapids, Zen 4)
    if (!(f && dq && bw && vl && vnni)) return false;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    // AVX512_BF16 (with F, DQ, BW, VL and VNNI, the flags isa/avx512/kernels_bf16.cpp is built with)
    return a & (1u << 5);
#else
    return false;
#endif
  }();
  return ok;
}

bool cpu_has_avx512_vbmi() {
  static const bool ok = []() -> bool {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!cpu_has_avx512_bf16() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return c & (1u << 1);  // AVX512_VBMI
#else
    return false;
#endif
  }();
  return ok;
}

bool fp8_lanes_decoder() {
  const char* env = std::getenv("KT_SERVE_FP8_DECODER");
  if (env && *env) {
    const std::string want = env;
    if (want != "lanes" && want != "lookup")
      throw std::invalid_argument("KT_SERVE_FP8_DECODER: expected lanes or lookup, got '" + want + "'");
    return want == "lanes";
  }
  static const bool intel = []() -> bool {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    return b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e;  // vendor "GenuineIntel"
#else
    return false;
#endif
  }();
  return intel;
}

bool cpu_has_amx_bf16() {
#if defined(__x86_64__) && defined(SYS_arch_prctl)
  static const bool ok = []() -> bool {
    if (!cpu_has_avx512_bf16()) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;  // AMX-BF16, AMX-TILE
    unsigned xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;  // OS manages XTILECFG/XTILEDATA
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // Linux >= 5.16: ask before the first tile use
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
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
  const Kernels* avx512 = cpu_has_avx512_bf16() ? kernels_avx512_bf16() : nullptr;
  const Kernels* amx = avx512 && kernels_amx_bf16() && cpu_has_amx_bf16() ? kernels_amx_bf16() : nullptr;
  const Kernels* avx2 = cpu_has_avx2_fma() ? kernels_avx2() : nullptr;
  if (want == "auto") return amx ? *amx : avx512 ? *avx512 : avx2 ? *avx2 : kernels_portable();
  if (want == "avx2" || want == "avx512_bf16" || want == "amx_bf16") {
    const Kernels* k = want == "amx_bf16" ? amx : want == "avx512_bf16" ? avx512 : avx2;
    if (!k) throw std::invalid_argument("isa '" + want + "' requested but this CPU/OS/build lacks it");
    return *k;
  }
  throw std::invalid_argument("unknown isa '" + want + "' (expected auto, portable, avx2, avx512_bf16 or amx_bf16)");
}

}  // namespace kt

namespace kt {
#ifndef KT_HAVE_AVX512_BF16
const Kernels* kernels_avx512_bf16() { return nullptr; }  // not built for this architecture/compiler
#endif
#ifndef KT_HAVE_AMX_BF16
const Kernels* kernels_amx_bf16() { return nullptr; }
#endif
#ifndef KT_HAVE_AVX512_VBMI
bool kernels_avx512_vbmi_built() { return false; }
#endif
#ifndef KT_HAVE_AVX2
const Kernels* kernels_avx2() { return nullptr; }
#endif
}  // namespace kt
