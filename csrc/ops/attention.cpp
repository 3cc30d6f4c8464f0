#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/prefetch.h"
#include "common/thread_pool.h"

namespace kt {

namespace {
constexpr int64_t kSerialMacs = 1 << 16;  // below this much work a call stays on the calling thread
constexpr int kMinSlice = 32, kMaxSlice = 512;
constexpr int64_t kStepBytes = 16 << 10;  // K (V) rows per step: all heads of them, read while they are in L1

struct Slice {  // context positions [j0, j1) of request b, every head
  int b, j0, j1;
};

// A slot's whole K (or V) row, every KV head, is contiguous; reading the slots of a step head after head keeps
// those rows in cache, and the next step's rows are fetched meanwhile (SGLang's slots need not be adjacent, and
// the hardware prefetchers stop at 4 KiB pages).
void prefetch_slots(const bf16* base, int64_t ld, const int32_t* slots, int n, int64_t row_values) {
  for (int s = 0; s < n; ++s) {
    const char* row = reinterpret_cast<const char*>(base + slots[s] * ld);
    for (int64_t b = 0; b < row_values * 2; b += 64) prefetch_l1(row + b);
  }
}

struct Shape {
  int Hkv, G, D, Dp, Dv, Dvp;
};

// One slice's partial softmax per query head: max m and sum l, unnormalised O [Dvp]; the slices of a request are
// merged in log-sum-exp form afterwards (flash-decoding). Qf [Hq][Dp] fp32, zero-padded; out: m [Hq], l [Hq],
// O [Hq][Dvp].
void attend_slice(const Slice& s, const Shape& sh, const float* Qf, const PagedKV& kv, const int32_t* slots,
                  const Kernels& k, float* m, float* l, float* O) {
  const int n = s.j1 - s.j0, Hq = sh.Hkv * sh.G;
  const int kStep = static_cast<int>(std::clamp<int64_t>(kStepBytes / (2 * sh.Hkv * std::max(sh.D, sh.Dv)), 8, 64));
  slots += s.j0;
  thread_local std::vector<float> S;
  S.resize(static_cast<size_t>(Hq) * n);
  for (int j = 0; j < n; j += kStep) {
    const int nj = std::min(kStep, n - j);
    prefetch_slots(kv.k, kv.ldk, slots + j + nj, std::min(kStep, n - j - nj), static_cast<int64_t>(sh.Hkv) * sh.D);
    for (int h = 0; h < sh.Hkv; ++h)
      k.attn_scores(nj, sh.G, sh.D, Qf + static_cast<int64_t>(h) * sh.G * sh.Dp, sh.Dp,
                    kv.k + static_cast<int64_t>(h) * sh.D, kv.ldk, slots + j, S.data() + h * sh.G * n + j, n);
  }
  for (int hq = 0; hq < Hq; ++hq) {
    float* row = S.data() + static_cast<int64_t>(hq) * n;
    m[hq] = *std::max_element(row, row + n);
    l[hq] = k.exp_shifted(n, row, m[hq]);
  }
  std::fill(O, O + static_cast<int64_t>(Hq) * sh.Dvp, 0.f);
  for (int j = 0; j < n; j += kStep) {
    const int nj = std::min(kStep, n - j);
    prefetch_slots(kv.v, kv.ldv, slots + j + nj, std::min(kStep, n - j - nj), static_cast<int64_t>(sh.Hkv) * sh.Dv);
    for (int h = 0; h < sh.Hkv; ++h)
      k.attn_values(nj, sh.G, sh.Dv, S.data() + h * sh.G * n + j, n, kv.v + static_cast<int64_t>(h) * sh.Dv, kv.ldv,
                    slots + j, O + static_cast<int64_t>(h) * sh.G * sh.Dvp, sh.Dvp);
  }
}

void store_new_rows(int B, int Hkv, int D, int Dv, const PagedKV& kv, const NewKV& fresh) {
  for (int b = 0; b < B; ++b)
    if (fresh.loc[b] < 0 || fresh.loc[b] >= kv.slots)
      throw std::out_of_range("decode attention: cache slot " + std::to_string(fresh.loc[b]) + " of request " +
                              std::to_string(b) + " is outside the pool's " + std::to_string(kv.slots) + " slots");
  for (int b = 0; b < B; ++b) {
    std::memcpy(kv.k + fresh.loc[b] * kv.ldk, fresh.k + b * fresh.ldk, sizeof(bf16) * Hkv * D);
    std::memcpy(kv.v + fresh.loc[b] * kv.ldv, fresh.v + b * fresh.ldv, sizeof(bf16) * Hkv * Dv);
  }
}
}  // namespace

void decode_attention(int B, int Hq, int Hkv, int D, int Dv, const bf16* q, int64_t ldq, const PagedKV& kv,
                      const NewKV* fresh, const int64_t* req_pool_indices, const int64_t* seq_lens, float scale,
                      bf16* out, int64_t ldo, const Kernels& k) {
  if (fresh) store_new_rows(B, Hkv, D, Dv, kv, *fresh);
  const Shape sh{Hkv, Hq / Hkv, D, (D + 7) / 8 * 8, Dv, (Dv + 7) / 8 * 8};
  auto pool = global_pool();
  int64_t total = 0;
  for (int b = 0; b < B; ++b) total += std::max<int64_t>(seq_lens[b], 0);
  // Slices long enough to amortise their merge, short enough that a request alone has two per thread. They depend
  // on the request's own length only, never on the rest of the batch: a request's output (and so a greedy token)
  // is the same whichever requests it is batched with.
  const int64_t per_request = 2 * static_cast<int64_t>(pool->num_threads());
  std::vector<Slice> slices;
  std::vector<int> first(B + 1);  // the slices of request b: [first[b], first[b + 1])
  for (int b = 0; b < B; ++b) {
    first[b] = static_cast<int>(slices.size());
    const int len = static_cast<int>(std::max<int64_t>(seq_lens[b], 0));
    const int64_t even = (len + per_request - 1) / per_request;
    const int slice = static_cast<int>(std::clamp<int64_t>((even + kMinSlice - 1) / kMinSlice * kMinSlice, kMinSlice,
                                                           kMaxSlice));
    for (int j0 = 0; j0 < len; j0 += slice) slices.push_back({b, j0, std::min(len, j0 + slice)});
  }
  first[B] = static_cast<int>(slices.size());
  const int64_t per = static_cast<int64_t>(Hq) * (sh.Dvp + 2);  // m, l, O of one slice
  std::vector<float> partial(slices.size() * per);

  auto run_slice = [&](int64_t i) {
    const Slice& s = slices[i];
    thread_local std::vector<float> qf;
    qf.assign(static_cast<size_t>(Hq) * sh.Dp, 0.f);
    const bf16* qb = q + s.b * ldq;
    for (int hq = 0; hq < Hq; ++hq)
      for (int d = 0; d < D; ++d) qf[hq * sh.Dp + d] = scale * bf16_to_f32(qb[hq * D + d]);
    float* p = partial.data() + i * per;
    attend_slice(s, sh, qf.data(), kv, kv.req_to_token + req_pool_indices[s.b] * kv.ld_req, k, p, p + Hq,
                 p + 2 * Hq);
  };
  auto merge = [&](int64_t b) {
    std::vector<float> acc(Dv);
    for (int hq = 0; hq < Hq; ++hq) {
      float mx = -INFINITY, sum = 0.f;
      for (int i = first[b]; i < first[b + 1]; ++i) mx = std::max(mx, partial[i * per + hq]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int i = first[b]; i < first[b + 1]; ++i) {
        const float* p = partial.data() + i * per;
        const float w = std::exp(p[hq] - mx);
        sum += w * p[Hq + hq];
        const float* O = p + 2 * Hq + static_cast<int64_t>(hq) * sh.Dvp;
        for (int d = 0; d < Dv; ++d) acc[d] += w * O[d];
      }
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a request of length 0 has no slices: zeros
      bf16* o = out + b * ldo + static_cast<int64_t>(hq) * Dv;
      for (int d = 0; d < Dv; ++d) o[d] = f32_to_bf16(acc[d] * inv);
    }
  };
  if (total * Hq * (D + Dv) < kSerialMacs) {
    for (int64_t i = 0; i < static_cast<int64_t>(slices.size()); ++i) run_slice(i);
    for (int64_t b = 0; b < B; ++b) merge(b);
    return;
  }
  ThreadPool::Busy busy(*pool);
  pool->parallel_for(static_cast<int64_t>(slices.size()), run_slice);
  pool->parallel_for(B, merge);
}

}  // namespace kt
