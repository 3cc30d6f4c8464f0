// Software prefetches as asm statements. GCC's dead-code elimination drops a __builtin_prefetch whose loop has
// no other effect: it removed every LoRA-B prefetch of moe/forward.cpp (0 prefetch instructions in the
// object at -O1 to -O3) while identical code elsewhere kept its own. An asm volatile cannot be dropped.
#pragma once

namespace kt {

inline void prefetch_l1(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

inline void prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

}  // namespace kt
