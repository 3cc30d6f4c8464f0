// prefault(): one memset task per 2 MiB. checksum(): four independent multiply-xor lanes per chunk (so the multiplies overlap), chunks in parallel.
#include "common/checksum.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/thread_pool.h"

namespace kt {

namespace {

constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;  // odd: multiplying by it is a bijection, so no word is lost
constexpr size_t kChunk = size_t(4) << 20;

inline uint64_t mix(uint64_t h) {
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 29);
}

uint64_t chunk_hash(const uint8_t* p, size_t n) {
  uint64_t lane[4] = {1, 2, 3, 4};
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      lane[l] = (lane[l] ^ w) * kMul;
    }
  uint64_t tail[4] = {0, 0, 0, 0};
  std::memcpy(tail, p + i, n - i);
  for (int l = 0; l < 4; ++l) lane[l] = (lane[l] ^ tail[l]) * kMul;
  return mix(lane[0] ^ mix(lane[1] ^ mix(lane[2] ^ mix(lane[3] ^ n))));
}

}  // namespace

uint64_t checksum(const uint8_t* p, size_t n) {
  const int64_t chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
  std::vector<uint64_t> h(chunks);
  global_pool()->parallel_for(chunks, [&](int64_t c) {
    const size_t begin = static_cast<size_t>(c) * kChunk;
    h[c] = chunk_hash(p + begin, std::min(kChunk, n - begin));
  });
  uint64_t total = mix(n);
  for (uint64_t v : h) total = mix(total ^ v) * kMul;
  return total;
}

void prefault(uint8_t* p, size_t n) {
  constexpr size_t kPage = size_t(2) << 20;
  global_pool()->parallel_for(static_cast<int64_t>((n + kPage - 1) / kPage), [&](int64_t i) {
    const size_t begin = static_cast<size_t>(i) * kPage;
    std::memset(p + begin, 0, std::min(kPage, n - begin));
  });
}

}  // namespace kt
