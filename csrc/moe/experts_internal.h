// Internals shared by the MoE-LoRA source files: routing, the state a forward keeps for the backward, the
// work split into tasks. Not part of the interface (moe/experts.h).
//
// A call groups the routed (token, k) pairs by expert and, within an expert, by adapter slot ("segments"), then
// runs a few parallel phases separated by barriers. Each phase is a list of small tasks handed out dynamically,
// so a hot expert is split into many column/row blocks and no core idles behind it:
//   forward   A gather x rows, t = x Aᵀ (gate, up)   per segment chunk          (moe/forward.cpp)
//             B g, u = x Wᵀ + s t Bᵀ, h = silu(g) u    per (expert, 64 columns of I, 64 rows)
//             C t = h Adᵀ (and h quantized, int8 / int4)  per segment chunk
//             D y = h Wdᵀ + s t Bdᵀ, out += w y       per (64 columns of H, group of experts)
//   backward  mirrors it                                                        (moe/backward.cpp)
#pragma once
#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/prefetch.h"
#include "common/thread_pool.h"
#include "moe/dropout.h"
#include "moe/experts.h"

namespace kt {

constexpr int kRowBlock = 64;   // rows per GEMM run
// A run also takes the rest of an expert's rows when they are at most kMaxRunRows (the local tiles' height): a
// short tail run of its own would take the few-row path, which for int4 / int8 on AVX512 and AMX (below 16 rows)
// decodes the whole block in registers again for those rows (at T=512, E=64 top-8, 64 ± 8 rows an expert: 7.7%
// of an int4 forward).
constexpr int kMaxRunRows = kRowBlock + 16;
static_assert(kMaxRunRows <= kScaledRows, "a decoded block's GEMM takes kScaledRows rows a call");
inline int run_end(int r0, int r1) { return r1 - r0 <= kMaxRunRows ? r1 : r0 + kRowBlock; }
constexpr int kChunkRows = 16;  // rows per task in the row-wise LoRA phases

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

[[noreturn]] inline void fail(const std::string& msg) { throw std::invalid_argument(msg); }

struct MoEExperts::Route {
  struct Segment {
    int e, begin, end, slot;  // pairs [begin, end) of expert e, all with one slot (-1 = base only)
  };
  struct Chunk {
    int seg, begin, end;
  };
  int T = 0, k = 0, P = 0, R = 1;      // R: row stride of the rank-sized buffers (max rank in use)
  std::vector<int> pair_tk, tk_pair;  // sorted pair -> t*k + j; t*k + j -> sorted pair or -1
  std::vector<int> expert_begin;      // [E + 1]
  std::vector<int> active;            // experts with at least one pair
  std::vector<Segment> segs;          // by expert, then slot
  std::vector<int> expert_seg;        // [E + 1]: segments [expert_seg[e], expert_seg[e + 1]) are expert e's
  std::vector<Chunk> chunks;          // segments cut into kChunkRows pieces
  std::vector<const Adapter*> adapter;  // by slot, for the slots in use
  std::vector<std::shared_ptr<const Adapter>> keep;  // holds them alive for the call (and the backward)

  const Adapter* seg_adapter(const Segment& s) const { return s.slot < 0 ? nullptr : adapter[s.slot]; }
};

// Everything one forward keeps for the backward; also the scratch of a forward that saves nothing
// (then thread-local, so concurrent calls never share it).
struct MoEExperts::Saved {
  Route route;
  int64_t ldx = 0, ldh = 0;
  Buffer<bf16> x, h;               // gathered inputs [P, ldx]; h = silu(g) u [P, ldh]
  Buffer<float> tg, tu, td;        // LoRA down-projections [P, R] (unscaled, of the dropped inputs)
  Buffer<float> g, u;              // pre-activations [P, I] (save_for_backward only)
  Buffer<float> acc;               // partial outputs (PartialOutputs)
  QuantizedRows xq, hq;            // x and h rows as int16, for integer-format weights
  std::vector<float> weights;      // [T, k]
  Dropout dropout;                 // the forward's seed and rate: the backward regenerates its masks
  bool pending = false;            // a backward may consume this
};

// Scratch of a backward, one set per calling thread and shared by every layer (KT's kt_share_backward_bb):
// a layer's backward needs it only while it runs.
struct BackwardScratch {
  Buffer<bf16> gout, dgu;          // gathered grad_out [P, ldx]; [dg | du] bf16 [P, ldgu]
  Buffer<float> t2d, t2g, t2u, gw; // dy·Bd, dg·Bg, du·Bu [P, R]; per-block partial grad_w [P, nbI]
};

// Route of one call; ids int64 when ids64, else int32 (moe/route.cpp).
void build_route(MoEExperts::Route& rt, int E, int T, int k, const void* ids, bool ids64, const int32_t* slots,
                 int uniform_slot, const std::vector<std::shared_ptr<const Adapter>>& table);

// GEMM tasks: all rows of one expert and its 64-column blocks [cb, cb_end), walked by for_row_blocks block by
// block, each in runs of rows (run_end). One task for all runs reads a block from memory once; the later runs
// find it in L2.
struct BlockTask {
  int e, r0, r1, cb, cb_end;
};
// Tasks of `span` consecutive blocks of an expert (the last one of an expert may be shorter).
std::vector<BlockTask> expert_block_tasks(const MoEExperts::Route& rt, int nblocks, int span = 1);

// How many consecutive blocks of one matrix a task should take, when `tasks` tasks of one block each would do:
// as many as leave kTasksPerThread tasks to each thread. An expert's blocks lie one after the other in memory;
// with a block a task, the cores take turns along a matrix and each restarts its hardware prefetch stream at
// every block it gets (64 KiB of int4 gate weights at H = 2048, 24 KiB of down), where a run of blocks is one
// stream (measured in moe/route.cpp).
int block_span(int64_t tasks, int nblocks, int nthreads);
constexpr int kTasksPerThread = 4;
// Whether a call's experts have on average no more rows than the pair tiles take (decode): then its GEMM tasks
// stream weights, and long spans pay.
bool decode_sized(const MoEExperts::Route& rt);

template <class F>
inline void for_row_blocks(const BlockTask& task, F&& f) {
  for (int cb = task.cb; cb < task.cb_end; ++cb)
    for (int r0 = task.r0, r1; r0 < task.r1; r0 = r1) f(BlockTask{task.e, r0, r1 = run_end(r0, task.r1), cb, cb + 1});
}

// Tasks of the phases that sum over experts into the output's column blocks: (group of experts, span of column
// blocks). Each group accumulates into its own partial output, so tasks never write the same element.
struct ColumnTasks {
  std::vector<std::vector<int>> groups;
  int span = 1, nspans = 1;
  int64_t size() const { return static_cast<int64_t>(groups.size()) * nspans; }
};
// Groups of similar pair counts, spans of one block. With `long_spans`, a decode-sized call whose partial
// outputs are small takes groups of two experts (the pair microkernels stream both blocks at once) and
// spans of block_span's length instead, so that a task streams each of its experts' blocks in one run.
ColumnTasks column_tasks(const MoEExperts::Route& rt, int nblocks, int nthreads, bool long_spans);

// The fp32 outputs those tasks accumulate, [groups][nbH][T][64]: one task's T rows of 64 columns contiguous.
// (As [T, H], a slice's rows are H floats apart and, H a power of two, share a few cache sets: MoE T=512 spent
// 9% of its time reading them back from memory.) Each task zeroes its own slice.
struct PartialOutputs {
  float* data;
  int groups, T, nbH;
  PartialOutputs(Buffer<float>& buf, int groups, int T, int nbH)
      : data(buf.get(static_cast<size_t>(groups) * nbH * T * kBlockN)), groups(groups), T(T), nbH(nbH) {}
  float* slice(int grp, int cb) const { return data + (static_cast<size_t>(grp) * nbH + cb) * T * kBlockN; }
  float* zeroed(int grp, int cb) const {
    float* s = slice(grp, cb);
    std::memset(s, 0, sizeof(float) * T * kBlockN);
    return s;
  }
  // Column block cb of dst [T, H] bf16 from group 0's slice, after adding the other groups' into it.
  void store(int cb, int H, bf16* dst) const;
};

// Calls fn(segment, r0, r1) for each segment of expert e that intersects rows [r0, r1).
template <typename F>
void for_segments(const MoEExperts::Route& rt, int e, int r0, int r1, F&& fn) {
  for (int i = rt.expert_seg[e]; i < rt.expert_seg[e + 1]; ++i) {
    const auto& s = rt.segs[i];
    if (s.end <= r0 || s.begin >= r1) continue;
    fn(s, std::max(s.begin, r0), std::min(s.end, r1));
  }
}

inline thread_local float tl_tile[2][kMaxRunRows * kBlockN];

// Asks for rows [p + j*ld, p + j*ld + n) of a bf16 matrix, j < rows, to be brought towards L2. A task's slice of
// LoRA B is rank short rows far apart, which the hardware prefetcher does not follow; asked for before the base
// GEMM streams its weight block, they arrive while it runs.
inline void prefetch_rows(const bf16* p, int rows, int64_t ld, int n) {
  for (int j = 0; j < rows; ++j)
    for (int c = 0; c < n; c += 32) prefetch_l2(p + j * ld + c);
}

}  // namespace kt
