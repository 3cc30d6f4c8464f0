"""Adapters served per request: SGLang's LoRA manager applies the non-expert half, the plugin the rest.

registry.py    the one owner of every per-adapter state (expert slots, gate LoRA, the batch in flight)
split.py       a composite adapter dir -> SGLang's half (cached), the expert half, the gate LoRA
batch.py       the batch's adapter ids -> a kernel slot per token, the tokens of each adapter
gate_lora.py   LoRA on routers and gates, which SGLang's LoRA manager has no layer for
manager_hooks.py  the LoRAManager / ModelRunner hooks that drive the above
"""
