// A weight matrix of every expert, packed once in one format (weights/weight_format.h), and the GEMM over one of its
// 64-column blocks that the MoE phases call (gemm_block / gemm_block_pair below: the one place that picks a
// microkernel by format and row count).
#pragma once
#include <cstdint>

#include "common/buffer.h"
#include "isa/kernels.h"
#include "weights/weight_format.h"

namespace kt {

struct PackedWeights {
  int E = 0, N = 0, K = 0, nblocks = 0;
  Layout layout;
  Buffer<uint8_t> data;
  Buffer<float> scales;

  // group: K values per scale group for fp8 / int4 (a multiple of 64); ignored for bf16 and int8.
  void init(int E, int N, int K, Format fmt = Format::bf16, int group = 0);
  int kp() const { return layout.kp; }
  Block block(int e, int b) const {
    const size_t i = static_cast<size_t>(e) * nblocks + b;
    return {data.data() + i * layout.block_bytes(), layout.fmt == Format::bf16 ? nullptr : scales.data() + i * layout.block_scales()};
  }
  const bf16* bf16_block(int e, int b) const { return reinterpret_cast<const bf16*>(block(e, b).w); }

  // Packs expert e from fill_row(n, row), which writes the K values of row n (n < N) as floats, quantized by the
  // format's rule (weights/packed_weights.cpp). Rows, not single values: a source with block scales looks each
  // scale up once per block of a row. Thread-safe across experts.
  template <typename FillRow>
  void pack(int e, FillRow&& fill_row) {
    for (int b = 0; b < nblocks; ++b) pack_block(e, b, fill_row);
  }
  // Block b (columns [64b, 64b + 64)) of expert e alone: thread-safe across blocks.
  template <typename FillRow>
  void pack_block(int e, int b, FillRow&& fill_row) {
    float* tile = tile_scratch();
    for (int c = 0; c < 64; ++c) {
      float* row = tile + static_cast<size_t>(c) * layout.kp;
      const int n = b * 64 + c;
      if (n < N) fill_row(n, row);
      for (int k = n < N ? K : 0; k < layout.kp; ++k) row[k] = 0.f;
    }
    quantize_block(e, b, tile);
  }
  // Packs fp8 expert e as a checkpoint stores it (layout.fmt must be fp8 with group = bk): e4m3 bytes
  // w[n * ldw + k], and scale_inv[(n / bn) * ld_scale + k / bk], the fp32 dequantization scale of each
  // bn × bk block. The bytes are copied, not re-rounded.
  // Refuses NaN codes, naming `what` (the matrix: gate_proj, ...).
  void pack_fp8(int e, const uint8_t* w, int64_t ldw, const float* scale_inv, int64_t ld_scale, int bn,
                const char* what);

  float at(int e, int n, int k) const;  // the dequantized value W[n][k] of expert e
  size_t bytes() const { return data.bytes() + scales.bytes(); }

 private:
  float* tile_scratch() const;  // thread-local [64][kp] floats
  void quantize_block(int e, int b, const float* tile);
};

// Columns [k0, k0 + 64) of expert e's W (k0 a multiple of 64) as one bf16 block of the transposed matrix, whose
// inner dimension is W's n placed at offset o (even): out[(o + n) / 2][c][(o + n) % 2] = bf16(W[n][k0 + c]) for
// n < N, the value PackedWeights::at gives rounded to nearest even (exact for bf16 weights), zero where k0 + c >= K.
// The backward's products dx = dy · W read their weights this way, a block per task, instead of from a
// transposed copy of every expert (which doubled a bf16 layer's memory and made an int4 one 5x larger).
// Rows of out outside [o, o + N) are not written (zero_inner).
void decode_transposed(const Kernels& kern, const PackedWeights& W, int e, int k0, int o, bf16* out);

// An FP8 checkpoint matrix (e4m3 w [N, K], fp32 scale_inv [ceil(N / bn), ceil(K / bk)]) dequantized to bf16:
// out[n][k] = bf16(e4m3(w[n][k]) · scale_inv[n / bn][k / bk]), rounded to nearest even (what torch's
// (w.float() * scale).to(bfloat16) gives), rows spread over the worker pool. A CPU host's dense FP8 linears take
// this at load (a whole model's attention projections: about a billion values).
void fp8_to_bf16(const uint8_t* w, int64_t N, int64_t K, const float* scale_inv, int bn, int bk, bf16* out);
// Inner indices [n0, n1) of such a block set to zero (the padding between and after the decoded matrices).
void zero_inner(bf16* out, int n0, int n1);

// The integer formats' input rows of one call (Int16Rows), kept with the call's other scratch.
struct QuantizedRows {
  Buffer<int16_t> q;
  Buffer<int32_t> sums;
  Buffer<float> scale;
  int kp = 0;
  void reserve(int rows, int kp_) {
    kp = kp_;
    q.get(static_cast<size_t>(rows) * kp), sums.get(static_cast<size_t>(rows) * (kp / 32)), scale.get(rows);
  }
  // Rows [first, first + rows) from A (rows lda apart).
  void quantize(const Kernels& kern, int first, int rows, const bf16* A, int64_t lda, int kp);
  Int16Rows at(int row) const {
    return {q.data() + static_cast<int64_t>(row) * kp, sums.data() + static_cast<int64_t>(row) * (kp / 32),
            scale.data() + row, kp};
  }
};

// C[m][c] = Σ_k A[m][k] · W[cb·64 + c][k] for block cb of expert e, m < M (the isa/kernels.h gemm_block contract:
// A rows of W.kp() bf16 values, the padding zero; 64 columns of C written). X: the same rows quantized
// (Kernels::quantize_rows) for the integer formats, or null to have them quantized per call.
void gemm_block(const Kernels& kern, int M, const bf16* A, int64_t lda, const PackedWeights& W, int e, int cb,
                float* C, int64_t ldc, const Int16Rows* X = nullptr);
// Block cb0 of expert e0 of W0 and block cb1 of expert e1 of W1, each on its own rows (A0, A1), streamed side by
// side: gate and up pass the same rows and two matrices, the down phase two experts, a dense layer two blocks.
void gemm_block_pair(const Kernels& kern, int M, const bf16* A0, const bf16* A1, int64_t lda, const PackedWeights& W0,
                     int e0, int cb0, const PackedWeights& W1, int e1, int cb1, float* C0, float* C1, int64_t ldc,
                     const Int16Rows* X0 = nullptr, const Int16Rows* X1 = nullptr);

}  // namespace kt
