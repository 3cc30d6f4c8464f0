// AMX-BF16 table (Sapphire Rapids and later). Built with -mamx-tile -mamx-bf16 plus the AVX512 flags; only
// called after cpu_has_amx_bf16() said yes (which also asked the kernel for the tile-data permission).
// Only the packed GEMM block uses tiles, for every row count: a block row of isa/kernels.h's layout is 16 columns ×
// 2 K values (64 bytes), so an AMX B tile is 16 consecutive K pairs read with a 256-byte stride, straight from
// the packed weights. Everything else is the AVX512-BF16 table.
// Tiles even for one row: TDPBF16PS and VDPBF16PS round differently (vdpbf16ps is two fused multiply-adds, odd
// K first; the tile sums match neither order), so a row's result would depend on how many rows share its
// expert, i.e. on what a request is batched with. One row is still memory-bound on tiles (one 1 KiB B tile per
// TDPBF16PS).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/prefetch.h"
#include "isa/kernels.h"

namespace {

using kt::bf16;
using kt::kBlockN;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-3 accumulators, 4-5 A (rows of the input), 6-7 B (packed weights).
// Shape "2x2": rows a0 / a1 of two A tiles × 2 column tiles (32 columns) per pass.
// Shape "1x4": one A tile of a0 rows × 4 column tiles (64 columns).
// Loaded on every use: other code on the same thread (oneDNN inside torch) may have changed the tile state.
void configure(int a0, int a1) {
  TileConfig c;
  const int b0 = a1 ? a1 : a0;  // rows of the second A tile and its accumulators (1x4: all a0)
  const int acc_rows[4] = {a0, a0, b0, b0};
  for (int t = 0; t < 4; ++t) c.rows[t] = static_cast<uint8_t>(acc_rows[t]), c.colsb[t] = 64;
  c.rows[4] = static_cast<uint8_t>(a0), c.colsb[4] = 64;
  c.rows[5] = static_cast<uint8_t>(b0), c.colsb[5] = 64;
  for (int t = 6; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

inline void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// 32 (a0 + a1) rows × 32 columns starting at column tile ct (0 or 2) of the block, left in tiles 0-3 (rows
// 0-15 in 0 and 1, rows 16-31 in 2 and 3).
inline void tile_2x2(const bf16* A, int64_t lda, const bf16* block, int kp, int ct) {
  zero_accumulators();
  const int64_t sa = lda * 2;
  for (int k0 = 0; k0 < kp; k0 += 32) {
    const bf16* b = block + (static_cast<int64_t>(k0 / 2) * kBlockN + 16 * ct) * 2;
    _tile_loadd(4, A + k0, sa);
    _tile_loadd(5, A + 16 * lda + k0, sa);
    _tile_loadd(6, b, kBlockN * 4);
    _tile_loadd(7, b + 32, kBlockN * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

inline void store_2x2(float* C, int64_t ldc, int ct) {
  const int64_t sc = ldc * 4;
  _tile_stored(0, C + 16 * ct, sc);
  _tile_stored(1, C + 16 * (ct + 1), sc);
  _tile_stored(2, C + 16 * ldc + 16 * ct, sc);
  _tile_stored(3, C + 16 * ldc + 16 * (ct + 1), sc);
}

// up to 16 rows × 64 columns, left in tiles 0-3 (columns 16t to 16t + 15 in tile t). Few rows make few tile products per byte, so the block streams from memory at the
// rate its loads are in flight: the next K step's 16 block rows (4 KiB) are prefetched into L1 (MoE decode from
// DRAM, calls alternated in one process: T=1 3.03 -> 2.74 ms, T=8 15.7 -> 14.2 ms; 2-8 KiB ahead within 4% of
// that). Many rows (tile_2x2) gained nothing from the same.
inline void tile_1x4(const bf16* A, int64_t lda, const bf16* block, int kp) {
  zero_accumulators();
  const int64_t sa = lda * 2;
  constexpr int kStepBytes = 16 * kBlockN * 2 * 2;
  const char* end = reinterpret_cast<const char*>(block) + static_cast<int64_t>(kp / 32) * kStepBytes;
  for (int k0 = 0; k0 < kp; k0 += 32) {
    const bf16* b = block + static_cast<int64_t>(k0 / 2) * kBlockN * 2;
    const char* next = reinterpret_cast<const char*>(b) + kStepBytes;
    if (next < end)
      for (int i = 0; i < kStepBytes; i += 64) kt::prefetch_l1(next + i);
    _tile_loadd(4, A + k0, sa);
    _tile_loadd(6, b, kBlockN * 4);
    _tile_loadd(7, b + 32, kBlockN * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, b + 64, kBlockN * 4);
    _tile_loadd(7, b + 96, kBlockN * 4);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(3, 4, 7);
  }
}

inline void store_1x4(float* C, int64_t ldc) {
  const int64_t sc = ldc * 4;
  _tile_stored(0, C, sc);
  _tile_stored(1, C + 16, sc);
  _tile_stored(2, C + 32, sc);
  _tile_stored(3, C + 48, sc);
}

const kt::Kernels* g_avx512 = nullptr;

// The tile passes over M rows of one block, each left in tiles 0-3 for done(m, rows0, rows1, ct): 32 rows (rows0
// in tiles 0-1, rows1 in 2-3) × 32 columns from column tile ct, or (ct = -1) up to 16 rows × 64 columns.
template <class Done>
void for_tile_passes(int M, const bf16* A, int64_t lda, const bf16* block, int kp, Done done) {
  int m = 0;
  for (; M - m > 16; m += 32) {
    const int a1 = std::min(16, M - m - 16);
    configure(16, a1);
    for (int ct = 0; ct < 4; ct += 2) {
      tile_2x2(A + m * lda, lda, block, kp, ct);
      done(m, 16, a1, ct);
    }
  }
  if (M - m > 0) {
    configure(M - m, 0);
    tile_1x4(A + m * lda, lda, block, kp);
    done(m, M - m, 0, -1);
  }
  _tile_release();  // no tile state left for context switches to save
}

// A rows readable up to kp. kp % 32 == 0 always (PackedWeights pads K to 32, decoded chunks are whole groups);
// the AVX512 kernel would take any other.
void gemm_block_amx(int M, const bf16* A, int64_t lda, const bf16* block, int kp, float* C, int64_t ldc) {
  if (M <= 0) return;
  if (kp % 32 != 0) return g_avx512->gemm_block(M, A, lda, block, kp, C, ldc);
  for_tile_passes(M, A, lda, block, kp, [&](int m, int, int, int ct) {
    if (ct < 0)
      store_1x4(C + m * ldc, ldc);
    else
      store_2x2(C + m * ldc, ldc, ct);
  });
}

// C rows (+)= t · s + off · xsum[r] for one 16-column tile stored at t (rows 64 bytes apart): the scales of a
// decoded chunk applied as its tiles come out, while they and C's rows are in L1.
inline void scale_tile(const float* t, int rows, const float* s, const float* off, const float* xsum, float* C,
                       int64_t ldc, bool first) {
  const __m512 sv = _mm512_loadu_ps(s);
  const __m512 ov = off ? _mm512_loadu_ps(off) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    __m512 y = _mm512_mul_ps(_mm512_load_ps(t + 16 * r), sv);
    if (off) y = _mm512_fmadd_ps(ov, _mm512_set1_ps(xsum[r]), y);
    float* c = C + r * ldc;
    _mm512_storeu_ps(c, first ? y : _mm512_add_ps(y, _mm512_loadu_ps(c)));
  }
}

void gemm_block_scaled_amx(int M, const bf16* A, int64_t lda, const bf16* block, int kp, const float* s,
                           const float* off, const float* xsum, float* C, int64_t ldc, bool first) {
  if (M <= 0) return;
  if (kp % 32 != 0) return g_avx512->gemm_block_scaled(M, A, lda, block, kp, s, off, xsum, C, ldc, first);
  alignas(64) float t[4][16 * 16];
  for_tile_passes(M, A, lda, block, kp, [&](int m, int rows0, int rows1, int ct) {
    for (int q = 0; q < 4; ++q) switch (q) {  // tile numbers must be constants
        case 0: _tile_stored(0, t[0], 64); break;
        case 1: _tile_stored(1, t[1], 64); break;
        case 2: _tile_stored(2, t[2], 64); break;
        case 3: _tile_stored(3, t[3], 64); break;
      }
    for (int q = 0; q < 4; ++q) {
      // 2x2 (ct 0 or 2): tile q holds rows 16 (q / 2) on, columns 16 (ct + q % 2); 1x4 (ct < 0): columns 16q
      const int r0 = ct < 0 ? 0 : 16 * (q / 2), rows = ct < 0 || q < 2 ? rows0 : rows1;
      const int c0 = ct < 0 ? 16 * q : 16 * (ct + q % 2);
      scale_tile(t[q], rows, s + c0, off ? off + c0 : nullptr, off ? xsum + m + r0 : nullptr,
                 C + (m + r0) * ldc + c0, ldc, first);
    }
  });
}

void gemm_block_pair_amx(int M, const bf16* A0, const bf16* A1, int64_t lda, const bf16* block0, const bf16* block1,
                         int kp, float* C0, float* C1, int64_t ldc) {
  gemm_block_amx(M, A0, lda, block0, kp, C0, ldc);
  gemm_block_amx(M, A1, lda, block1, kp, C1, ldc);
}

}  // namespace

namespace kt {

const Kernels* kernels_amx_bf16() {
  static const Kernels k = [] {
    g_avx512 = kernels_avx512_bf16();
    Kernels t = *g_avx512;
    t.name = "amx_bf16";
    t.gemm_block = gemm_block_amx;
    t.gemm_block_pair = gemm_block_pair_amx;
    t.gemm_block_scaled = gemm_block_scaled_amx;
    t.int_decode_min_rows = 16;  // from here int8 / int4 blocks decoded to bf16 go through the tiles
    return t;
  }();
  return &k;
}

}  // namespace kt
