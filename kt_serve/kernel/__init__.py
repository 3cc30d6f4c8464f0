"""The kernel's Python face: one module per C++ op family (csrc/), each checking every tensor before it crosses
into C++ as a raw address.

experts (csrc/moe/)   weights (csrc/weights/)   linear, norm, rotary, attention, gdn, activation, lora_segments,
decode_stack (csrc/ops/)   threads (csrc/common/thread_pool, csrc/isa/cpu_features: the pool and the ISA table).

Nothing is imported here, so ``kt_serve.kernel.threads`` can run before torch is loaded.
"""
