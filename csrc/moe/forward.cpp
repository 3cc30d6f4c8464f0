// MoEExperts::forward: phases A-D of moe/experts_internal.h.
#include <cstring>

#include "moe/experts_internal.h"

namespace kt {

namespace {

// T[p] = dropout(V[p]) Aᵀ for the sorted pairs p in [b, end) (rows of V with stride ldv, K columns), one row at
// a time through a K-float scratch row, so no dropped copy of the inputs is ever kept.
void lora_a_dropped(const Kernels& kern, const DropoutMask& mask, const MoEExperts::Route& rt, int b, int end,
                    const bf16* V, int64_t ldv, const bf16* A, int r, int K, float* T, int64_t ldt) {
  thread_local Buffer<float> row;
  float* dropped = row.get(K);
  for (int p = b; p < end; ++p) {
    mask.apply(rt.pair_tk[p], 0, K, V + p * ldv, dropped);
    kern.lora_a_f32(1, dropped, K, A, r, K, T + p * ldt, ldt);
  }
}

}  // namespace

void MoEExperts::forward(int T, int k, const bf16* x, const void* ids, bool ids64, const float* weights,
                      const int32_t* slots, int uniform_slot, bf16* out, bool save,
                      const Dropout& dropout) {
  if (T < 0 || k < 1) fail("expected T >= 0 and k >= 1");
  if (T > max_tokens_)
    fail("T = " + std::to_string(T) + " tokens exceeds max_tokens = " + std::to_string(max_tokens_));
  if (!(dropout.p >= 0.0 && dropout.p < 1.0)) fail("dropout must be in [0, 1), got " + std::to_string(dropout.p));
  thread_local Saved scratch;
  std::unique_lock<std::mutex> saved_lock(saved_mutex_, std::defer_lock);
  Saved* ws = &scratch;
  if (save) {
    saved_lock.lock();
    if (!saved_) saved_ = std::make_unique<Saved>();
    ws = saved_.get();
  }
  Route& rt = ws->route;
  {
    std::vector<std::shared_ptr<const Adapter>> table;
    {
      std::lock_guard<std::mutex> lk(slots_mutex_);
      table = slots_;
    }
    build_route(rt, E_, T, k, ids, ids64, slots, uniform_slot, table);
  }
  auto pool = global_pool();
  ThreadPool::Busy busy(*pool);
  const int P = rt.P, R = rt.R, H = H_, I = I_;
  const int nbI = gate_.nblocks, nbH = down_.nblocks;
  ws->ldx = round_up(H, 32);
  ws->ldh = round_up(I, 32);
  const int64_t ldx = ws->ldx, ldh = ws->ldh;
  bf16* X = ws->x.get(static_cast<size_t>(P) * ldx);
  bf16* Hb = ws->h.get(static_cast<size_t>(P) * ldh);
  float* tg = ws->tg.get(static_cast<size_t>(P) * R);
  float* tu = ws->tu.get(static_cast<size_t>(P) * R);
  float* td = ws->td.get(static_cast<size_t>(P) * R);
  float* G = save ? ws->g.get(static_cast<size_t>(P) * I) : nullptr;
  float* U = save ? ws->u.get(static_cast<size_t>(P) * I) : nullptr;
  if (save) {
    ws->weights.assign(weights, weights + static_cast<size_t>(T) * k);
    ws->dropout = dropout;
    ws->pending = true;
  }
  const bool drop = dropout.on();
  const bool qx = gate_.layout.integer(), qh = down_.layout.integer();  // rows quantized once for all blocks
  if (qx) ws->xq.reserve(P, static_cast<int>(ldx));
  if (qh) ws->hq.reserve(P, static_cast<int>(ldh));
  const DropoutMask gate_mask(dropout, 0), up_mask(dropout, 1), down_mask(dropout, 2);

  // A: gather x rows (zero padding), t = x Aᵀ (dropout(x) Aᵀ when dropping) for gate and up.
  pool->parallel_for(static_cast<int64_t>(rt.chunks.size()), [&](int64_t ci) {
    const auto& c = rt.chunks[ci];
    const auto& s = rt.segs[c.seg];
    for (int p = c.begin; p < c.end; ++p) {
      std::memcpy(X + p * ldx, x + static_cast<int64_t>(rt.pair_tk[p] / k) * H, sizeof(bf16) * H);
      std::memset(X + p * ldx + H, 0, sizeof(bf16) * (ldx - H));
      std::memset(Hb + p * ldh + I, 0, sizeof(bf16) * (ldh - I));
    }
    if (qx) ws->xq.quantize(k_, c.begin, c.end - c.begin, X + c.begin * ldx, ldx, static_cast<int>(ldx));
    const Adapter* a = rt.seg_adapter(s);
    if (!a) return;
    const size_t off = static_cast<size_t>(s.e) * a->rank * H;
    const bf16 *Ag = a->gate_a.data() + off, *Au = a->up_a.data() + off;
    if (drop) {
      lora_a_dropped(k_, gate_mask, rt, c.begin, c.end, X, ldx, Ag, a->rank, H, tg, R);
      lora_a_dropped(k_, up_mask, rt, c.begin, c.end, X, ldx, Au, a->rank, H, tu, R);
    } else {
      k_.lora_a_bf16(c.end - c.begin, X + c.begin * ldx, ldx, Ag, a->rank, H, tg + c.begin * R, R);
      k_.lora_a_bf16(c.end - c.begin, X + c.begin * ldx, ldx, Au, a->rank, H, tu + c.begin * R, R);
    }
  });

  // B: g, u and h = silu(g) u for 64 columns of I and up to 64 rows of one expert.
  const int64_t gu_blocks = static_cast<int64_t>(rt.active.size()) * nbI;
  const auto gu_tasks =
      expert_block_tasks(rt, nbI, decode_sized(rt) ? block_span(gu_blocks, nbI, pool->num_threads()) : 1);
  pool->parallel_for(static_cast<int64_t>(gu_tasks.size()), [&](int64_t ti) {
    for_row_blocks(gu_tasks[ti], [&](const BlockTask& t) {
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
      const Int16Rows xrq = qx ? ws->xq.at(t.r0) : Int16Rows{};
      gemm_block_pair(k_, M, xr, xr, ldx, gate_, t.e, t.cb, up_, t.e, t.cb, Cg, Cu, kBlockN, qx ? &xrq : nullptr,
                      qx ? &xrq : nullptr);
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
  });

  // C: t = h Adᵀ, or dropout(h) Adᵀ, and h quantized for integer down weights (nothing to do without either).
  if (!rt.keep.empty() || qh) pool->parallel_for(static_cast<int64_t>(rt.chunks.size()), [&](int64_t ci) {
    const auto& c = rt.chunks[ci];
    const auto& s = rt.segs[c.seg];
    if (qh) ws->hq.quantize(k_, c.begin, c.end - c.begin, Hb + c.begin * ldh, ldh, static_cast<int>(ldh));
    const Adapter* a = rt.seg_adapter(s);
    if (!a) return;
    const bf16* Ad = a->down_a.data() + static_cast<size_t>(s.e) * a->rank * I;
    if (drop)
      lora_a_dropped(k_, down_mask, rt, c.begin, c.end, Hb, ldh, Ad, a->rank, I, td, R);
    else
      k_.lora_a_bf16(c.end - c.begin, Hb + c.begin * ldh, ldh, Ad, a->rank, I, td + c.begin * R, R);
  });

  // D: y = h Wdᵀ + s t Bdᵀ, out[t] += w y, per group of experts and span of 64-column blocks of H (column_tasks).
  const ColumnTasks ct = column_tasks(rt, nbH, pool->num_threads(), true);
  const int ngroups = static_cast<int>(ct.groups.size());
  const PartialOutputs acc(ws->acc, ngroups, T, nbH);
  auto hrows = [&](int row) { return qh ? ws->hq.at(row) : Int16Rows{}; };
  auto hq = [&](const Int16Rows& r) { return qh ? &r : nullptr; };
  pool->parallel_for(ct.size(), [&](int64_t ti) {
    const int grp = static_cast<int>(ti / ct.nspans), cb0 = static_cast<int>(ti % ct.nspans) * ct.span;
    const int cb1 = std::min(nbH, cb0 + ct.span);
    for (int cb = cb0; cb < cb1; ++cb) acc.zeroed(grp, cb);
    // Rows [r0, r1) of expert e, their base product of block cb already in C: add the LoRA term, scatter w·y into
    // the group's partial output.
    auto finish = [&](int e, int cb, int r0, int r1, float* C) {
      const int c0 = cb * kBlockN, nc = std::min(kBlockN, H - c0);
      for_segments(rt, e, r0, r1, [&](const Route::Segment& s, int b, int end) {
        const Adapter* a = rt.seg_adapter(s);
        if (!a) return;
        k_.lora_b_add(end - b, td + b * R, R, a->rank, a->down_bt.data() + static_cast<size_t>(e) * a->rank * H + c0,
                      H, nc, a->scale, C + (b - r0) * kBlockN, kBlockN);
      });
      float* part = acc.slice(grp, cb);
      for (int p = r0; p < r1; ++p) {
        const int tk = rt.pair_tk[p];
        const float w = weights[tk];
        float* o = part + (tk / k) * kBlockN;
        const float* y = C + (p - r0) * kBlockN;
        for (int c = 0; c < nc; ++c) o[c] += w * y[c];
      }
    };
    auto rows = [&](int e) { return rt.expert_begin[e + 1] - rt.expert_begin[e]; };
    auto prefetch_lora = [&](int e, int cb) {
      const int c0 = cb * kBlockN, nc = std::min(kBlockN, H - c0);
      for_segments(rt, e, rt.expert_begin[e], rt.expert_begin[e + 1], [&](const Route::Segment& s, int, int) {
        if (const Adapter* a = rt.seg_adapter(s))
          prefetch_rows(a->down_bt.data() + static_cast<size_t>(e) * a->rank * H + c0, a->rank, H, nc);
      });
    };
    const auto& es = ct.groups[grp];
    for (size_t i = 0; i < es.size(); ++i) {
      const int e = es[i], b = rt.expert_begin[e];
      if (i + 1 < es.size() && std::min(rows(e), rows(es[i + 1])) <= kPairRows &&
          std::max(rows(e), rows(es[i + 1])) <= kRowBlock) {
        // Two small experts side by side (decode): their common rows stream both blocks at once; the longer
        // one's remaining rows then find its block in L2.
        const int e2 = es[++i], b2 = rt.expert_begin[e2], n = rows(e), n2 = rows(e2), m = std::min(n, n2);
        const Int16Rows h0 = hrows(b), h1 = hrows(b2), h0m = hrows(b + m), h1m = hrows(b2 + m);
        for (int cb = cb0; cb < cb1; ++cb) {
          prefetch_lora(e, cb);
          prefetch_lora(e2, cb);
          float* C = tl_tile[0];
          float* C2 = tl_tile[1];
          gemm_block_pair(k_, m, Hb + b * ldh, Hb + b2 * ldh, ldh, down_, e, cb, down_, e2, cb, C, C2, kBlockN, hq(h0),
                          hq(h1));
          if (n > m) gemm_block(k_, n - m, Hb + (b + m) * ldh, ldh, down_, e, cb, C + m * kBlockN, kBlockN, hq(h0m));
          if (n2 > m)
            gemm_block(k_, n2 - m, Hb + (b2 + m) * ldh, ldh, down_, e2, cb, C2 + m * kBlockN, kBlockN, hq(h1m));
          finish(e, cb, b, b + n, C);
          finish(e2, cb, b2, b2 + n2, C2);
        }
        continue;
      }
      for (int cb = cb0; cb < cb1; ++cb) {
        prefetch_lora(e, cb);
        for (int r0 = b, r1; r0 < rt.expert_begin[e + 1]; r0 = r1) {
          r1 = run_end(r0, rt.expert_begin[e + 1]);
          const Int16Rows h = hrows(r0);
          gemm_block(k_, r1 - r0, Hb + r0 * ldh, ldh, down_, e, cb, tl_tile[0], kBlockN, hq(h));
          finish(e, cb, r0, r1, tl_tile[0]);
        }
      }
    }
    if (ngroups == 1)
      for (int cb = cb0; cb < cb1; ++cb) acc.store(cb, H, out);
  });
  if (ngroups > 1) pool->parallel_for(nbH, [&](int64_t cb) { acc.store(static_cast<int>(cb), H, out); });
  if (!save) rt.keep.clear();  // do not pin adapters beyond the call
}

}  // namespace kt
