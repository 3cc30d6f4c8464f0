"""A CPU-only host's engine: SGLang's dense path on the kt_serve kernel (``--kt-cpu-ops``) and its CPU fixes.

Each module hooks one SGLang op family onto the kernel module of the same name (kt_serve/kernel/, csrc/ops/):
linear.py (bf16 linears, lm_head, FP8 linears dequantized), norm.py, rotary.py, attention.py (``--attention-backend
kt_cpu``), lora_segments.py (SGLang's torch_native LoRA), moe_block.py (router + routed experts in one call),
decode_stack.py (a Qwen3-MoE decode step in one call); compat.py holds the fixes a CPU-only host needs at all.
"""
