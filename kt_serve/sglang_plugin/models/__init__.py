"""Per-model fixes and ops: what one model family needs from SGLang that it lacks (on a CPU host, or for LoRA).

qwen35.py        Qwen3.5 on SGLang's CPU engine: the sgl-kernel CPU ops it binds, its gated norm, its cache strategy
qwen35_gdn.py    Gated DeltaNet's conv1d and delta rule (torch formulas; the decode steps on the kernel)
deepseek_mla.py  DeepSeek-V2/V3 MLA: LoRA on every projection, the absorbed path on torch_native
"""
