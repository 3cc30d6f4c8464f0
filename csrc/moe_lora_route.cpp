// Routing and work split: pairs sorted by expert and slot, the task lists of the phases, the reduction of
// per-group partial outputs.
#include "moe_lora_internal.h"

namespace kt {

namespace {

template <typename Id>
void build_route_ids(MoELoRA::Route& rt, int E, int T, int k, const Id* ids, const int32_t* slots,
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

void build_route(MoELoRA::Route& rt, int E, int T, int k, const void* ids, bool ids64, const int32_t* slots,
                 int uniform_slot, const std::vector<std::shared_ptr<const Adapter>>& table) {
  if (ids64)
    build_route_ids(rt, E, T, k, static_cast<const int64_t*>(ids), slots, uniform_slot, table);
  else
    build_route_ids(rt, E, T, k, static_cast<const int32_t*>(ids), slots, uniform_slot, table);
}

std::vector<BlockTask> expert_block_tasks(const MoELoRA::Route& rt, int nblocks) {
  std::vector<BlockTask> tasks;
  for (int e : rt.active)
    for (int cb = 0; cb < nblocks; ++cb) tasks.push_back({e, rt.expert_begin[e], rt.expert_begin[e + 1], cb});
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
