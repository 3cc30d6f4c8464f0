"""Adapters served per request: SGLang's LoRA manager applies the non-expert half, the plugin the rest.

registry.py    the one owner of every per-adapter state (expert pool, gate LoRA, the batch in flight)
expert_pool.py expert halves registered, resident in kernel slots up to a budget, evicted by policy
split.py       a composite adapter dir -> SGLang's half (cached), the expert half, the gate LoRA
batch.py       the batch's adapter ids -> a kernel slot per token, the tokens of each adapter
gate_lora.py   LoRA on routers and gates, which SGLang's LoRA manager has no layer for
lora_experts.py  KT-FT's LoRA Experts: dense SwiGLU MLPs added to each MoE block's output per request
manager_hooks.py  the LoRAManager / ModelRunner hooks that drive the above
lora_dir.py    --kt-lora-dir: adapters found by name on first use (the tokenizer's hook)
"""
