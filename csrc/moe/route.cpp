// Routing and work split: pairs sorted by expert and slot, the task lists of the phases, the reduction of
// per-group partial outputs.
#include <algorithm>

#include "moe/experts_internal.h"

namespace kt {

namespace {

template <typename Id>
void build_route_ids(MoEExperts::Route& rt, int E, int T, int k, const Id* ids, const int32_t* slots,
                     int uniform_slot, const std::vector<std::shared_ptr<const Adapter>>& table) {
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

}  // namespace

void build_route(MoEExperts::Route& rt, int E, int T, int k, const void* ids, bool ids64, const int32_t* slots,
                 int uniform_slot, const std::vector<std::shared_ptr<const Adapter>>& table) {
  if (ids64)
    build_route_ids(rt, E, T, k, static_cast<const int64_t*>(ids), slots, uniform_slot, table);
  else
    build_route_ids(rt, E, T, k, static_cast<const int32_t*>(ids), slots, uniform_slot, table);
}

std::vector<BlockTask> expert_block_tasks(const MoEExperts::Route& rt, int nblocks, int span) {
  std::vector<BlockTask> tasks;
  for (int e : rt.active)
    for (int cb = 0; cb < nblocks; cb += span)
      tasks.push_back({e, rt.expert_begin[e], rt.expert_begin[e + 1], cb, std::min(nblocks, cb + span)});
  return tasks;
}

// Measured on a 2-core Zen 4 VM, MoE forward of E=64 top-8, H=2048, I=768 from DRAM, alternating call by call in
// one process with tasks of one block: T=1 int4 1.21x, fp8 1.07x, int8 1.04x, bf16 1.02x faster; T=8 int4
// 1.17-1.21x and int8 1.04-1.05x in the runs where the VM gave int8 4.3 ms, 0.99-1.01x in those where it gave
// 5.4. A 2-thread read of 24 KiB blocks ran at 18-25 GB/s there, of 1 MiB runs at 28-31. Calls with more rows
// (T=64, 512) lost 0.5-1.5% to the coarser tasks' uneven ends: decode_sized keeps them at one block.
int block_span(int64_t tasks, int nblocks, int nthreads) {
  return static_cast<int>(std::clamp<int64_t>(tasks / (kTasksPerThread * static_cast<int64_t>(nthreads)), 1, nblocks));
}

bool decode_sized(const MoEExperts::Route& rt) { return rt.P <= kPairRows * static_cast<int64_t>(rt.active.size()); }

namespace {

// A group's partial output up to this size counts as a few tokens' (column_tasks): summing the groups' costs
// little next to streaming the experts.
constexpr int64_t kSmallPartialBytes = int64_t(256) << 10;

}  // namespace

ColumnTasks column_tasks(const MoEExperts::Route& rt, int nblocks, int nthreads, bool long_spans) {
  ColumnTasks out;
  const int nactive = static_cast<int>(rt.active.size());
  if (long_spans && nactive > 0 && decode_sized(rt) &&
      static_cast<int64_t>(rt.T) * nblocks * kBlockN * sizeof(float) <= kSmallPartialBytes) {
    for (int i = 0; i < nactive; i += 2)
      out.groups.push_back(i + 1 < nactive ? std::vector<int>{rt.active[i], rt.active[i + 1]} : std::vector<int>{rt.active[i]});
    out.span = block_span(static_cast<int64_t>(out.groups.size()) * nblocks, nblocks, nthreads);
    out.nspans = ceil_div(nblocks, out.span);
    return out;
  }
  int groups = 1;
  if (nblocks < kTasksPerThread * nthreads) groups = std::min(nactive, ceil_div(kTasksPerThread * nthreads, nblocks));
  groups = std::max(groups, 1);
  out.groups.resize(groups);
  int64_t done = 0;
  for (int e : rt.active) {
    const int g = std::min<int>(groups - 1, static_cast<int>(done * groups / std::max(rt.P, 1)));
    out.groups[g].push_back(e);
    done += rt.expert_begin[e + 1] - rt.expert_begin[e];
  }
  out.nspans = nblocks;
  return out;
}

void PartialOutputs::store(int cb, int H, bf16* dst) const {
  const int c0 = cb * kBlockN, nc = std::min(kBlockN, H - c0);
  float* acc = slice(0, cb);
  for (int g = 1; g < groups; ++g) {
    const float* part = slice(g, cb);
    for (int i = 0; i < T * kBlockN; ++i) acc[i] += part[i];
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < nc; ++c) dst[static_cast<int64_t>(t) * H + c0 + c] = f32_to_bf16(acc[t * kBlockN + c]);
}

}  // namespace kt
