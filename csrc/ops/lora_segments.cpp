#include "ops/lora_segments.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/buffer.h"
#include "common/thread_pool.h"

namespace kt {

namespace {

constexpr int kRows = 16;  // tokens per task

struct Task {
  int t0, rows, adapter;
};

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("lora segments: " + what); }

// Row chunks of the segments whose adapter has a LoRA (rank > 0), each rank at most max_rank.
std::vector<Task> tasks_of(const LoRASegments& s, int T, int max_rank) {
  std::vector<Task> tasks;
  int t = 0;
  for (int i = 0; i < s.n; ++i) {
    const int len = s.seg_lens[i], a = s.weight_indices[i];
    if (len < 0 || t + len > T) fail("seg_lens add up to more than the " + std::to_string(T) + " tokens");
    if (a < 0 || a >= s.adapters)
      fail("weight_indices[" + std::to_string(i) + "] = " + std::to_string(a) + ", expected 0.." +
           std::to_string(s.adapters - 1));
    if (s.ranks[a] > max_rank)
      fail("ranks[" + std::to_string(a) + "] = " + std::to_string(s.ranks[a]) + ", the weights hold rank " +
           std::to_string(max_rank));
    if (s.ranks[a] > 0)
      for (int r = 0; r < len; r += kRows) tasks.push_back({t + r, std::min(kRows, len - r), a});
    t += len;
  }
  return tasks;
}

void run(const std::vector<Task>& tasks, const std::function<void(const Task&)>& fn) {
  if (tasks.size() == 1) return fn(tasks[0]);
  global_pool()->parallel_for(static_cast<int64_t>(tasks.size()), [&](int64_t i) { fn(tasks[i]); });
}

thread_local Buffer<float> tl_acc;  // per worker: one task's fp32 products

}  // namespace

void lora_shrink(const Kernels& k, const LoRASegments& s, int T, int K, const bf16* x, int64_t ldx, const bf16* W,
                 int w_rows, int slices, bf16* out, int64_t ldo) {
  if (slices < 1 || w_rows % slices) fail(std::to_string(w_rows) + " weight rows for " + std::to_string(slices) + " slices");
  const auto tasks = tasks_of(s, T, w_rows / slices);
  for (int t = 0; t < T; ++t) std::memset(out + t * ldo, 0, sizeof(bf16) * w_rows);
  if (tasks.empty()) return;
  run(tasks, [&](const Task& task) {
    const int n = slices * s.ranks[task.adapter];
    const float scale = s.scalings[task.adapter];
    float* acc = tl_acc.get(static_cast<size_t>(task.rows) * n);
    k.lora_a_bf16(task.rows, x + task.t0 * ldx, ldx, W + static_cast<int64_t>(task.adapter) * w_rows * K, n, K, acc,
                  n);
    for (int m = 0; m < task.rows; ++m)
      for (int j = 0; j < n; ++j) out[(task.t0 + m) * ldo + j] = f32_to_bf16(scale * acc[m * n + j]);
  });
}

void lora_expand(const Kernels& k, const LoRASegments& s, int T, const bf16* a, int64_t lda, const bf16* W,
                 int64_t w_rows, int max_rank, const int32_t* off, int slices, bf16* y, int64_t ldy) {
  if (slices < 1 || off[0] != 0) fail("slice offsets must start at 0");
  for (int i = 0; i < slices; ++i)
    if (off[i + 1] < off[i]) fail("slice offsets must not fall");
  if (off[slices] > w_rows) fail("slice offsets reach past the weights' " + std::to_string(w_rows) + " rows");
  if (static_cast<int64_t>(slices) * max_rank > lda) fail("the shrink output has fewer columns than the slices' ranks");
  const auto tasks = tasks_of(s, T, max_rank);
  if (tasks.empty()) return;
  run(tasks, [&](const Task& task) {
    const int r = s.ranks[task.adapter];
    const bf16* Wa = W + static_cast<int64_t>(task.adapter) * w_rows * max_rank;
    for (int i = 0; i < slices; ++i) {
      const int n = static_cast<int>(off[i + 1] - off[i]);
      float* acc = tl_acc.get(static_cast<size_t>(task.rows) * n);
      const bf16* Ws = Wa + static_cast<int64_t>(off[i]) * max_rank;
      const bf16* A = a + task.t0 * lda + static_cast<int64_t>(i) * r;
      if (r == max_rank) {  // the slice's rows are dense: [n, r]
        k.lora_a_bf16(task.rows, A, lda, Ws, n, r, acc, n);
      } else {  // a lower-rank adapter in a pool sized for max_rank: its rows are max_rank apart
        for (int m = 0; m < task.rows; ++m)
          for (int c = 0; c < n; ++c) {
            float d = 0.f;
            for (int j = 0; j < r; ++j) d += bf16_to_f32(A[m * lda + j]) * bf16_to_f32(Ws[c * max_rank + j]);
            acc[m * n + c] = d;
          }
      }
      for (int m = 0; m < task.rows; ++m) {
        bf16* yr = y + (task.t0 + m) * ldy + off[i];
        for (int c = 0; c < n; ++c) yr[c] = f32_to_bf16(bf16_to_f32(yr[c]) + acc[m * n + c]);
      }
    }
  });
}

}  // namespace kt
