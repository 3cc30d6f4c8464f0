"""``--attention-backend kt_cpu``: a CPU host's decode attention in one C++ call per layer (kt_serve/attention.py).

SGLang's CPU default without AMX is its torch_native backend, which decodes with a Python loop over the batch's
requests: per request a gather of its K and V rows out of the paged pool and one SDPA call, per layer. This
backend is that one with ``forward_decode`` replaced: the whole batch, every head and every cached token read in
place from the pool, threads over (request, slice of the context) with every head of a slot at once; the same
attention as torch_native up to fp32 summation order. Extend batches (prefill, radix-cache hits, chunked prefill)
keep torch_native's SDPA path, and so do the layer kinds the kernel does not cover (cross attention, sliding
windows, logit capping, a KV cache that is not bf16).

Registered in SGLang's attention-backend registry in every scheduler of a CPU host, and chosen with
``--attention-backend kt_cpu``. It is not yet the default: on one test model (tests/test_serving.py, the global
expert adapter server) it changes a greedy step's logprob by 0.28 nats against the fp32 reference where
torch_native stays within 0.02, most likely an MoE routing near-tie tipped by the last bf16 bit of the attention
output (the reference has routing margins below 3e-3 there), which is not yet shown.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)
NAME = "kt_cpu"


def add_choice() -> None:
    """Make ``--attention-backend kt_cpu`` a valid choice (launcher and schedulers)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])


def register_backend() -> None:
    """In a scheduler: ``kt_cpu`` in SGLang's attention-backend registry."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(create_backend)


def create_backend(runner):
    if runner.use_mla_backend:
        raise ValueError("--attention-backend kt_cpu runs MHA / GQA KV caches; this model's MLA latent cache is "
                         "served with --attention-backend torch_native")
    return _backend_class()(runner)


_cls = None


def _heads_contiguous(cache: torch.Tensor) -> bool:  # [slots, heads, dim], what the kernel reads
    return cache.dtype == torch.bfloat16 and cache.dim() == 3 and cache.stride(2) == 1 and cache.stride(1) == cache.shape[2]


def _backend_class():
    """Defined on first use, so importing this module does not import SGLang's attention code."""
    global _cls
    if _cls is not None:
        return _cls
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from kt_serve import _kernel

    class KTCPUAttnBackend(TorchNativeAttnBackend):
        def __init__(self, model_runner):
            super().__init__(model_runner)
            if self.req_to_token_pool.req_to_token.dtype != torch.int32:
                raise ValueError(f"kt_cpu attention reads an int32 req_to_token table, SGLang's is "
                                 f"{self.req_to_token_pool.req_to_token.dtype}")
            self._lens = self._idx = None
            logger.info("kt_serve: decode attention on the kt_serve kernel (attention backend kt_cpu, isa %s)",
                        _kernel.cpu_isa())

        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)
            if forward_batch.forward_mode.is_decode():  # once per step, not per layer
                self._idx = forward_batch.req_pool_indices.to(torch.int64).contiguous()
                self._lens = forward_batch.seq_lens.to(torch.int64).contiguous()

        def _runs(self, layer, q, forward_batch) -> bool:
            pool = self.token_to_kv_pool
            return (q.dtype == torch.bfloat16 and not layer.is_cross_attention and layer.sliding_window_size == -1
                    and not layer.logit_cap and forward_batch.encoder_lens is None
                    and not self.use_sliding_window_kv_pool and self._idx is not None
                    and self._idx.shape[0] == forward_batch.batch_size
                    and _heads_contiguous(pool.get_key_buffer(layer.layer_id))
                    and _heads_contiguous(pool.get_value_buffer(layer.layer_id)))

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if not self._runs(layer, q, forward_batch):
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(
                    layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
            Hq, Hkv, D, Dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
            q = q.reshape(-1, Hq * D)
            if q.stride(-1) != 1:
                q = q.contiguous()
            o = q.new_empty((q.shape[0], Hq * Dv))
            k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            r2t = self.req_to_token_pool.req_to_token
            _kernel.decode_attention(q.shape[0], Hq, Hkv, D, Dv, q.data_ptr(), q.stride(0), k_cache.data_ptr(),
                                     k_cache.stride(0), v_cache.data_ptr(), v_cache.stride(0), r2t.data_ptr(),
                                     r2t.stride(0), self._idx.data_ptr(), self._lens.data_ptr(),
                                     float(layer.scaling), o.data_ptr(), o.stride(0), "auto")
            return o

    _cls = KTCPUAttnBackend
    return _cls
