// Orchestration of the MoE-LoRA forward and backward: routing, phases, work split. The arithmetic lives in
// the per-ISA tables of kernels.h.
//
// A call groups the routed (token, k) pairs by expert and, within an expert, by adapter slot ("segments"), then
// runs a few parallel phases separated by barriers. Each phase is a list of small tasks handed out dynamically,
// so a hot expert is split into many column/row blocks and no core idles behind it:
//   forward   A gather x rows, t = x Aᵀ (gate, up)   per segment chunk
//             B g, u = x Wᵀ + s t Bᵀ, h = silu(g) u    per (expert, 64 columns of I, 64 rows)
//             C t = h Adᵀ                             per segment chunk
//             D y = h Wdᵀ + s t Bdᵀ, out += w y       per (64 columns of H, group of experts)
//   backward  mirrors it (see MoELoRA::backward).
#include "moe_lora.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "thread_pool.h"

namespace kt {

namespace {

constexpr int kRowBlock = 64;    // rows per GEMM task (and per local tile)
constexpr int kChunkRows = 16;   // rows per task in the row-wise LoRA phases

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// Zeroed memory; arrays of 2 MiB or more (packed weights, large scratch) are 2 MiB-aligned and asked for
// transparent huge pages, so streaming weights walks one TLB entry per 2 MiB rather than per 4 KiB (about 15%
// more read bandwidth on the machines measured, see evals/bench_kernel.py). Returns the rounded-up size.
void* alloc_zeroed(size_t& bytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  bytes = static_cast<size_t>(round_up(static_cast<int64_t>(bytes), static_cast<int64_t>(align)));
  void* p = std::aligned_alloc(align, bytes);
  if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (align == kHuge) madvise(p, bytes, MADV_HUGEPAGE);  // only a hint: a no-op where THP is off
#endif
  std::memset(p, 0, bytes);
  return p;
}

}  // namespace

template <typename T>
T* Buffer<T>::get(size_t n) {
  if (n > cap_ || !p_) {
    size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
    p_.reset(static_cast<T*>(alloc_zeroed(bytes)));
    cap_ = bytes / sizeof(T);
  }
  return p_.get();
}
template class Buffer<bf16>;
template class Buffer<float>;

void PackedWeights::init(int E_, int N_, int K_) {
  E = E_, N = N_, K = K_;
  kp = static_cast<int>(round_up(K, 32));  // K steps of 32: one AMX tile row; input rows are padded to match
  nblocks = ceil_div(N, kBlockN);
  block_elems = static_cast<size_t>(kp) * kBlockN;
  data.get(static_cast<size_t>(E) * nblocks * block_elems);
}

// ---------------------------------------------------------------------------------------------------------------
// Routing

struct MoELoRA::Route {
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

namespace {

template <typename Id>
void build_route(MoELoRA::Route& rt, int E, int T, int k, const Id* ids, const int32_t* slots, int uniform_slot,
                 const std::vector<std::shared_ptr<const Adapter>>& table) {
  const int S = static_cast<int>(table.size());
  rt.T = T, rt.k = k;
  rt.adapter.assign(S, nullptr);
  rt.keep.clear();
  rt.R = 1;
  // Per-token slots, or one slot for every token (no per-token array to build and check on the serving path).
  const int checked = slots ? T : std::min(T, 1);
  for (int t = 0; t < checked; ++t) {
    const int s = slots ? slots[t] : uniform_slot;
    auto where = [&] {
      return slots ? "slots[" + std::to_string(t) + "] = " + std::to_string(s) : "slot " + std::to_string(s);
    };
    if (s < -1 || s >= S) fail(where() + ": expected -1 or 0.." + std::to_string(S - 1));
    if (s >= 0 && !rt.adapter[s]) {
      if (!table[s]) fail(where() + ": no adapter loaded in that slot");
      rt.adapter[s] = table[s].get();
      rt.keep.push_back(table[s]);
      rt.R = std::max(rt.R, table[s]->rank);
    }
  }
  std::vector<int> count(E + 1, 0);
  for (int64_t i = 0; i < static_cast<int64_t>(T) * k; ++i) {
    const int64_t e = static_cast<int64_t>(ids[i]);
    if (e >= 0 && e < E) ++count[e + 1];
  }
  rt.expert_begin.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) rt.expert_begin[e + 1] = rt.expert_begin[e] + count[e + 1];
  rt.P = rt.expert_begin[E];
  rt.pair_tk.assign(rt.P, 0);
  rt.tk_pair.assign(static_cast<size_t>(T) * k, -1);
  std::vector<int> fill(rt.expert_begin.begin(), rt.expert_begin.end() - 1);
  for (int64_t i = 0; i < static_cast<int64_t>(T) * k; ++i) {
    const int64_t e = static_cast<int64_t>(ids[i]);
    if (e >= 0 && e < E) rt.pair_tk[fill[e]++] = static_cast<int>(i);
  }
  auto slot_of = [&](int tk) { return slots ? slots[tk / k] : uniform_slot; };
  rt.active.clear();
  rt.segs.clear();
  rt.expert_seg.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    const int b = rt.expert_begin[e], end = rt.expert_begin[e + 1];
    rt.expert_seg[e] = static_cast<int>(rt.segs.size());
    if (b == end) continue;
    rt.active.push_back(e);
    if (slots)
      std::stable_sort(rt.pair_tk.begin() + b, rt.pair_tk.begin() + end,
                       [&](int x, int y) { return slot_of(x) < slot_of(y); });
    for (int p = b; p < end;) {
      const int s = slot_of(rt.pair_tk[p]);
      int q = p;
      while (q < end && slot_of(rt.pair_tk[q]) == s) ++q;
      rt.segs.push_back({e, p, q, s});
      p = q;
    }
  }
  rt.expert_seg[E] = static_cast<int>(rt.segs.size());
  for (int p = 0; p < rt.P; ++p) rt.tk_pair[rt.pair_tk[p]] = p;
  rt.chunks.clear();
  for (int si = 0; si < static_cast<int>(rt.segs.size()); ++si)
    for (int p = rt.segs[si].begin; p < rt.segs[si].end; p += kChunkRows)
      rt.chunks.push_back({si, p, std::min(p + kChunkRows, rt.segs[si].end)});
}

// GEMM tasks over one expert's rows and one 64-column block.
struct BlockTask {
  int e, r0, r1, cb;
};

std::vector<BlockTask> expert_block_tasks(const MoELoRA::Route& rt, int nblocks) {
  std::vector<BlockTask> tasks;
  for (int e : rt.active)
    for (int r0 = rt.expert_begin[e]; r0 < rt.expert_begin[e + 1]; r0 += kRowBlock)
      for (int cb = 0; cb < nblocks; ++cb)
        tasks.push_back({e, r0, std::min(r0 + kRowBlock, rt.expert_begin[e + 1]), cb});
  return tasks;
}

// Experts split into groups of similar pair counts, for the phases whose tasks are (column block, group):
// each group accumulates into its own partial output, so tasks never write the same element.
std::vector<std::vector<int>> expert_groups(const MoELoRA::Route& rt, int nblocks, int nthreads) {
  int groups = 1;
  if (nblocks < 4 * nthreads) groups = std::min<int>(static_cast<int>(rt.active.size()), ceil_div(4 * nthreads, nblocks));
  groups = std::max(groups, 1);
  std::vector<std::vector<int>> out(groups);
  int64_t done = 0;
  for (int e : rt.active) {
    const int g = std::min<int>(groups - 1, static_cast<int>(done * groups / std::max(rt.P, 1)));
    out[g].push_back(e);
    done += rt.expert_begin[e + 1] - rt.expert_begin[e];
  }
  return out;
}

// Calls fn(segment, r0, r1) for each segment of expert e that intersects rows [r0, r1).
template <typename F>
void for_segments(const MoELoRA::Route& rt, int e, int r0, int r1, F&& fn) {
  for (int i = rt.expert_seg[e]; i < rt.expert_seg[e + 1]; ++i) {
    const auto& s = rt.segs[i];
    if (s.end <= r0 || s.begin >= r1) continue;
    fn(s, std::max(s.begin, r0), std::min(s.end, r1));
  }
}

thread_local float tl_tile[2][kRowBlock * kBlockN];

// Asks for rows [p + j*ld, p + j*ld + n) of a bf16 matrix, j < rows, to be brought towards L2. A task's slice of
// LoRA B is rank short rows far apart, which the hardware prefetcher does not follow; asked for before the base
// GEMM streams its weight block, they arrive while it runs.
inline void prefetch_rows(const bf16* p, int rows, int64_t ld, int n) {
  for (int j = 0; j < rows; ++j)
    for (int c = 0; c < n; c += 32) __builtin_prefetch(p + j * ld + c, 0, 2);
}

}  // namespace

// Everything one forward keeps for the backward; also the scratch of a forward that saves nothing
// (then thread-local, so concurrent calls never share it).
struct MoELoRA::Saved {
  Route route;
  int64_t ldx = 0, ldh = 0, ldo = 0;
  Buffer<bf16> x, h;               // gathered inputs [P, ldx]; h = silu(g) u [P, ldh]
  Buffer<float> tg, tu, td;        // LoRA down-projections [P, R] (unscaled)
  Buffer<float> g, u;              // pre-activations [P, I] (save_for_backward only)
  Buffer<float> acc;               // partial outputs [groups, T, ldo]
  std::vector<float> weights;      // [T, k]
  bool pending = false;            // a backward may consume this
  // backward scratch
  Buffer<bf16> gout, dgu;          // gathered grad_out [P, ldx]; [dg | du] bf16 [P, ldgu]
  Buffer<float> t2d, t2g, t2u, gw; // dy·Bd, dg·Bg, du·Bu [P, R]; per-block partial grad_w [P, nbI]
};

// ---------------------------------------------------------------------------------------------------------------

MoELoRA::MoELoRA(int E, int H, int I, const bf16* gate, int64_t gate_es, const bf16* up, int64_t up_es,
                 const bf16* down, int64_t down_es, int max_tokens, int max_slots, const Kernels& kernels)
    : E_(E), H_(H), I_(I), max_tokens_(max_tokens), k_(kernels) {
  if (E < 1 || H < 1 || I < 1) fail("num_experts, hidden and intermediate sizes must be >= 1");
  if (max_slots < 1) fail("max_slots must be >= 1");
  gate_.init(E, I, H);
  up_.init(E, I, H);
  down_.init(E, H, I);
  global_pool()->parallel_for(E, [&](int64_t e) {
    gate_.pack(static_cast<int>(e), [&](int n, int k) { return gate[e * gate_es + static_cast<int64_t>(n) * H + k]; });
    up_.pack(static_cast<int>(e), [&](int n, int k) { return up[e * up_es + static_cast<int64_t>(n) * H + k]; });
    down_.pack(static_cast<int>(e), [&](int n, int k) { return down[e * down_es + static_cast<int64_t>(n) * I + k]; });
  });
  slots_.resize(max_slots);
  grads_.resize(max_slots);
}

MoELoRA::~MoELoRA() = default;

void MoELoRA::check_slot(int slot) const {
  if (slot < 0 || slot >= static_cast<int>(slots_.size()))
    fail("slot " + std::to_string(slot) + " out of range 0.." + std::to_string(slots_.size() - 1));
}

void MoELoRA::set_adapter(int slot, int r, float alpha, const bf16* ga, const bf16* gb, const bf16* ua,
                          const bf16* ub, const bf16* da, const bf16* db) {
  check_slot(slot);
  if (r < 1) fail("LoRA rank must be >= 1");
  auto a = std::make_shared<Adapter>();
  a->rank = r;
  a->scale = alpha / static_cast<float>(r);
  // A [E, r, in] kept as is; B [E, out, r] stored transposed as [E, r, out].
  auto copy_a = [&](std::vector<bf16>& dst, const bf16* src, int in) {
    dst.assign(src, src + static_cast<size_t>(E_) * r * in);
  };
  auto copy_bt = [&](std::vector<bf16>& dst, const bf16* src, int out) {
    dst.resize(static_cast<size_t>(E_) * r * out);
    for (int e = 0; e < E_; ++e)
      for (int n = 0; n < out; ++n)
        for (int j = 0; j < r; ++j)
          dst[(static_cast<size_t>(e) * r + j) * out + n] = src[(static_cast<size_t>(e) * out + n) * r + j];
  };
  copy_a(a->gate_a, ga, H_);
  copy_bt(a->gate_bt, gb, I_);
  copy_a(a->up_a, ua, H_);
  copy_bt(a->up_bt, ub, I_);
  copy_a(a->down_a, da, I_);
  copy_bt(a->down_bt, db, H_);
  std::lock_guard<std::mutex> lk(slots_mutex_);
  slots_[slot] = std::move(a);  // calls in flight keep the previous adapter alive through Route::keep
}

void MoELoRA::remove_adapter(int slot) {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(slots_mutex_);
  slots_[slot].reset();
}

bool MoELoRA::has_adapter(int slot) const {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(slots_mutex_);
  return static_cast<bool>(slots_[slot]);
}

void MoELoRA::set_grad_buffers(int slot, const GradBuffers& g) {
  check_slot(slot);
  std::lock_guard<std::mutex> lk(slots_mutex_);
  grads_[slot] = g;
}

void MoELoRA::ensure_backward_weights() {
  std::lock_guard<std::mutex> lk(backward_weights_mutex_);
  if (have_backward_weights_) return;
  const int kpI = static_cast<int>(round_up(I_, 2));
  down_t_.init(E_, I_, H_);
  gate_up_t_.init(E_, H_, 2 * kpI);
  global_pool()->parallel_for(E_, [&](int64_t e64) {
    const int e = static_cast<int>(e64);
    down_t_.pack(e, [&](int n, int k) { return down_.at(e, k, n); });
    gate_up_t_.pack(e, [&](int n, int k) {
      if (k < I_) return gate_.at(e, k, n);
      if (k >= kpI && k < kpI + I_) return up_.at(e, k - kpI, n);
      return bf16(0);
    });
  });
  have_backward_weights_ = true;
}

// ---------------------------------------------------------------------------------------------------------------
// Forward

void MoELoRA::forward(int T, int k, const bf16* x, const void* ids, bool ids64, const float* weights,
                      const int32_t* slots, int uniform_slot, bf16* out, bool save) {
  if (T < 0 || k < 1) fail("expected T >= 0 and k >= 1");
  if (T > max_tokens_)
    fail("T = " + std::to_string(T) + " tokens exceeds max_tokens = " + std::to_string(max_tokens_));
  thread_local Saved scratch;
  std::unique_lock<std::mutex> saved_lock(saved_mutex_, std::defer_lock);
  Saved* ws = &scratch;
  if (save) {
    saved_lock.lock();
    if (!saved_) saved_ = std::make_unique<Saved>();
    ws = saved_.get();
    ensure_backward_weights();
  }
  Route& rt = ws->route;
  {
    std::vector<std::shared_ptr<const Adapter>> table;
    {
      std::lock_guard<std::mutex> lk(slots_mutex_);
      table = slots_;
    }
    if (ids64)
      build_route(rt, E_, T, k, static_cast<const int64_t*>(ids), slots, uniform_slot, table);
    else
      build_route(rt, E_, T, k, static_cast<const int32_t*>(ids), slots, uniform_slot, table);
  }
  auto pool = global_pool();
  ThreadPool::Busy busy(*pool);
  const int P = rt.P, R = rt.R, H = H_, I = I_;
  const int nbI = gate_.nblocks, nbH = down_.nblocks;
  ws->ldx = round_up(H, 32);
  ws->ldh = round_up(I, 32);
  ws->ldo = static_cast<int64_t>(nbH) * kBlockN;
  const int64_t ldx = ws->ldx, ldh = ws->ldh, ldo = ws->ldo;
  bf16* X = ws->x.get(static_cast<size_t>(P) * ldx);
  bf16* Hb = ws->h.get(static_cast<size_t>(P) * ldh);
  float* tg = ws->tg.get(static_cast<size_t>(P) * R);
  float* tu = ws->tu.get(static_cast<size_t>(P) * R);
  float* td = ws->td.get(static_cast<size_t>(P) * R);
  float* G = save ? ws->g.get(static_cast<size_t>(P) * I) : nullptr;
  float* U = save ? ws->u.get(static_cast<size_t>(P) * I) : nullptr;
  if (save) {
    ws->weights.assign(weights, weights + static_cast<size_t>(T) * k);
    ws->pending = true;
  }

  // A: gather x rows (zero padding), t = x Aᵀ for gate and up.
  pool->parallel_for(static_cast<int64_t>(rt.chunks.size()), [&](int64_t ci) {
    const auto& c = rt.chunks[ci];
    const auto& s = rt.segs[c.seg];
    for (int p = c.begin; p < c.end; ++p) {
      std::memcpy(X + p * ldx, x + static_cast<int64_t>(rt.pair_tk[p] / k) * H, sizeof(bf16) * H);
      std::memset(X + p * ldx + H, 0, sizeof(bf16) * (ldx - H));
      std::memset(Hb + p * ldh + I, 0, sizeof(bf16) * (ldh - I));
    }
    if (const Adapter* a = rt.seg_adapter(s)) {
      const size_t off = static_cast<size_t>(s.e) * a->rank * H;
      k_.lora_a_bf16(c.end - c.begin, X + c.begin * ldx, ldx, a->gate_a.data() + off, a->rank, H, tg + c.begin * R, R);
      k_.lora_a_bf16(c.end - c.begin, X + c.begin * ldx, ldx, a->up_a.data() + off, a->rank, H, tu + c.begin * R, R);
    }
  });

  // B: g, u and h = silu(g) u for 64 columns of I and up to 64 rows of one expert.
  const auto gu_tasks = expert_block_tasks(rt, nbI);
  pool->parallel_for(static_cast<int64_t>(gu_tasks.size()), [&](int64_t ti) {
    const auto& t = gu_tasks[ti];
    const int M = t.r1 - t.r0, c0 = t.cb * kBlockN, nc = std::min(kBlockN, I - c0);
    float* Cg = tl_tile[0];
    float* Cu = tl_tile[1];
    const bf16* xr = X + t.r0 * ldx;
    for_segments(rt, t.e, t.r0, t.r1, [&](const Route::Segment& s, int, int) {
      if (const Adapter* a = rt.seg_adapter(s)) {
        const size_t off = static_cast<size_t>(t.e) * a->rank * I + c0;
        prefetch_rows(a->gate_bt.data() + off, a->rank, I, nc);
        prefetch_rows(a->up_bt.data() + off, a->rank, I, nc);
      }
    });
    k_.gemm_block_pair(M, xr, xr, ldx, gate_.block(t.e, t.cb), up_.block(t.e, t.cb), gate_.kp, Cg, Cu, kBlockN);
    for_segments(rt, t.e, t.r0, t.r1, [&](const Route::Segment& s, int b, int end) {
      const Adapter* a = rt.seg_adapter(s);
      if (!a) return;
      const size_t off = static_cast<size_t>(t.e) * a->rank * I + c0;
      k_.lora_b_add(end - b, tg + b * R, R, a->rank, a->gate_bt.data() + off, I, nc, a->scale, Cg + (b - t.r0) * kBlockN, kBlockN);
      k_.lora_b_add(end - b, tu + b * R, R, a->rank, a->up_bt.data() + off, I, nc, a->scale, Cu + (b - t.r0) * kBlockN, kBlockN);
    });
    for (int m = 0; m < M; ++m) {
      const int p = t.r0 + m;
      const float* g = Cg + m * kBlockN;
      const float* u = Cu + m * kBlockN;
      k_.swiglu(nc, g, u, Hb + p * ldh + c0);
      if (save) {
        std::memcpy(G + static_cast<int64_t>(p) * I + c0, g, sizeof(float) * nc);
        std::memcpy(U + static_cast<int64_t>(p) * I + c0, u, sizeof(float) * nc);
      }
    }
  });

  // C: t = h Adᵀ (nothing to do when no token has an adapter).
  if (!rt.keep.empty()) pool->parallel_for(static_cast<int64_t>(rt.chunks.size()), [&](int64_t ci) {
    const auto& c = rt.chunks[ci];
    const auto& s = rt.segs[c.seg];
    if (const Adapter* a = rt.seg_adapter(s))
      k_.lora_a_bf16(c.end - c.begin, Hb + c.begin * ldh, ldh, a->down_a.data() + static_cast<size_t>(s.e) * a->rank * I,
                     a->rank, I, td + c.begin * R, R);
  });

  // D: y = h Wdᵀ + s t Bdᵀ, out[t] += w y, per 64 columns of H and group of experts.
  const auto groups = expert_groups(rt, nbH, pool->num_threads());
  const int ngroups = static_cast<int>(groups.size());
  float* acc = ws->acc.get(static_cast<size_t>(ngroups) * T * ldo);
  std::memset(acc, 0, sizeof(float) * static_cast<size_t>(ngroups) * T * ldo);
  auto to_bf16_columns = [&](const float* src, int c0, int nc, bf16* dst) {  // [T, ldo] fp32 -> [T, H] bf16
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < nc; ++c) dst[static_cast<int64_t>(t) * H + c0 + c] = f32_to_bf16(src[t * ldo + c0 + c]);
  };
  pool->parallel_for(static_cast<int64_t>(nbH) * ngroups, [&](int64_t ti) {
    const int cb = static_cast<int>(ti % nbH), grp = static_cast<int>(ti / nbH);
    const int c0 = cb * kBlockN, nc = std::min(kBlockN, H - c0);
    float* part = acc + static_cast<size_t>(grp) * T * ldo;
    // Rows [r0, r1) of expert e, their base product already in C: add the LoRA term, scatter w·y into part.
    auto finish = [&](int e, int r0, int r1, float* C) {
      for_segments(rt, e, r0, r1, [&](const Route::Segment& s, int b, int end) {
        const Adapter* a = rt.seg_adapter(s);
        if (!a) return;
        k_.lora_b_add(end - b, td + b * R, R, a->rank, a->down_bt.data() + static_cast<size_t>(e) * a->rank * H + c0,
                      H, nc, a->scale, C + (b - r0) * kBlockN, kBlockN);
      });
      for (int p = r0; p < r1; ++p) {
        const int tk = rt.pair_tk[p];
        const float w = weights[tk];
        float* o = part + static_cast<int64_t>(tk / k) * ldo + c0;
        const float* y = C + (p - r0) * kBlockN;
        for (int c = 0; c < nc; ++c) o[c] += w * y[c];
      }
    };
    auto rows = [&](int e) { return rt.expert_begin[e + 1] - rt.expert_begin[e]; };
    auto prefetch_lora = [&](int e) {
      for_segments(rt, e, rt.expert_begin[e], rt.expert_begin[e + 1], [&](const Route::Segment& s, int, int) {
        if (const Adapter* a = rt.seg_adapter(s))
          prefetch_rows(a->down_bt.data() + static_cast<size_t>(e) * a->rank * H + c0, a->rank, H, nc);
      });
    };
    const auto& es = groups[grp];
    for (size_t i = 0; i < es.size(); ++i) {
      const int e = es[i], b = rt.expert_begin[e];
      if (i + 1 < es.size() && std::min(rows(e), rows(es[i + 1])) <= kPairRows &&
          std::max(rows(e), rows(es[i + 1])) <= kRowBlock) {
        // Two small experts side by side (decode): their common rows stream both blocks at once; the longer
        // one's remaining rows then find its block in L2.
        const int e2 = es[++i], b2 = rt.expert_begin[e2], n = rows(e), n2 = rows(e2), m = std::min(n, n2);
        prefetch_lora(e);
        prefetch_lora(e2);
        float* C = tl_tile[0];
        float* C2 = tl_tile[1];
        k_.gemm_block_pair(m, Hb + b * ldh, Hb + b2 * ldh, ldh, down_.block(e, cb), down_.block(e2, cb), down_.kp, C,
                           C2, kBlockN);
        if (n > m) k_.gemm_block(n - m, Hb + (b + m) * ldh, ldh, down_.block(e, cb), down_.kp, C + m * kBlockN, kBlockN);
        if (n2 > m)
          k_.gemm_block(n2 - m, Hb + (b2 + m) * ldh, ldh, down_.block(e2, cb), down_.kp, C2 + m * kBlockN, kBlockN);
        finish(e, b, b + n, C);
        finish(e2, b2, b2 + n2, C2);
        continue;
      }
      prefetch_lora(e);
      for (int r0 = b; r0 < rt.expert_begin[e + 1]; r0 += kRowBlock) {
        const int r1 = std::min(r0 + kRowBlock, rt.expert_begin[e + 1]);
        k_.gemm_block(r1 - r0, Hb + r0 * ldh, ldh, down_.block(e, cb), down_.kp, tl_tile[0], kBlockN);
        finish(e, r0, r1, tl_tile[0]);
      }
    }
    if (ngroups == 1) to_bf16_columns(part, c0, nc, out);
  });
  if (ngroups > 1) {
    pool->parallel_for(nbH, [&](int64_t cb) {
      const int c0 = static_cast<int>(cb) * kBlockN, nc = std::min(kBlockN, H - c0);
      for (int g = 1; g < ngroups; ++g)
        for (int t = 0; t < T; ++t)
          for (int c = 0; c < nc; ++c) acc[t * ldo + c0 + c] += acc[(static_cast<size_t>(g) * T + t) * ldo + c0 + c];
      to_bf16_columns(acc, c0, nc, out);
    });
  }
  if (!save) rt.keep.clear();  // do not pin adapters beyond the call
}

// ---------------------------------------------------------------------------------------------------------------
// Backward (weights frozen). With gₜ = grad_out[t] and w = topk weight of the pair:
//   q = gₜ Wd + s (gₜ Bd) Ad            (= ∂<gₜ, y>/∂h, unweighted)
//   grad_w = <q, h>,  dh = w q,  du = dh silu(g),  dg = dh u silu'(g)
//   dx_pair = dg Wg + du Wu + s (dg Bg) Ag + s (du Bu) Au,  grad_x[t] = Σ_k dx_pair
//   LoRA:  dBg += s dgᵀ (x Agᵀ)   dAg += s (dg Bg)ᵀ x    (same for up)
//          dBd += s (w gₜ)ᵀ (h Adᵀ)   dAd += s (w gₜ Bd)ᵀ h
// Phases: B1 gather gₜ, t2d = gₜ Bd | B2 q, grad_w partials, dg, du (64 columns of I) | B3 t2g, t2u |
//         B4 dx per 64 columns of H | B5 the six LoRA gradients | B6 reduce grad_x, grad_w.

void MoELoRA::backward(const bf16* grad_out, bf16* grad_x, float* grad_w) {
  std::lock_guard<std::mutex> saved_lock(saved_mutex_);
  if (!saved_ || !saved_->pending) fail("backward() needs a preceding forward_sft(..., save_for_backward=True)");
  Saved& ws = *saved_;
  ws.pending = false;
  const Route& rt = ws.route;
  const int T = rt.T, k = rt.k, P = rt.P, R = rt.R, H = H_, I = I_;
  std::vector<GradBuffers> grads;
  {
    std::lock_guard<std::mutex> lk(slots_mutex_);
    grads = grads_;
  }
  for (const auto& s : rt.segs)
    if (s.slot >= 0 && !grads[s.slot].gate_a)
      fail("backward: slot " + std::to_string(s.slot) + " has no gradient buffers (call set_grad_buffers first)");
  auto pool = global_pool();
  ThreadPool::Busy busy(*pool);
  const int kpI = static_cast<int>(round_up(I, 2));
  const int nbI = gate_.nblocks, nbH = down_.nblocks;
  const int64_t ldx = ws.ldx, ldh = ws.ldh, ldo = ws.ldo, ldgu = round_up(2 * kpI, 32);
  const bf16* X = ws.x.data();
  const bf16* Hb = ws.h.data();
  const float *tg = ws.tg.data(), *tu = ws.tu.data(), *td = ws.td.data();
  float* G = ws.g.data();  // becomes dg in B2
  float* U = ws.u.data();  // becomes du in B2
  const float* wts = ws.weights.data();
  bf16* gout = ws.gout.get(static_cast<size_t>(P) * ldx);
  bf16* dgu = ws.dgu.get(static_cast<size_t>(P) * ldgu);
  float* t2d = ws.t2d.get(static_cast<size_t>(P) * R);
  float* t2g = ws.t2g.get(static_cast<size_t>(P) * R);
  float* t2u = ws.t2u.get(static_cast<size_t>(P) * R);
  float* gw = ws.gw.get(static_cast<size_t>(P) * nbI);
  auto pair_w = [&](int p) { return wts[rt.pair_tk[p]]; };

  // B1
  pool->parallel_for(static_cast<int64_t>(rt.chunks.size()), [&](int64_t ci) {
    const auto& c = rt.chunks[ci];
    const auto& s = rt.segs[c.seg];
    for (int p = c.begin; p < c.end; ++p) {
      std::memcpy(gout + p * ldx, grad_out + static_cast<int64_t>(rt.pair_tk[p] / k) * H, sizeof(bf16) * H);
      std::memset(gout + p * ldx + H, 0, sizeof(bf16) * (ldx - H));
      std::memset(dgu + p * ldgu, 0, sizeof(bf16) * ldgu);
    }
    if (const Adapter* a = rt.seg_adapter(s))
      k_.lora_a_bf16(c.end - c.begin, gout + c.begin * ldx, ldx, a->down_bt.data() + static_cast<size_t>(s.e) * a->rank * H,
                     a->rank, H, t2d + c.begin * R, R);
  });

  // B2
  const auto q_tasks = expert_block_tasks(rt, nbI);
  pool->parallel_for(static_cast<int64_t>(q_tasks.size()), [&](int64_t ti) {
    const auto& t = q_tasks[ti];
    const int M = t.r1 - t.r0, c0 = t.cb * kBlockN, nc = std::min(kBlockN, I - c0);
    float* Q = tl_tile[0];
    k_.gemm_block(M, gout + t.r0 * ldx, ldx, down_t_.block(t.e, t.cb), down_t_.kp, Q, kBlockN);
    for_segments(rt, t.e, t.r0, t.r1, [&](const Route::Segment& s, int b, int end) {
      const Adapter* a = rt.seg_adapter(s);
      if (!a) return;
      k_.lora_b_add(end - b, t2d + b * R, R, a->rank, a->down_a.data() + static_cast<size_t>(t.e) * a->rank * I + c0, I,
                    nc, a->scale, Q + (b - t.r0) * kBlockN, kBlockN);
    });
    for (int m = 0; m < M; ++m) {
      const int p = t.r0 + m;
      const int64_t gu = static_cast<int64_t>(p) * I + c0;
      gw[static_cast<int64_t>(p) * nbI + t.cb] =
          k_.swiglu_backward(nc, pair_w(p), Q + m * kBlockN, Hb + p * ldh + c0, G + gu, U + gu, dgu + p * ldgu + c0,
                             dgu + p * ldgu + kpI + c0);
    }
  });

  // B3
  pool->parallel_for(static_cast<int64_t>(rt.chunks.size()), [&](int64_t ci) {
    const auto& c = rt.chunks[ci];
    const auto& s = rt.segs[c.seg];
    if (const Adapter* a = rt.seg_adapter(s)) {
      const size_t off = static_cast<size_t>(s.e) * a->rank * I;
      k_.lora_a_f32(c.end - c.begin, G + static_cast<int64_t>(c.begin) * I, I, a->gate_bt.data() + off, a->rank, I, t2g + c.begin * R, R);
      k_.lora_a_f32(c.end - c.begin, U + static_cast<int64_t>(c.begin) * I, I, a->up_bt.data() + off, a->rank, I, t2u + c.begin * R, R);
    }
  });

  // B4: dx per 64 columns of H and group of experts.
  const auto groups = expert_groups(rt, nbH, pool->num_threads());
  const int ngroups = static_cast<int>(groups.size());
  float* acc = ws.acc.get(static_cast<size_t>(ngroups) * T * ldo);
  std::memset(acc, 0, sizeof(float) * static_cast<size_t>(ngroups) * T * ldo);
  auto to_bf16_columns = [&](const float* src, int c0, int nc) {
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < nc; ++c) grad_x[static_cast<int64_t>(t) * H + c0 + c] = f32_to_bf16(src[t * ldo + c0 + c]);
  };
  pool->parallel_for(static_cast<int64_t>(nbH) * ngroups, [&](int64_t ti) {
    const int cb = static_cast<int>(ti % nbH), grp = static_cast<int>(ti / nbH);
    const int c0 = cb * kBlockN, nc = std::min(kBlockN, H - c0);
    float* part = acc + static_cast<size_t>(grp) * T * ldo;
    float* C = tl_tile[0];
    for (int e : groups[grp]) {
      for (int r0 = rt.expert_begin[e]; r0 < rt.expert_begin[e + 1]; r0 += kRowBlock) {
        const int r1 = std::min(r0 + kRowBlock, rt.expert_begin[e + 1]);
        k_.gemm_block(r1 - r0, dgu + r0 * ldgu, ldgu, gate_up_t_.block(e, cb), gate_up_t_.kp, C, kBlockN);
        for_segments(rt, e, r0, r1, [&](const Route::Segment& s, int b, int end) {
          const Adapter* a = rt.seg_adapter(s);
          if (!a) return;
          const size_t off = static_cast<size_t>(e) * a->rank * H + c0;
          k_.lora_b_add(end - b, t2g + b * R, R, a->rank, a->gate_a.data() + off, H, nc, a->scale, C + (b - r0) * kBlockN, kBlockN);
          k_.lora_b_add(end - b, t2u + b * R, R, a->rank, a->up_a.data() + off, H, nc, a->scale, C + (b - r0) * kBlockN, kBlockN);
        });
        for (int p = r0; p < r1; ++p) {
          float* o = part + static_cast<int64_t>(rt.pair_tk[p] / k) * ldo + c0;
          const float* y = C + (p - r0) * kBlockN;
          for (int c = 0; c < nc; ++c) o[c] += y[c];
        }
      }
    }
    if (ngroups == 1) to_bf16_columns(part, c0, nc);
  });
  if (ngroups > 1) {
    pool->parallel_for(nbH, [&](int64_t cb) {
      const int c0 = static_cast<int>(cb) * kBlockN, nc = std::min(kBlockN, H - c0);
      for (int g = 1; g < ngroups; ++g)
        for (int t = 0; t < T; ++t)
          for (int c = 0; c < nc; ++c) acc[t * ldo + c0 + c] += acc[(static_cast<size_t>(g) * T + t) * ldo + c0 + c];
      to_bf16_columns(acc, c0, nc);
    });
  }

  // B5: LoRA gradients. Each task owns one column block of one gradient of one (expert, slot) segment.
  enum Kind { kGateB, kUpB, kDownA, kGateA, kUpA, kDownB };
  struct GradTask {
    int seg, kind, cb;
  };
  std::vector<GradTask> gtasks;
  for (int si = 0; si < static_cast<int>(rt.segs.size()); ++si) {
    if (rt.segs[si].slot < 0) continue;
    for (int kind : {kGateB, kUpB, kDownA})
      for (int cb = 0; cb < nbI; ++cb) gtasks.push_back({si, kind, cb});
    for (int kind : {kGateA, kUpA, kDownB})
      for (int cb = 0; cb < nbH; ++cb) gtasks.push_back({si, kind, cb});
  }
  pool->parallel_for(static_cast<int64_t>(gtasks.size()), [&](int64_t ti) {
    const auto& gt = gtasks[ti];
    const auto& s = rt.segs[gt.seg];
    const Adapter* a = rt.seg_adapter(s);
    const GradBuffers& gb = grads[s.slot];
    const int r = a->rank, e = s.e, M = s.end - s.begin, b = s.begin;
    const int c0 = gt.cb * kBlockN;
    const float sc = a->scale;
    // Scaled-by-w copies of the rank-sized rows, for the down gradients.
    auto weighted = [&](const float* src, std::vector<float>& dst) {
      dst.resize(static_cast<size_t>(M) * r);
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < r; ++j) dst[static_cast<size_t>(m) * r + j] = pair_w(b + m) * src[(b + m) * R + j];
    };
    // B gradients [out, r]: accumulate the transposed [r, 64] tile with outer_acc, then add it transposed.
    auto add_b = [&](float* gbuf, int out, const float* tile, int nc) {
      float* dst = gbuf + (static_cast<size_t>(e) * out + c0) * r;
      for (int c = 0; c < nc; ++c)
        for (int j = 0; j < r; ++j) dst[c * r + j] += tile[j * kBlockN + c];
    };
    std::vector<float> tile_buf(static_cast<size_t>(r) * kBlockN);
    float* tile = tile_buf.data();
    switch (gt.kind) {
      case kGateB:
      case kUpB: {
        const int nc = std::min(kBlockN, I - c0);
        std::memset(tile, 0, sizeof(float) * r * kBlockN);
        const bool gate = gt.kind == kGateB;
        k_.outer_acc_f32(M, (gate ? tg : tu) + b * R, R, r, (gate ? G : U) + static_cast<int64_t>(b) * I + c0, I, nc, sc,
                         tile, kBlockN);
        add_b(gate ? gb.gate_b : gb.up_b, I, tile, nc);
        break;
      }
      case kDownB: {
        const int nc = std::min(kBlockN, H - c0);
        std::vector<float> wtd;
        weighted(td, wtd);
        std::memset(tile, 0, sizeof(float) * r * kBlockN);
        k_.outer_acc_bf16(M, wtd.data(), r, r, gout + b * ldx + c0, ldx, nc, sc, tile, kBlockN);
        add_b(gb.down_b, H, tile, nc);
        break;
      }
      case kGateA:
      case kUpA: {
        const int nc = std::min(kBlockN, H - c0);
        const bool gate = gt.kind == kGateA;
        k_.outer_acc_bf16(M, (gate ? t2g : t2u) + b * R, R, r, X + b * ldx + c0, ldx, nc, sc,
                          (gate ? gb.gate_a : gb.up_a) + static_cast<size_t>(e) * r * H + c0, H);
        break;
      }
      case kDownA: {
        const int nc = std::min(kBlockN, I - c0);
        std::vector<float> wt2d;
        weighted(t2d, wt2d);
        k_.outer_acc_bf16(M, wt2d.data(), r, r, Hb + b * ldh + c0, ldh, nc, sc,
                          gb.down_a + static_cast<size_t>(e) * r * I + c0, I);
        break;
      }
    }
  });

  // B6: routing-weight gradients (0 for skipped pairs).
  for (int64_t i = 0; i < static_cast<int64_t>(T) * k; ++i) {
    const int p = rt.tk_pair[i];
    float v = 0.f;
    if (p >= 0)
      for (int cb = 0; cb < nbI; ++cb) v += gw[static_cast<int64_t>(p) * nbI + cb];
    grad_w[i] = v;
  }
  ws.route.keep.clear();
}

}  // namespace kt
