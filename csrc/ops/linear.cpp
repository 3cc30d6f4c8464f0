#include "ops/linear.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "common/buffer.h"
#include "common/thread_pool.h"

namespace kt {

namespace {

constexpr int kRowChunk = 64;  // rows per task of a many-row call (gemm_block takes up to 64 of a quantized block)

// The call's input rows, padded to kp with zeros (the gemm_block contract), and their int16 form for the
// integer formats. Per calling thread: one server thread calls many layers in turn.
struct Scratch {
  Buffer<bf16> x;
  QuantizedRows xq;
};
thread_local Scratch tl_scratch;
thread_local Buffer<float> tl_out;  // per worker: one task's fp32 tile [rows][64] (two for a pair)

}  // namespace

PackedLinear::PackedLinear(int N, int K, const bf16* w, int64_t ldw, Format fmt, int group, const Kernels& kern)
    : k_(kern) {
  if (N <= 0 || K <= 0) throw std::invalid_argument("dense linear: N and K must be positive");
  if (ldw < K) throw std::invalid_argument("dense linear: ldw must be at least K");
  w_.init(1, N, K, fmt, group);
  global_pool()->parallel_for(w_.nblocks, [&](int64_t b) {
    w_.pack_block(0, static_cast<int>(b), [&](int n, float* row) { bf16_row_to_f32(w + static_cast<int64_t>(n) * ldw, K, row); });
  });
}

void PackedLinear::forward(int M, const bf16* x, int64_t ldx, const float* bias, void* y, int64_t ldy,
                          bool y_fp32) const {
  if (M <= 0) return;
  const int N = w_.N, K = w_.K, kp = w_.kp(), nb = w_.nblocks;
  // Rows as given when they already hold kp values; else copied with their zero padding.
  const bf16* A = x;
  int64_t lda = ldx;
  if (K != kp) {
    bf16* p = tl_scratch.x.get(static_cast<size_t>(M) * kp);
    for (int m = 0; m < M; ++m) {
      std::memcpy(p + static_cast<int64_t>(m) * kp, x + m * ldx, sizeof(bf16) * K);
      std::memset(p + static_cast<int64_t>(m) * kp + K, 0, sizeof(bf16) * (kp - K));
    }
    A = p, lda = kp;
  }
  const bool quantized_rows = w_.layout.integer();
  QuantizedRows& xq = tl_scratch.xq;
  if (quantized_rows) {
    xq.reserve(M, kp);
    xq.quantize(k_, 0, M, A, lda, kp);
  }
  // fp32 tile rows [r0, r0 + rows) of block cb: bias added, rounded (bf16) or copied into y.
  auto store = [&](const float* C, int r0, int rows, int cb) {
    const int c0 = cb * kBlockN, nc = std::min(kBlockN, N - c0);
    for (int m = 0; m < rows; ++m) {
      const float* c = C + m * kBlockN;
      if (y_fp32) {
        float* o = static_cast<float*>(y) + (r0 + m) * ldy + c0;
        for (int j = 0; j < nc; ++j) o[j] = c[j] + (bias ? bias[c0 + j] : 0.f);
      } else {
        bf16* o = static_cast<bf16*>(y) + (r0 + m) * ldy + c0;
        for (int j = 0; j < nc; ++j) o[j] = f32_to_bf16(c[j] + (bias ? bias[c0 + j] : 0.f));
      }
    }
  };
  auto pool = global_pool();
  if (M <= kPairRows) {  // decode: two blocks streamed side by side per task
    pool->parallel_for((nb + 1) / 2, [&](int64_t t) {
      const int cb = static_cast<int>(2 * t);
      float* C = tl_out.get(2 * kPairRows * kBlockN);
      float* C1 = C + kPairRows * kBlockN;
      const Int16Rows X = quantized_rows ? xq.at(0) : Int16Rows{};
      const Int16Rows* Xp = quantized_rows ? &X : nullptr;
      if (cb + 1 < nb) {
        gemm_block_pair(k_, M, A, A, lda, w_, 0, cb, w_, 0, cb + 1, C, C1, kBlockN, Xp, Xp);
        store(C, 0, M, cb);
        store(C1, 0, M, cb + 1);
      } else {
        gemm_block(k_, M, A, lda, w_, 0, cb, C, kBlockN, Xp);
        store(C, 0, M, cb);
      }
    });
    return;
  }
  const int chunks = (M + kRowChunk - 1) / kRowChunk;
  pool->parallel_for(static_cast<int64_t>(nb) * chunks, [&](int64_t t) {
    const int cb = static_cast<int>(t % nb), r0 = static_cast<int>(t / nb) * kRowChunk;
    const int rows = std::min(kRowChunk, M - r0);
    float* C = tl_out.get(static_cast<size_t>(kRowChunk) * kBlockN);
    const Int16Rows X = quantized_rows ? xq.at(r0) : Int16Rows{};
    gemm_block(k_, rows, A + r0 * lda, lda, w_, 0, cb, C, kBlockN, quantized_rows ? &X : nullptr);
    store(C, r0, rows, cb);
  });
}

}  // namespace kt
