// MoEExperts::backward (weights frozen). With gₜ = grad_out[t] and w = topk weight of the pair:
//   q = gₜ Wd + s (gₜ Bd) Ad            (= ∂<gₜ, y>/∂h, unweighted)
//   grad_w = <q, h>,  dh = w q,  du = dh silu(g),  dg = dh u silu'(g)
//   dx_pair = dg Wg + du Wu + s (dg Bg) Ag + s (du Bu) Au,  grad_x[t] = Σ_k dx_pair
//   LoRA:  dBg += s dgᵀ (x Agᵀ)   dAg += s (dg Bg)ᵀ x    (same for up)
//          dBd += s (w gₜ)ᵀ (h Adᵀ)   dAd += s (w gₜ Bd)ᵀ h
// With dropout (moe/dropout.h) every x, h inside a LoRA term above is dropout(x), dropout(h): the saved t = … Aᵀ
// already are, so the B gradients need nothing more; the A gradients read the dropped inputs again, and the
// LoRA terms of q and dx_pair, gradients with respect to a dropped input, are masked and scaled.
// Phases: B1 gather gₜ, t2d = gₜ Bd | B2 q, grad_w partials, dg, du (64 columns of I) | B3 t2g, t2u |
//         B4 dx per 64 columns of H | B5 the six LoRA gradients | B6 reduce grad_x, grad_w.
#include <cstring>

#include "moe/experts_internal.h"

namespace kt {

namespace {

// C[p - b] += s T[p] BT over nc columns from c0 for the sorted pairs p in [b, end) (C: stride kBlockN): directly,
// or, with a mask, through a zeroed tile, masked and scaled on the way.
void lora_b_add_masked(const Kernels& kern, const DropoutMask* mask, const MoEExperts::Route& rt, int b, int end,
                       const float* T, int64_t ldt, int r, const bf16* BT, int64_t ldb, int c0, int nc, float s,
                       float* C) {
  if (!mask) return kern.lora_b_add(end - b, T + b * ldt, ldt, r, BT, ldb, nc, s, C, kBlockN);
  float* L = tl_tile[1];
  std::memset(L, 0, sizeof(float) * (end - b) * kBlockN);
  kern.lora_b_add(end - b, T + b * ldt, ldt, r, BT, ldb, nc, s, L, kBlockN);
  for (int p = b; p < end; ++p) mask->add(rt.pair_tk[p], c0, nc, L + (p - b) * kBlockN, C + (p - b) * kBlockN);
}

}  // namespace

void MoEExperts::backward(const bf16* grad_out, bf16* grad_x, float* grad_w) {
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
  const int64_t ldx = ws.ldx, ldh = ws.ldh, ldgu = round_up(2 * kpI, 32);
  const bf16* X = ws.x.data();
  const bf16* Hb = ws.h.data();
  const float *tg = ws.tg.data(), *tu = ws.tu.data(), *td = ws.td.data();
  float* G = ws.g.data();  // becomes dg in B2
  float* U = ws.u.data();  // becomes du in B2
  const float* wts = ws.weights.data();
  thread_local BackwardScratch scratch;
  bf16* gout = scratch.gout.get(static_cast<size_t>(P) * ldx);
  bf16* dgu = scratch.dgu.get(static_cast<size_t>(P) * ldgu);
  float* t2d = scratch.t2d.get(static_cast<size_t>(P) * R);
  float* t2g = scratch.t2g.get(static_cast<size_t>(P) * R);
  float* t2u = scratch.t2u.get(static_cast<size_t>(P) * R);
  float* gw = scratch.gw.get(static_cast<size_t>(P) * nbI);
  auto pair_w = [&](int p) { return wts[rt.pair_tk[p]]; };
  const bool drop = ws.dropout.on();
  const DropoutMask gate_mask(ws.dropout, 0), up_mask(ws.dropout, 1), down_mask(ws.dropout, 2);

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

  // The backward's weights: a 64-column block of Wdᵀ [I, H] or [Wg | Wu]ᵀ [H, 2·kpI], decoded from the forward
  // weights per task (decode_transposed) into this thread's block.
  thread_local Buffer<bf16> wt_block;
  auto down_t = [&](int e, int cb) {
    bf16* w = wt_block.get(static_cast<size_t>(ldx) * kBlockN);
    decode_transposed(k_, down_, e, cb * kBlockN, 0, w);
    zero_inner(w, H, static_cast<int>(ldx));
    return w;
  };
  auto gate_up_t = [&](int e, int cb) {
    bf16* w = wt_block.get(static_cast<size_t>(ldgu) * kBlockN);
    decode_transposed(k_, gate_, e, cb * kBlockN, 0, w);
    decode_transposed(k_, up_, e, cb * kBlockN, kpI, w);
    zero_inner(w, I, kpI);
    zero_inner(w, kpI + I, static_cast<int>(ldgu));
    return w;
  };

  // B2
  const auto q_tasks = expert_block_tasks(rt, nbI);  // one block a task: down_t decodes it
  pool->parallel_for(static_cast<int64_t>(q_tasks.size()), [&](int64_t ti) {
    const bf16* wd = down_t(q_tasks[ti].e, q_tasks[ti].cb);
    for_row_blocks(q_tasks[ti], [&](const BlockTask& t) {
      const int M = t.r1 - t.r0, c0 = t.cb * kBlockN, nc = std::min(kBlockN, I - c0);
      float* Q = tl_tile[0];
      k_.gemm_block(M, gout + t.r0 * ldx, ldx, wd, static_cast<int>(ldx), Q, kBlockN);
      for_segments(rt, t.e, t.r0, t.r1, [&](const Route::Segment& s, int b, int end) {
        const Adapter* a = rt.seg_adapter(s);
        if (!a) return;
        lora_b_add_masked(k_, drop ? &down_mask : nullptr, rt, b, end, t2d, R, a->rank,
                          a->down_a.data() + static_cast<size_t>(t.e) * a->rank * I + c0, I, c0, nc, a->scale,
                          Q + (b - t.r0) * kBlockN);
      });
      for (int m = 0; m < M; ++m) {
        const int p = t.r0 + m;
        const int64_t gu = static_cast<int64_t>(p) * I + c0;
        gw[static_cast<int64_t>(p) * nbI + t.cb] =
            k_.swiglu_backward(nc, pair_w(p), Q + m * kBlockN, Hb + p * ldh + c0, G + gu, U + gu, dgu + p * ldgu + c0,
                               dgu + p * ldgu + kpI + c0);
      }
    });
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
  const auto groups = column_tasks(rt, nbH, pool->num_threads(), false).groups;
  const int ngroups = static_cast<int>(groups.size());
  const PartialOutputs acc(ws.acc, ngroups, T, nbH);
  pool->parallel_for(static_cast<int64_t>(nbH) * ngroups, [&](int64_t ti) {
    const int cb = static_cast<int>(ti % nbH), grp = static_cast<int>(ti / nbH);
    const int c0 = cb * kBlockN, nc = std::min(kBlockN, H - c0);
    float* part = acc.zeroed(grp, cb);
    float* C = tl_tile[0];
    for (int e : groups[grp]) {
      if (rt.expert_begin[e + 1] == rt.expert_begin[e]) continue;
      const bf16* wgu = gate_up_t(e, cb);
      for (int r0 = rt.expert_begin[e], r1; r0 < rt.expert_begin[e + 1]; r0 = r1) {
        r1 = run_end(r0, rt.expert_begin[e + 1]);
        k_.gemm_block(r1 - r0, dgu + r0 * ldgu, ldgu, wgu, static_cast<int>(ldgu), C, kBlockN);
        for_segments(rt, e, r0, r1, [&](const Route::Segment& s, int b, int end) {
          const Adapter* a = rt.seg_adapter(s);
          if (!a) return;
          const size_t off = static_cast<size_t>(e) * a->rank * H + c0;
          lora_b_add_masked(k_, drop ? &gate_mask : nullptr, rt, b, end, t2g, R, a->rank, a->gate_a.data() + off, H,
                            c0, nc, a->scale, C + (b - r0) * kBlockN);
          lora_b_add_masked(k_, drop ? &up_mask : nullptr, rt, b, end, t2u, R, a->rank, a->up_a.data() + off, H, c0,
                            nc, a->scale, C + (b - r0) * kBlockN);
        });
        for (int p = r0; p < r1; ++p) {
          float* o = part + (rt.pair_tk[p] / k) * kBlockN;
          const float* y = C + (p - r0) * kBlockN;
          for (int c = 0; c < nc; ++c) o[c] += y[c];
        }
      }
    }
    if (ngroups == 1) acc.store(cb, H, grad_x);
  });
  if (ngroups > 1) pool->parallel_for(nbH, [&](int64_t cb) { acc.store(static_cast<int>(cb), H, grad_x); });

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
    // A gradients: G += s Qᵀ V over the segment's rows of the LoRA input V (bf16, stride ldv, nc columns from
    // c0), or of dropout(V), masked kRowBlock rows at a time into a tile.
    auto add_a = [&](const DropoutMask& mask, const float* Q, int64_t ldq, const bf16* V, int64_t ldv, int nc,
                     float* gbuf, int64_t ldg) {
      if (!drop) return k_.outer_acc_bf16(M, Q, ldq, r, V, ldv, nc, sc, gbuf, ldg);
      float* D = tl_tile[0];
      for (int m0 = 0; m0 < M; m0 += kRowBlock) {
        const int mn = std::min(kRowBlock, M - m0);
        for (int m = 0; m < mn; ++m)
          mask.apply(rt.pair_tk[b + m0 + m], c0, nc, V + (m0 + m) * ldv, D + m * kBlockN);
        k_.outer_acc_f32(mn, Q + m0 * ldq, ldq, r, D, kBlockN, nc, sc, gbuf, ldg);
      }
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
        add_a(gate ? gate_mask : up_mask, (gate ? t2g : t2u) + b * R, R, X + b * ldx + c0, ldx, nc,
              (gate ? gb.gate_a : gb.up_a) + static_cast<size_t>(e) * r * H + c0, H);
        break;
      }
      case kDownA: {
        const int nc = std::min(kBlockN, I - c0);
        std::vector<float> wt2d;
        weighted(t2d, wt2d);
        add_a(down_mask, wt2d.data(), r, Hb + b * ldh + c0, ldh, nc, gb.down_a + static_cast<size_t>(e) * r * I + c0,
              I);
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
