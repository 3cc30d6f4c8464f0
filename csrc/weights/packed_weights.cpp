// Packing and quantization of expert weights (formats in weights/weight_format.h), and the per-block GEMM dispatch.
//
// Quantization rules (restated independently by tests/test_kernel_formats.py):
//   int8  per output row n: s = amax_k |W[n][k]| / 127, q = clamp(nearbyint(W / s), -127, 127)
//   int4  per row n and K group: lo = min W, s = (max W - lo) / 15, both kept as bf16 (nearest even; s = 1 if
//         that is 0), q = clamp(nearbyint((W - lo) / s), 0, 15) with those, W ≈ q · s + lo (asymmetric: 0.09 nats
//         of served error at group 128 against 0.24 symmetric, see the notes)
//   fp8   from a float source, per 64 rows × K group: s = amax / 448, q = e4m3(W / s) (nearest even);
//         from an fp8 checkpoint the bytes and block scales are taken as they are (pack_fp8)
// with s = 1 where the range is 0; divisions in fp32, nearbyint rounds half to even.
#include "weights/packed_weights.h"
#include "common/prefetch.h"
#include "common/thread_pool.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>
#include <string>

namespace kt {

namespace {

// From this many rows an fp8 block is decoded once into bf16 and run through the bf16 microkernel (AMX where the
// CPU has it): the decode is then shared by enough rows that it costs less than decoding in registers for every
// group of rows. Integer formats: the table's int_decode_min_rows.
constexpr int kDecodeRows = 16;

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

float amax(const float* p, int n) {
  float a = 0.f;
  for (int i = 0; i < n; ++i) a = std::max(a, std::fabs(p[i]));
  return a;
}

}  // namespace

const char* format_name(Format f) {
  switch (f) {
    case Format::bf16: return "bf16";
    case Format::int8: return "int8";
    case Format::int4: return "int4";
    case Format::fp8: return "fp8";
  }
  return "?";
}

Format parse_format(const std::string& name) {
  for (Format f : {Format::bf16, Format::int8, Format::int4, Format::fp8})
    if (name == format_name(f)) return f;
  fail("unknown expert weight format '" + name + "' (expected bf16, int8, int4 or fp8)");
}

void PackedWeights::init(int E_, int N_, int K_, Format fmt, int group) {
  E = E_, N = N_, K = K_;
  layout.fmt = fmt;
  layout.kp = static_cast<int>((K + 31) / 32 * 32);  // K steps of 32: one AMX tile row; input rows padded to match
  if (fmt == Format::int4 || fmt == Format::fp8) {
    if (group < 64 || group % 64 != 0)
      fail(std::string(format_name(fmt)) + " weights: the K group size must be a positive multiple of 64, got " +
           std::to_string(group));
    layout.group = group;
  } else {
    layout.group = layout.kp;
  }
  nblocks = (N + kBlockN - 1) / kBlockN;
  data.get(static_cast<size_t>(E) * nblocks * layout.block_bytes());
  if (fmt != Format::bf16) scales.get(static_cast<size_t>(E) * nblocks * layout.block_scales());
}

float* PackedWeights::tile_scratch() const {
  thread_local Buffer<float> tile;
  return tile.get(static_cast<size_t>(kBlockN) * layout.kp);
}

void PackedWeights::quantize_block(int e, int b, const float* tile) {
  const Layout& l = layout;
  const int kp = l.kp, ng = l.ngroups();
  const size_t bi = static_cast<size_t>(e) * nblocks + b;
  uint8_t* w = data.data() + bi * l.block_bytes();
  float* s = l.fmt == Format::bf16 ? nullptr : scales.data() + bi * l.block_scales();
  // Scales first: per column (int8), per column and group (int4, with the minimums), per group of the block (fp8).
  const int gf = Layout::kScaleWords;
  for (int g = 0; g < ng; ++g) {
    const int k0 = g * l.group, kn = std::min(l.group, kp - k0);
    float block_max = 0.f;
    if (l.fmt == Format::fp8)
      for (int c = 0; c < kBlockN; ++c) block_max = std::max(block_max, amax(tile + c * kp + k0, kn));
    for (int c = 0; c < kBlockN && s; ++c) {
      const float* w_ = tile + c * kp + k0;
      if (l.fmt == Format::int4) {
        const int n = std::min(kn, K - k0);  // the K padding is not data: it would widen the range
        const float lo = n > 0 ? *std::min_element(w_, w_ + n) : 0.f, hi = n > 0 ? *std::max_element(w_, w_ + n) : 0.f;
        const bf16 scale = f32_to_bf16(hi > lo ? (hi - lo) / 15.f : 1.f);
        const uint32_t word = int4_scale_word(scale != 0 ? scale : f32_to_bf16(1.f), f32_to_bf16(lo));
        std::memcpy(&s[g * gf + c], &word, 4);
        continue;
      }
      const float a = l.fmt == Format::fp8 ? block_max : amax(w_, kn);
      s[g * gf + c] = a > 0.f ? a / (l.fmt == Format::int8 ? 127.f : 448.f) : 1.f;
    }
  }
  // The values, a K pair ("row" of the block) at a time: value i = 2c + j is column c's K value 2kk + j. One loop
  // per format, so the compiler sees straight arithmetic (the same divisions and roundings as the rules above).
  const int rb = l.row_bytes();
  for (int kk = 0; kk < kp / 2; ++kk) {
    uint8_t* row = w + static_cast<size_t>(kk) * rb;
    const int g = 2 * kk / l.group;  // both K values of the pair: groups are multiples of 64
    const float* tk = tile + 2 * kk;
    switch (l.fmt) {
      case Format::bf16: {
        bf16* out = reinterpret_cast<bf16*>(row);
        for (int c = 0; c < kBlockN; ++c)
          for (int j = 0; j < 2; ++j) out[2 * c + j] = f32_to_bf16(tk[c * kp + j]);
        break;
      }
      case Format::int8:
        for (int c = 0; c < kBlockN; ++c)
          for (int j = 0; j < 2; ++j)
            row[2 * c + j] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(tk[c * kp + j] / s[c]), -127.f, 127.f)));
        break;
      case Format::fp8:
        for (int c = 0; c < kBlockN; ++c)
          for (int j = 0; j < 2; ++j) row[2 * c + j] = f32_to_e4m3(tk[c * kp + j] / s[g * gf + c]);
        break;
      case Format::int4: {
        std::memset(row, 0, rb);
        for (int c = 0; c < kBlockN; ++c) {
          const float* word = &s[g * gf + c];
          const float lo = int4_min(word), scale = int4_scale(word);
          for (int j = 0; j < 2; ++j) {
            const int i = 2 * c + j, k = 2 * kk + j;
            const float q = k < K ? std::nearbyint((tk[c * kp + j] - lo) / scale) : 0.f;
            const int code = static_cast<int>(std::clamp(q, 0.f, 15.f));
            const int v4 = i / 32, lane = i % 32;
            row[2 * lane + v4 / 2] |= static_cast<uint8_t>(code << (4 * (v4 % 2)));
          }
        }
        break;
      }
    }
  }
}

void PackedWeights::pack_fp8(int e, const uint8_t* w, int64_t ldw, const float* scale_inv, int64_t ld_scale, int bn,
                             const char* what) {
  const Layout& l = layout;
  if (l.fmt != Format::fp8) fail("pack_fp8: these weights are not fp8");
  if (bn < 1) fail("pack_fp8: block rows must be >= 1");
  for (int b = 0; b < nblocks; ++b) {
    const size_t bi = static_cast<size_t>(e) * nblocks + b;
    uint8_t* dst = data.data() + bi * l.block_bytes();
    float* s = scales.data() + bi * l.block_scales();
    for (int g = 0; g < l.ngroups(); ++g)
      for (int c = 0; c < kBlockN; ++c) {
        const int n = b * kBlockN + c;
        s[g * kBlockN + c] = n < N ? scale_inv[static_cast<int64_t>(n / bn) * ld_scale + g] : 1.f;
      }
    uint8_t nan = 0;
    for (int kk = 0; kk < l.kp / 2; ++kk)
      for (int i = 0; i < 2 * kBlockN; ++i) {
        const int n = b * kBlockN + i / 2, k = 2 * kk + i % 2;
        const uint8_t v = (n < N && k < K) ? w[static_cast<int64_t>(n) * ldw + k] : 0;
        nan |= (v & 0x7f) == 0x7f;
        dst[static_cast<size_t>(kk) * l.row_bytes() + i] = v;
      }
    // weights are finite in any sound checkpoint, and the decoders of the fast tables may assume it
    if (nan)
      fail(std::string(what) + " of expert " + std::to_string(e) + ": e4m3 NaN codes (0x7f / 0xff) in output rows " +
           std::to_string(b * kBlockN) + "-" + std::to_string(std::min(N, (b + 1) * kBlockN) - 1) +
           ": the FP8 checkpoint is corrupt");
  }
}

float PackedWeights::at(int e, int n, int k) const {
  const Block blk = block(e, n / kBlockN);
  const int i = 2 * (n % kBlockN) + k % 2;
  const int g = k / layout.group;
  return std::fma(block_value(layout, blk.w, k / 2, i), block_scale(layout, blk, g, i), block_offset(layout, blk, g, i));
}

namespace {

// Many rows: the block decoded a group at a time into bf16, the bf16 microkernel over the group, its partial
// product scaled into C. int8, one group, is decoded up to 4096 K values at a time (512 KiB, in L2) and scaled
// once per such chunk: in chunks of 256, each a small GEMM with its own partial product, MoE T=512 ran 72 ms
// against 63 (AMX host; the avx512_bf16 table forced there: 232 against 221 ms). int4 adds its minimums times
// the group's input sums, taken from the rows' int16 form (X, quantized once per call, as the register path
// takes them): summing the bf16 inputs again for every block and group had cost as much as the GEMM at T=512.
void decoded_gemm(const Kernels& kern, int M, const bf16* A, int64_t lda, const Layout& l, Block b, float* C,
                  int64_t ldc, const Int16Rows* X) {
  const int chunk = l.fmt == Format::int8 ? std::min(l.kp, 4096) : l.group;
  thread_local Buffer<bf16> decoded;
  thread_local float xsum[kScaledRows];  // M <= kScaledRows: a MoE task's run of rows
  thread_local QuantizedRows own;
  if (l.fmt == Format::int4 && !X) {
    own.reserve(M, l.kp);
    own.quantize(kern, 0, M, A, lda, l.kp);
  }
  const Int16Rows rows = X ? *X : own.at(0);
  bf16* d = decoded.get(static_cast<size_t>(chunk) * kBlockN);
  float* xs = xsum;  // once: each use of a thread_local in the loop is a call to __tls_get_addr
  alignas(64) float scale[kBlockN], minimum[kBlockN];  // int4's of the chunk, as fp32
  const int64_t chunk_bytes = static_cast<int64_t>(chunk / 2) * l.row_bytes();
  for (int k0 = 0; k0 < l.kp; k0 += chunk) {
    const int kc = std::min(chunk, l.kp - k0);
    // The next group's rows into L2 while this one is multiplied: a group of int4 is one 4 KiB page, and the
    // hardware streamer stops at pages (decoding waited on memory for 14% of an int4 MoE T=512 forward).
    if (k0 + kc < l.kp) {
      const uint8_t* next = b.w + static_cast<int64_t>(k0 / 2) * l.row_bytes() + chunk_bytes;
      for (int64_t i = 0; i < std::min<int64_t>(chunk_bytes, 8192); i += 64) prefetch_l2(next + i);
    }
    kern.decode_rows(l, b.w, k0 / 2, (k0 + kc) / 2, d);
    const float* s = b.s + (k0 / l.group) * Layout::kScaleWords;
    if (l.fmt == Format::int4) {
      for (int m = 0; m < M; ++m) xs[m] = rows.scale[m] * static_cast<float>(rows.sum(m, k0, k0 + kc));
      for (int c = 0; c < kBlockN; ++c) scale[c] = int4_scale(s + c), minimum[c] = int4_min(s + c);
      s = scale;
    }
    kern.gemm_block_scaled(M, A + k0, lda, d, kc, s, l.fmt == Format::int4 ? minimum : nullptr, xs, C, ldc, k0 == 0);
  }
}

}  // namespace

void gemm_block(const Kernels& kern, int M, const bf16* A, int64_t lda, const PackedWeights& W, int e, int cb,
                float* C, int64_t ldc, const Int16Rows* X) {
  if (M <= 0) return;
  const Layout& l = W.layout;
  if (l.fmt == Format::bf16) return kern.gemm_block(M, A, lda, W.bf16_block(e, cb), l.kp, C, ldc);
  if (M < (l.integer() ? kern.int_decode_min_rows : kDecodeRows))
    return kern.qgemm_block(M, A, lda, X, l, W.block(e, cb), C, ldc);
  decoded_gemm(kern, M, A, lda, l, W.block(e, cb), C, ldc, X);
}

void gemm_block_pair(const Kernels& kern, int M, const bf16* A0, const bf16* A1, int64_t lda, const PackedWeights& W0,
                     int e0, int cb0, const PackedWeights& W1, int e1, int cb1, float* C0, float* C1, int64_t ldc,
                     const Int16Rows* X0, const Int16Rows* X1) {
  if (M <= 0) return;
  const Layout& l = W0.layout;
  if (l.fmt == Format::bf16)
    return kern.gemm_block_pair(M, A0, A1, lda, W0.bf16_block(e0, cb0), W1.bf16_block(e1, cb1), l.kp, C0, C1, ldc);
  if (M <= kPairRows)
    return kern.qgemm_block_pair(M, A0, A1, lda, X0, X1, l, W0.block(e0, cb0), W1.block(e1, cb1), C0, C1, ldc);
  gemm_block(kern, M, A0, lda, W0, e0, cb0, C0, ldc, X0);
  gemm_block(kern, M, A1, lda, W1, e1, cb1, C1, ldc, X1);
}

void fp8_to_bf16(const uint8_t* w, int64_t N, int64_t K, const float* scale_inv, int bn, int bk, bf16* out) {
  if (bn < 1 || bk < 1) fail("fp8_to_bf16: blocks must be >= 1 x 1");
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = e4m3_to_f32(static_cast<uint8_t>(b));
    return t;
  }();
  const int64_t ld_scale = (K + bk - 1) / bk;
  global_pool()->parallel_for(N, [&](int64_t n) {
    const uint8_t* row = w + n * K;
    const float* scales = scale_inv + (n / bn) * ld_scale;
    bf16* dst = out + n * K;
    for (int64_t k0 = 0; k0 < K; k0 += bk) {
      const float s = scales[k0 / bk];
      for (int64_t k = k0; k < std::min(K, k0 + bk); ++k) dst[k] = f32_to_bf16(table[row[k]] * s);
    }
  });
}

void decode_transposed(const Kernels& kern, const PackedWeights& W, int e, int k0, int o, bf16* out) {
  const Layout& l = W.layout;
  const int kk0 = k0 / 2, rows = std::max(0, std::min(32, l.kp / 2 - kk0));
  thread_local Buffer<bf16> last;  // a partial last block: its columns past N would overwrite what follows o + N
  for (int b = 0; b < W.nblocks; ++b) {
    bf16* dst = out + static_cast<int64_t>((o + b * kBlockN) / 2) * 2 * kBlockN;  // o even: column c lands on o + 64b + c
    const int nc = std::min(kBlockN, W.N - b * kBlockN);
    bf16* d = nc < kBlockN ? last.get(kBlockN * kBlockN) : dst;
    kern.decode_transposed(l, W.block(e, b), kk0, rows, d);
    for (int c = 0; c < nc; ++c)  // K past W.K: padding, not data (int4 would give its minimum); past kp: unwritten
      for (int k = std::max(k0, W.K); k < k0 + 64; ++k) d[(c / 2) * 2 * kBlockN + 2 * (k - k0) + c % 2] = 0;
    if (d != dst)
      for (int c = 0; c < nc; ++c)
        for (int q = 0; q < 64; ++q) dst[(c / 2) * 2 * kBlockN + 2 * q + c % 2] = d[(c / 2) * 2 * kBlockN + 2 * q + c % 2];
  }
}

void zero_inner(bf16* out, int n0, int n1) {
  for (int n = n0; n < n1; ++n)
    for (int c = 0; c < kBlockN; ++c) out[static_cast<int64_t>(n / 2) * 2 * kBlockN + 2 * c + n % 2] = 0;
}

void QuantizedRows::quantize(const Kernels& kern, int first, int rows, const bf16* A, int64_t lda, int kp) {
  kern.quantize_rows(rows, A, lda, kp, q.data() + static_cast<int64_t>(first) * kp,
                     sums.data() + static_cast<int64_t>(first) * (kp / 32), scale.data() + first);
}

}  // namespace kt
