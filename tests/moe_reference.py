"""Independent fp32 reference for the routed-expert LoRA math (plain per-expert loop; autograd for gradients)."""

import torch
import torch.nn.functional as F


def moe_lora_reference(x, ids, weights, gate, up, down, lora=None, slots=None, loras=None):
    """fp32 ``out[t] = Σ_k w[t,k] expert(x[t])``.

    gate/up ``[E,I,H]``, down ``[E,H,I]``. ``lora``: dict of the six KT-layout tensors + "alpha" applied to every
    token, or ``loras`` (a list) with per-token ``slots`` (-1 = base only). All math in fp32.
    """
    x = x.float()
    E = gate.shape[0]
    out = torch.zeros_like(x)
    T, K = ids.shape
    for t in range(T):
        if loras is not None:
            s = int(slots[t])
            lo = loras[s] if s >= 0 else None
        else:
            lo = lora
        for j in range(K):
            e = int(ids[t, j])
            if e < 0 or e >= E:
                continue
            xt = x[t : t + 1]
            g = xt @ gate[e].float().T
            u = xt @ up[e].float().T
            if lo is not None:
                s_ = lo["alpha"] / lo["gate_lora_a"].shape[1]
                g = g + s_ * (xt @ lo["gate_lora_a"][e].float().T) @ lo["gate_lora_b"][e].float().T
                u = u + s_ * (xt @ lo["up_lora_a"][e].float().T) @ lo["up_lora_b"][e].float().T
            h = F.silu(g) * u
            y = h @ down[e].float().T
            if lo is not None:
                y = y + s_ * (h @ lo["down_lora_a"][e].float().T) @ lo["down_lora_b"][e].float().T
            out[t] = out[t] + weights[t, j].float() * y[0]
    return out
