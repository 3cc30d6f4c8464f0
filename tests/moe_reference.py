"""Independent fp32 reference for the routed-expert LoRA math: a plain per-expert loop in torch (autograd gives
the gradients). Shares no code with kt_serve."""

import torch
import torch.nn.functional as F


def moe_lora_reference(x, ids, weights, gate, up, down, lora=None, slots=None, loras=None, dropout=None):
    """fp32 ``out[t] = Σ_k w[t,k] expert_{ids[t,k]}(x[t])``, ids < 0 or >= E skipped.

    gate/up ``[E,I,H]``, down ``[E,H,I]``. ``lora``: dict of the six KT-layout tensors (``gate_lora_a`` …) and
    ``"alpha"``, applied to every token; or ``loras`` (slot -> such a dict) with per-token ``slots`` (-1 = base).
    ``dropout``: ``(p, (keep_gate, keep_up, keep_down))`` with bool keep masks ``[T, k, H|H|I]``: the LoRA path of
    each projection of pair (t, j) reads its input times ``keep[t, j] / (1 - p)`` (PEFT's lora_dropout), the
    base path the input itself.
    """
    x = x.float()
    E = gate.shape[0]
    T, K = ids.shape
    if loras is None:
        slots = torch.zeros(T, dtype=torch.long)
        loras = {0: lora}
    out = torch.zeros_like(x)
    tok = torch.arange(T).repeat_interleave(K)
    flat_ids, flat_w = ids.reshape(-1).long(), weights.reshape(-1)
    flat_slot = slots.long()[tok]
    if dropout is not None:
        p, keeps = dropout
        drop = [m.reshape(T * K, -1).float() / (1.0 - p) for m in keeps]  # per flat pair t*K + j
    else:
        drop = [None, None, None]

    def lora_in(v, proj, sel):
        return v if drop[proj] is None else v * drop[proj][sel]

    for e in range(E):
        for s in flat_slot[flat_ids == e].unique().tolist():
            sel = (flat_ids == e) & (flat_slot == s)
            t = tok[sel]
            lo = loras.get(s) if s >= 0 else None
            xe = x[t]
            g = xe @ gate[e].float().T
            u = xe @ up[e].float().T
            if lo is not None:
                sc = lo["alpha"] / lo["gate_lora_a"].shape[1]
                g = g + sc * (lora_in(xe, 0, sel) @ lo["gate_lora_a"][e].float().T) @ lo["gate_lora_b"][e].float().T
                u = u + sc * (lora_in(xe, 1, sel) @ lo["up_lora_a"][e].float().T) @ lo["up_lora_b"][e].float().T
            h = F.silu(g) * u
            y = h @ down[e].float().T
            if lo is not None:
                y = y + sc * (lora_in(h, 2, sel) @ lo["down_lora_a"][e].float().T) @ lo["down_lora_b"][e].float().T
            out = out.index_add(0, t, flat_w[sel].float()[:, None] * y)
    return out
