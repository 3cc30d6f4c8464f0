"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) CPU ops in plain torch: causal conv1d and the delta rule.

Torch implementations of the sgl-kernel CPU ops that SGLang 0.5.23's GDN backend calls on a CPU host
(``sgl-kernel/csrc/cpu/mamba/{conv,fla}.cpp``), same arguments, layouts, dtypes and in-place state updates; math in
fp32. Registered by :func:`kt_serve.sglang_plugin.models.qwen35.install_qwen35_cpu_ops` only where no real kernel
exists. The decode ops and the prefill's delta rule run in C++ (:mod:`kt_serve.kernel.gdn`, csrc/ops/gdn.cpp) for
the inputs it takes (bf16 activations, fp32 states, negative padding slots): torch's dozen ops a decode layer cost more
than the state traffic, and its chunked prefill (64-token chunks, padded) more than the recurrent scan's one pass over
an L1-resident state block per token. The torch formulas stay as the readable reference.

Layouts (SGLang's mamba pool, ``mem_cache/memory_pool.py``):

- conv state pool ``[slots, dim, K-1]`` (any strides), oldest input first; SiLU after the depthwise conv.
- SSM state pool ``[slots, Hv, Dk, Dv]`` fp32, read as S[k][v] like the real CPU kernels: o = Sᵀq, S ← e^g S + k uᵀ.
  SGLang allocates it as (Hv, Dv, Dk); with Dk == Dv (every Qwen3.5) the two are the same shape, and with Dk != Dv
  the pool is used transposed, consistently between prefill and decode.
- Cache indices equal to ``pad_slot_id`` (SGLang's PAD_SLOT_ID, -1) or negative are padding rows: no state is read
  or written for them and their outputs are zero.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kt_serve.kernel import gdn

from ..log import log_once

logger = logging.getLogger(__name__)
USE_KERNEL = True  # False: the torch formulas below for every input (the tests hold both to transformers)


def _on_torch(op: str, **tensors) -> None:
    """Says once per op that it runs the torch formulas: inputs the C++ path does not take."""
    shapes = ", ".join(f"{k} {getattr(t, 'dtype', t)} {tuple(getattr(t, 'shape', ()))}" for k, t in tensors.items())
    log_once(logger, f"GDN {op} on torch formulas, not the C++ path (inputs: %s)", shapes)


CHUNK = 64  # the real kernel's chunk size (fla.cpp) and transformers' default
CHUNKS_PER_BLOCK = 32  # intra-chunk tensors are built this many chunks at a time (bounds prefill memory)


def kv_view(pool: torch.Tensor, dk: int, dv: int) -> torch.Tensor:
    """The state pool seen as [slots, Hv, Dk, Dv]."""
    if tuple(pool.shape[-2:]) == (dk, dv):
        return pool
    if tuple(pool.shape[-2:]) == (dv, dk):
        return pool.transpose(-1, -2)
    raise ValueError(f"GDN state pool of shape {tuple(pool.shape)} fits neither [.., {dk}, {dv}] nor [.., {dv}, {dk}]")


def _heads_view(states: torch.Tensor, dk: int, dv: int) -> torch.Tensor:
    """[slots, Hv, Dk, Dv] states as a [slots*Hv, Dk, Dv] view when their strides allow one, else unchanged."""
    try:
        return states.view(-1, dk, dv)
    except RuntimeError:  # slots not evenly strided (a strided envelope pool): 4D ops on the view itself
        return states


def _like(rows: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """[slots*Hv, a, b] per-head operands shaped for _heads_view's result (split back to [slots, Hv, a, b] if 4D)."""
    return rows if states.dim() == 3 else rows.view(states.shape[0], states.shape[1], *rows.shape[1:])


def _valid_rows(indices: torch.Tensor, pad_slot_id: int):
    """(int64 indices, rows holding a real slot or None when every row does)."""
    idx = indices.to(torch.int64)
    valid = (idx != pad_slot_id) & (idx >= 0)
    if bool(valid.all()):
        return idx, None
    return idx, valid.nonzero().squeeze(1)


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _check_plain_weight(is_vnni: bool) -> None:
    if is_vnni:
        raise NotImplementedError(
            "causal conv1d: VNNI-packed weights come only from the real sgl-kernel (AMX); kt_serve's torch op takes "
            "plain [dim, width] weights (call it with is_vnni=False)")


# ---------------------------------------------------------------------------------------------------------- conv1d


def causal_conv1d_fwd_cpu(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                          silu_activation, pad_slot_id, is_vnni):
    """Prefill conv. x: [dim, tokens] (varlen, with query_start_loc) or [batch, dim, seqlen]; returns x's shape
    with x's strides (SGLang passes the transpose of a contiguous [tokens, dim] and transposes the result back).
    Writes each sequence's last K-1 inputs (after its initial state) to conv_states[cache_indices]."""
    _check_plain_weight(is_vnni)
    if query_start_loc is None:
        if x.dim() != 3:
            raise ValueError(f"causal_conv1d_fwd_cpu: x must be [batch, dim, seqlen] without query_start_loc, "
                             f"got {tuple(x.shape)}")
        batch, dim, seqlen = x.shape
        qsl = torch.arange(batch + 1, dtype=torch.int64) * seqlen
        out = causal_conv1d_fwd_cpu(x.transpose(1, 2).reshape(-1, dim).t(), weight, bias, conv_states, qsl,
                                    cache_indices, has_initial_state, silu_activation, pad_slot_id, False)
        return out.t().reshape(batch, seqlen, dim).transpose(1, 2)
    if x.dim() != 2:
        raise ValueError(f"causal_conv1d_fwd_cpu: varlen x must be [dim, tokens], got {tuple(x.shape)}")
    dim, total = x.shape
    if USE_KERNEL and conv_states is not None:
        slots = None if cache_indices is None else cache_indices.masked_fill(cache_indices == pad_slot_id, -1)
        out = gdn.conv_prefill(x.t(), conv_states, weight, bias, silu_activation, query_start_loc, slots,
                               has_initial_state)
        if out is not None:
            return out.t()
        _on_torch("prefill conv", x=x, conv_states=conv_states, weight=weight)
    width = weight.shape[-1]
    km1 = width - 1
    bounds = query_start_loc.tolist()
    n_seq = len(bounds) - 1
    slots = cache_indices.tolist() if cache_indices is not None else list(range(n_seq))
    init = has_initial_state.tolist() if has_initial_state is not None else [False] * n_seq
    use = [conv_states is not None and slot != pad_slot_id and slot >= 0 for slot in slots]
    xt = x.t()  # [tokens, dim], contiguous as SGLang passes it
    # Extended stream: each sequence preceded by K-1 rows of its initial state (or zeros), so one pass of K shifted
    # multiply-adds convolves every sequence at once.
    zeros = x.new_zeros(km1, dim)
    pieces = []
    for n in range(n_seq):
        pieces.append(conv_states[slots[n]].t().to(x.dtype) if use[n] and init[n] else zeros)
        pieces.append(xt[bounds[n]:bounds[n + 1]])
    ext = torch.cat(pieces) if pieces else x.new_zeros(km1, dim)
    # K shifted multiply-adds in fp32, over tiles of rows that stay in cache (3x faster than whole-array passes here)
    w = weight.reshape(dim, width).float()
    span = ext.shape[0] - km1
    conv = torch.empty(span, dim, dtype=x.dtype)
    tile = max(16, (2 << 20) // (4 * dim))
    for r0 in range(0, span, tile):
        r1 = min(span, r0 + tile)
        seg = ext[r0:r1 + km1].float()
        acc = seg[km1:] * w[:, km1]
        for j in range(km1):
            acc.addcmul_(seg[j:j + r1 - r0], w[:, j])
        if bias is not None:
            acc += bias.float()
        conv[r0:r1] = F.silu(acc, inplace=True) if silu_activation else acc
    for n in range(n_seq):
        start, end = bounds[n], bounds[n + 1]
        if use[n] and end > start:  # the last K-1 rows of the sequence's segment, initial state included
            conv_states[slots[n]].copy_(ext[end + n * km1:end + (n + 1) * km1].t())
    if n_seq == 1:
        return conv.t()
    out = torch.empty(total, dim, dtype=x.dtype)
    for n in range(n_seq):
        out[bounds[n]:bounds[n + 1]] = conv[bounds[n] + n * km1:bounds[n + 1] + n * km1]
    return out.t()


def causal_conv1d_update_cpu(x, conv_states, weight, bias, silu_activation, cache_seqlens, conv_state_indices,
                             pad_slot_id, is_vnni):
    """Decode conv, one token per row. x: [batch, dim]; conv_states[conv_state_indices] shift left by one and take x."""
    _check_plain_weight(is_vnni)
    if cache_seqlens is not None:
        raise NotImplementedError("causal_conv1d_update_cpu: cache_seqlens (circular conv state) is not supported")
    if x.dim() != 2:
        raise ValueError(f"causal_conv1d_update_cpu: x must be [batch, dim], got {tuple(x.shape)}")
    if USE_KERNEL and pad_slot_id < 0:
        out = gdn.conv_update(x, conv_states, weight, bias, silu_activation, conv_state_indices)
        if out is not None:
            return out
        _on_torch("conv update", x=x, conv_states=conv_states, weight=weight)
    batch, dim = x.shape
    width = weight.shape[-1]
    if conv_state_indices is None:
        idx, rows = torch.arange(batch), None
    else:
        idx, rows = _valid_rows(conv_state_indices, pad_slot_id)
    xs = x if rows is None else x.index_select(0, rows)
    if rows is not None:
        idx = idx.index_select(0, rows)
    state = conv_states.index_select(0, idx)  # [b, dim, K-1]
    w, state32 = weight.reshape(dim, width).float(), state.float()
    acc = xs.float() * w[:, -1]
    for j in range(width - 1):
        acc.addcmul_(state32[..., j], w[:, j])
    if bias is not None:
        acc += bias.float()
    if silu_activation:
        F.silu(acc, inplace=True)
    shifted = torch.empty_like(state)
    shifted[..., :-1] = state[..., 1:]
    shifted[..., -1] = xs
    conv_states.index_copy_(0, idx, shifted)
    if rows is None:
        return acc.to(x.dtype)
    out = x.new_zeros(batch, dim)
    out[rows] = acc.to(x.dtype)
    return out


# --------------------------------------------------------------------------------------------- recurrent decode


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                                               softplus_beta=1.0, softplus_threshold=20.0):
    """One recurrent GDN step per request, the gates computed in place. q, k: [1, batch, Hk, Dk]; v: [1, batch, Hv, Dv];
    a, b: [batch, Hv]; state pool [slots, Hv, Dk, Dv] fp32 updated in place at initial_state_indices.
    Returns [batch, 1, Hv, Dv] in q's dtype."""
    steps, batch, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    pool = kv_view(initial_state_source, dk, dv)
    if USE_KERNEL:
        out = gdn.recurrent_step(A_log, dt_bias, q, k, v, a, b, pool, initial_state_indices, use_qk_l2norm_in_kernel,
                                 softplus_beta, softplus_threshold)
        if out is not None:
            return out
        _on_torch("recurrent step", q=q, v=v, a=a, states=pool)
    slots = initial_state_indices.tolist()
    rows = None
    if min(slots, default=0) < 0:  # padding rows (PAD_SLOT_ID): zero output, no state
        rows = [i for i, slot in enumerate(slots) if slot >= 0]
        out = q.new_zeros(batch, steps, hv, dv)
        if not rows:
            return out
        slots = [slots[i] for i in rows]
        rows = torch.tensor(rows)
        q, k, v, a, b = q[:, rows], k[:, rows], v[:, rows], a[rows], b[rows]
    n = len(slots)
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), softplus_beta, softplus_threshold)
    decay = torch.exp(g).view(n * hv, 1, 1)
    beta = torch.sigmoid(b.float()).view(n * hv, 1)
    # The state is touched only in place, through views of runs of consecutive slots (one run per request at worst):
    # gathering and scattering a request's 2 MiB fp32 state cost more than the three passes the step needs.
    cuts = [0] + [i for i in range(1, n) if slots[i] != slots[i - 1] + 1] + [n]
    runs = [(r0 * hv, r1 * hv) for r0, r1 in zip(cuts[:-1], cuts[1:])]  # rows of the [n*Hv, ...] operands
    states = [_heads_view(pool[slots[r0]:slots[r0] + r1 - r0], dk, dv) for r0, r1 in zip(cuts[:-1], cuts[1:])]
    scale = torch.tensor([[dk ** -0.5], [1.0]])
    outs = []
    for t in range(steps):
        qk = torch.stack((q[t], k[t]), dim=2).float()  # [n, Hk, 2, Dk]
        if use_qk_l2norm_in_kernel:
            qk = _l2norm(qk, 1e-6)
        qk = qk * scale
        qdotk = (qk[:, :, 0] * qk[:, :, 1]).sum(-1, keepdim=True).repeat_interleave(hv // hk, dim=1).view(n * hv, 1)
        qk = qk.repeat_interleave(hv // hk, dim=1).view(n * hv, 2, dk)
        read = torch.cat([torch.matmul(_like(qk[r0:r1], st), st).view(-1, 2, dv)
                          for st, (r0, r1) in zip(states, runs)]) * decay  # (qᵀ, kᵀ) of the decayed state
        delta = beta * (v[t].reshape(n * hv, dv).float() - read[:, 1])
        outs.append(torch.addcmul(read[:, 0], qdotk, delta).view(n, hv, dv))  # qᵀ(decayed S + k δᵀ)
        kcol, drow = qk[:, 1].unsqueeze(-1), delta.unsqueeze(1)
        for st, (r0, r1) in zip(states, runs):
            st.mul_(_like(decay[r0:r1], st))
            if st.dim() == 3:
                st.baddbmm_(kcol[r0:r1], drow[r0:r1])
            else:
                st.addcmul_(_like(kcol[r0:r1], st), _like(drow[r0:r1], st))
    res = (outs[0].unsqueeze(1) if steps == 1 else torch.stack(outs, dim=1)).to(q.dtype)
    if rows is None:
        return res
    out[rows] = res
    return out


# -------------------------------------------------------------------------------------------- chunked prefill


def _chunk_layout(lens: torch.Tensor):
    """Step-major chunk order: sequences ranked by chunk count (descending), chunk c of every sequence that has one
    stored together, so step c of the scan reads the slice [offsets[c], offsets[c] + active[c])."""
    nch = (lens + CHUNK - 1) // CHUNK
    order = torch.argsort(nch, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    steps = int(nch.max()) if nch.numel() else 0
    active = (nch.unsqueeze(0) > torch.arange(steps).unsqueeze(1)).sum(1)  # [steps]
    offsets = torch.cumsum(active, 0) - active
    return nch, rank, active.tolist(), offsets.tolist()


def _unit_lower_inverse(m: torch.Tensor) -> torch.Tensor:
    """(I + strictly_lower(m))⁻¹ for a batch of [C, C] matrices (C a power of two; m's diagonal and upper part are
    ignored), by block doubling: [[A, 0], [X, B]]⁻¹ = [[A⁻¹, 0], [-B⁻¹ X A⁻¹, B⁻¹]]. Batched matmuls only: LAPACK's
    triangular solve runs matrix by matrix and was 5x slower here."""
    c = m.shape[-1]
    flat = m.reshape(-1, c, c)
    inv = torch.zeros_like(flat)
    inv.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    size = 1
    while size < c:
        nb = c // (2 * size)

        def blocks(t):  # the diagonal [2 size, 2 size] blocks of every matrix: [N, nb, 2 size, 2 size] views
            return t.view(-1, nb, 2 * size, nb, 2 * size).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)

        low, cur = blocks(flat)[..., size:, :size], blocks(inv)
        if size == 1:
            cur[..., 1:, :1] = -low
        else:
            cur[..., size:, :size] = -(cur[..., size:, size:] @ low @ cur[..., :size, :size])
        size *= 2
    return inv.view(m.shape)


def _intra_chunk(qc, kc, vc, gc, bc, group):
    """UT/WY form for a block of chunks (per head, fp32). qc, kc: [Hk, nb, C, Dk]; vc: [Hv, nb, C, Dv];
    gc, bc: [Hv, nb, C] (log decay, beta). Returns, per v-head: (A, BK, NV, KD, Dlast) with
    [out; KCD·S] = [A; 0] + BK·S, v_new = NV - KCD·S and S' = Dlast·S + KDᵀ·v_new for the state S entering a chunk."""
    hk, nb, c, dk = qc.shape
    hv, dv = vc.shape[0], vc.shape[-1]
    cum = gc.cumsum(-1).view(hk, group, nb, c)
    beta = bc.view(hk, group, nb, c, 1)
    lower = torch.ones(c, c, dtype=torch.bool).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    kk = (kc @ kc.transpose(-1, -2)).unsqueeze(1)  # shared by the v-heads of a k-head
    qk = (qc @ kc.transpose(-1, -2)).unsqueeze(1)
    tinv = _unit_lower_inverse(kk * decay * beta)  # (I + strictly lower β k kᵀ decay)⁻¹
    intra = qk * decay
    kx = kc.unsqueeze(1)
    ecum = cum.exp().unsqueeze(-1)
    nv = tinv @ (vc.view(hk, group, nb, c, dv) * beta)
    kcd = tinv @ (kx * (beta * ecum))
    bk = torch.cat((qc.unsqueeze(1) * ecum - intra @ kcd, kcd), dim=-2)
    a_term = intra @ nv
    kd = kx * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    dlast = cum[..., -1].exp()
    shape = lambda t: t.reshape(hv, nb, *t.shape[3:])  # noqa: E731
    return shape(a_term), shape(bk), shape(nv), shape(kd), dlast.reshape(hv, nb)


def chunk_gated_delta_rule_cpu(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens,
                               head_first, use_qk_l2norm_in_kernel, initial_state_indices=None, eps=1e-6):
    """Chunked GDN prefill of several sequences packed in one row. query, key: [1, T, Hk, Dk]; value: [1, T, Hv, Dv];
    g: [1, T, Hv] fp32 log decay; beta: [1, T, Hv]; cu_seqlens: [N+1]. With initial_state_indices the initial states
    are initial_state[indices] (a pool, updated in place with the final states), else initial_state is [N, Hv, Dk, Dv].
    Returns (output [1, T, Hv, Dv] in value's dtype, final states [N, Hv, Dk, Dv] fp32)."""
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule_cpu: head_first=True is not supported")
    if query.shape[0] != 1:
        raise ValueError(f"chunk_gated_delta_rule_cpu: expects batch 1 (packed sequences), got {query.shape[0]}")
    _, total, hk, dk = query.shape
    hv, dv = value.shape[2], value.shape[3]
    pool = kv_view(initial_state, dk, dv)
    if USE_KERNEL:
        done = gdn.scan(query, key, value, g, beta, pool, initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                        eps)
        if done is not None:
            return done
        _on_torch("prefill", query=query, value=value, g=g, beta=beta, states=pool)
    group = hv // hk
    cu = cu_seqlens.to(torch.int64)
    n_seq = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    if initial_state_indices is None:
        idx, use = torch.arange(n_seq), torch.ones(n_seq, dtype=torch.bool)
    else:
        idx = initial_state_indices.to(torch.int64)
        use = idx >= 0
    states = torch.zeros(n_seq, hv, dk, dv)
    use_rows = use.nonzero().squeeze(1)
    if use_rows.numel():
        states[use_rows] = pool.index_select(0, idx[use_rows]).float()
    nch, rank, active, offsets = _chunk_layout(lens)
    out = value.new_zeros(1, total, hv, dv)
    if total > 0:
        padded = (offsets[-1] + active[-1]) * CHUNK
        if n_seq == 1:
            prow = None  # token t is padded row t
        else:  # token t of sequence n, position j: padded row (offsets[j // C] + rank[n]) * C + j % C
            seq_of_tok = torch.repeat_interleave(torch.arange(n_seq), lens)
            local = torch.arange(total) - cu[:-1][seq_of_tok]
            offs = torch.tensor(offsets, dtype=torch.int64)
            prow = (offs[local // CHUNK] + rank[seq_of_tok]) * CHUNK + local % CHUNK

        def pad(x, heads):  # [T, heads, ...] -> [heads, chunks, C, ...] fp32, zero rows past each sequence
            xh = x.movedim(0, 1)  # [heads, T, ...]: one copy converts and transposes
            if prow is None:
                buf = torch.empty((heads, padded) + x.shape[2:])
                buf[:, :total] = xh
                buf[:, total:] = 0
            else:
                buf = torch.zeros((heads, padded) + x.shape[2:])
                buf[:, prow] = xh.float()
            return buf.view(heads, -1, CHUNK, *x.shape[2:])

        q32, k32 = query[0].float(), key[0].float()
        if use_qk_l2norm_in_kernel:
            q32, k32 = _l2norm(q32, eps), _l2norm(k32, eps)
        qp, kp = pad(q32 * dk ** -0.5, hk), pad(k32, hk)
        vp, gp, bp = pad(value[0], hv), pad(g[0], hv), pad(beta[0], hv)
        outp = None if prow is None else torch.empty(hv, qp.shape[1], CHUNK, dv)
        s = states.index_select(0, torch.argsort(rank)).transpose(0, 1).contiguous()  # [Hv, N, Dk, Dv], rank order
        step = 0
        while step < len(active):  # blocks of whole steps, at most CHUNKS_PER_BLOCK chunks each (one step at least)
            lo, end = offsets[step], step + 1
            while end < len(active) and offsets[end] + active[end] - lo <= CHUNKS_PER_BLOCK:
                end += 1
            hi = offsets[end - 1] + active[end - 1]
            a_t, bk, nv, kd, dlast = _intra_chunk(qp[:, lo:hi], kp[:, lo:hi], vp[:, lo:hi], gp[:, lo:hi],
                                                  bp[:, lo:hi], group)
            for c in range(step, end):  # the sequential part: one step per chunk position, all sequences at once
                blk, sc = slice(offsets[c] - lo, offsets[c] - lo + active[c]), s[:, :active[c]]
                read = bk[:, blk] @ sc  # [Hv, na, 2C, Dv]: (B·S, KCD·S)
                a_t[:, blk] += read[..., :CHUNK, :]
                v_new = nv[:, blk].sub_(read[..., CHUNK:, :])
                sc.mul_(dlast[:, blk, None, None]).add_(kd[:, blk].transpose(-1, -2) @ v_new)
            if prow is None:  # one sequence: the block's chunks are its tokens lo*C .. hi*C
                rows = min(hi * CHUNK, total) - lo * CHUNK
                out[0, lo * CHUNK:lo * CHUNK + rows] = a_t.view(hv, -1, dv)[:, :rows].transpose(0, 1)
            else:
                outp[:, lo:hi] = a_t
            step = end
        if prow is not None:
            out[0] = outp.view(hv, -1, dv)[:, prow].transpose(0, 1)
        states = s.transpose(0, 1).index_select(0, rank)
    write = (use & (lens > 0)).nonzero().squeeze(1)
    if initial_state_indices is not None and write.numel():
        pool.index_copy_(0, idx[write], states[write].to(pool.dtype))
    return out, states
