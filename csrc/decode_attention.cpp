#include "decode_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "thread_pool.h"

namespace kt {

namespace {
constexpr int64_t kSerialMacs = 1 << 16;  // below this much work a call stays on the calling thread
constexpr int kMinSlice = 32, kMaxSlice = 512;

struct Slice {  // context positions [j0, j1) of KV head h of request b
  int b, h, j0, j1;
};

// The slice's partial softmax: running max m and sum l per query head, unnormalised O [G][Dv]; slices of one
// (request, head) are merged in log-sum-exp form afterwards (flash-decoding).
void attend_slice(const Slice& s, int G, int D, int Dv, const float* Qf, const PagedKV& kv, const int32_t* slots,
                  const Kernels& k, float* m, float* l, float* O) {
  const int n = s.j1 - s.j0;
  thread_local std::vector<float> S;
  S.resize(static_cast<size_t>(G) * n);
  k.attn_scores(n, G, D, Qf, kv.k + static_cast<int64_t>(s.h) * D, kv.ldk, slots + s.j0, S.data(), n);
  for (int g = 0; g < G; ++g) {
    float* row = S.data() + static_cast<int64_t>(g) * n;
    m[g] = *std::max_element(row, row + n);
    l[g] = k.exp_shifted(n, row, m[g]);
  }
  std::fill(O, O + static_cast<int64_t>(G) * Dv, 0.f);
  k.attn_values(n, G, Dv, S.data(), n, kv.v + static_cast<int64_t>(s.h) * Dv, kv.ldv, slots + s.j0, O);
}
}  // namespace

void decode_attention(int B, int Hq, int Hkv, int D, int Dv, const bf16* q, int64_t ldq, const PagedKV& kv,
                      const int64_t* req_pool_indices, const int64_t* seq_lens, float scale, bf16* out, int64_t ldo,
                      const Kernels& k) {
  const int G = Hq / Hkv;
  auto pool = global_pool();
  int64_t total = 0;
  for (int b = 0; b < B; ++b) total += std::max<int64_t>(seq_lens[b], 0);
  // Slices long enough to amortise their merge, short enough that there are a few per thread.
  const int64_t target = 4 * static_cast<int64_t>(pool->num_threads());
  const int slice = static_cast<int>(std::clamp<int64_t>((total * Hkv + target - 1) / target, kMinSlice, kMaxSlice));
  std::vector<Slice> slices;
  std::vector<int> first(static_cast<size_t>(B) * Hkv + 1);  // slices of (b, h): [first[bh], first[bh + 1])
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hkv; ++h) {
      first[static_cast<size_t>(b) * Hkv + h] = static_cast<int>(slices.size());
      const int len = static_cast<int>(std::max<int64_t>(seq_lens[b], 0));
      for (int j0 = 0; j0 < len; j0 += slice) slices.push_back({b, h, j0, std::min(len, j0 + slice)});
    }
  first.back() = static_cast<int>(slices.size());
  const int64_t per = static_cast<int64_t>(G) * (Dv + 2);  // m, l, O of one slice
  std::vector<float> partial(slices.size() * per);

  auto run_slice = [&](int64_t i) {
    const Slice& s = slices[i];
    thread_local std::vector<float> qf;
    qf.resize(static_cast<size_t>(G) * D);
    const bf16* qb = q + s.b * ldq + static_cast<int64_t>(s.h) * G * D;
    for (int64_t i2 = 0; i2 < static_cast<int64_t>(G) * D; ++i2) qf[i2] = scale * bf16_to_f32(qb[i2]);
    const int32_t* slots = kv.req_to_token + req_pool_indices[s.b] * kv.ld_req;
    float* p = partial.data() + i * per;
    attend_slice(s, G, D, Dv, qf.data(), kv, slots, k, p, p + G, p + 2 * G);
  };
  auto merge = [&](int64_t bh) {
    const int b = static_cast<int>(bh / Hkv), h = static_cast<int>(bh % Hkv);
    for (int g = 0; g < G; ++g) {
      bf16* o = out + b * ldo + (static_cast<int64_t>(h) * G + g) * Dv;
      float mx = -INFINITY;
      for (int i = first[bh]; i < first[bh + 1]; ++i) mx = std::max(mx, partial[i * per + g]);
      float acc[kMaxHeadDim] = {0.f}, sum = 0.f;
      for (int i = first[bh]; i < first[bh + 1]; ++i) {
        const float* p = partial.data() + i * per;
        const float w = std::exp(p[g] - mx);
        sum += w * p[G + g];
        const float* O = p + 2 * G + static_cast<int64_t>(g) * Dv;
        for (int d = 0; d < Dv; ++d) acc[d] += w * O[d];
      }
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int d = 0; d < Dv; ++d) o[d] = f32_to_bf16(acc[d] * inv);
    }
  };
  if (total * Hq * (D + Dv) < kSerialMacs) {
    for (int64_t i = 0; i < static_cast<int64_t>(slices.size()); ++i) run_slice(i);
    for (int64_t bh = 0; bh < static_cast<int64_t>(B) * Hkv; ++bh) merge(bh);
    return;
  }
  ThreadPool::Busy busy(*pool);
  pool->parallel_for(static_cast<int64_t>(slices.size()), run_slice);
  pool->parallel_for(static_cast<int64_t>(B) * Hkv, merge);
}

}  // namespace kt
