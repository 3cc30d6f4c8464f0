"""``--attention-backend kt_cpu``: a CPU host's decode attention in one C++ call per layer
(kt_serve/kernel/attention.py).

SGLang's CPU default without AMX is its torch_native backend, which decodes with a Python loop over the batch's
requests: per request a gather of its K and V rows out of the paged pool and one SDPA call, per layer. This
backend is that one with ``forward_decode`` replaced: the whole batch, every head and every cached token read in
place from the pool, threads over (request, slice of the context) with every head of a slot at once; the same
attention as torch_native up to fp32 summation order. The step's own K and V rows are stored by the same call
where the pool's set_kv_buffer is a plain row copy (the bf16 MHA pool); other pools keep set_kv_buffer. Extend
batches (prefill, radix-cache hits, chunked prefill) keep torch_native's SDPA path, and so do the layer kinds the
kernel does not cover (cross attention, sliding windows, logit capping, a KV cache that is not bf16).

Registered in SGLang's attention-backend registry in every scheduler of a CPU host; the launcher makes it the
default with ``--kt-cpu-ops`` on a CPU host without AMX (where SGLang itself would fall back to torch_native) for
models with an MHA / GQA cache. ``--attention-backend`` given by the user always wins.
"""

from __future__ import annotations

import logging

import torch

from ..log import log_once

logger = logging.getLogger(__name__)
NAME = "kt_cpu"


def add_choice() -> None:
    """Make ``--attention-backend kt_cpu`` a valid choice (launcher and schedulers)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])


def _mla_model(model_path) -> bool:
    from ..config import local_model_config

    config = local_model_config(model_path) or {}
    return any(isinstance(c, dict) and c.get("kv_lora_rank") for c in (config, config.get("text_config")))


def default_on_cpu(namespace, cpu_ops_enabled: bool) -> None:
    """Before ServerArgs is built from the CLI namespace: pick kt_cpu where SGLang would run torch_native."""
    from .compat import cpu_only_host

    if not cpu_ops_enabled or not cpu_only_host():
        return
    if any(getattr(namespace, f, None) for f in ("attention_backend", "prefill_attention_backend",
                                                  "decode_attention_backend")):
        return  # the user's choice
    from sglang.srt.utils.common import cpu_has_amx_support

    if cpu_has_amx_support() or _mla_model(getattr(namespace, "model_path", None)):
        return  # SGLang's intel_amx kernels; MLA's latent cache is not a per-head K / V pool
    namespace.attention_backend = NAME


def register_backend() -> None:
    """In a scheduler: ``kt_cpu`` in SGLang's attention-backend registry."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(create_backend)


def create_backend(runner):
    if runner.use_mla_backend:
        raise ValueError("--attention-backend kt_cpu runs MHA / GQA KV caches; this model's MLA latent cache is "
                         "served with --attention-backend torch_native")
    return backend_class()(runner)


_cls = None


def _heads_contiguous(cache: torch.Tensor) -> bool:  # [slots, heads, dim], what the kernel reads
    return cache.dtype == torch.bfloat16 and cache.dim() == 3 and cache.stride(2) == 1 and cache.stride(1) == cache.shape[2]


def backend_class():
    """Defined on first use, so importing this module does not import SGLang's attention code."""
    global _cls
    if _cls is not None:
        return _cls
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, KVWriteLoc, MHATokenToKVPool

    from kt_serve.kernel.attention import run_decode_attention
    from kt_serve.kernel.threads import cpu_isa

    class KTCPUAttnBackend(TorchNativeAttnBackend):
        def __init__(self, model_runner):
            super().__init__(model_runner)
            if self.req_to_token_pool.req_to_token.dtype != torch.int32:
                raise ValueError(f"kt_cpu attention reads an int32 req_to_token table, SGLang's is "
                                 f"{self.req_to_token_pool.req_to_token.dtype}")
            self.step_seq_lens = self.step_req_indices = None  # int64 [batch] of the decode step in flight
            self._plans = {}  # layer id -> layer_plan
            logger.info("kt_serve: decode attention on the kt_serve kernel (attention backend kt_cpu, isa %s)",
                        cpu_isa())

        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)
            if forward_batch.forward_mode.is_decode():  # once per step, not per layer
                self.step_req_indices = forward_batch.req_pool_indices.to(torch.int64).contiguous()
                self.step_seq_lens = forward_batch.seq_lens.to(torch.int64).contiguous()

        def layer_plan(self, layer) -> tuple:
            """(why this layer's decode goes to torch_native whatever the batch, or None; whether the kernel
            stores the step's K and V itself). Both depend on the layer and the pool only: worked out once."""
            plan = self._plans.get(layer.layer_id)
            if plan is None:
                plan = self._plans[layer.layer_id] = (self._static_reason(layer), self._stores_kv(layer))
            return plan

        def _static_reason(self, layer) -> str | None:
            pool = self.token_to_kv_pool
            if layer.is_cross_attention:
                return "cross attention"
            if layer.sliding_window_size != -1 or self.use_sliding_window_kv_pool:
                return "a sliding window"
            if layer.logit_cap:
                return "logit capping"
            if not (_heads_contiguous(pool.get_key_buffer(layer.layer_id))
                    and _heads_contiguous(pool.get_value_buffer(layer.layer_id))):
                return "a KV cache that is not bf16 [slots, heads, dim]"
            return None

        def _stores_kv(self, layer) -> bool:
            """Whether the kernel may write the step's K and V rows into the pool (csrc/ops/attention.h NewKV)
            in place of the pool's set_kv_buffer: only for the plain bf16 pool, where that method is exactly a
            copy of each row to its slot (no subclass, quantization, scales, page-major layout or write-loc
            translation), so the cache holds the same bytes either way."""
            pool = self.token_to_kv_pool
            if type(pool) is HybridLinearKVPool and not pool.use_mla:  # Qwen3.5: the full-attention layers' pool
                pool = pool.full_kv_pool
            return (type(pool) is MHATokenToKVPool and not pool.is_quantized_kv_cache
                    and pool.dtype == pool.store_dtype == torch.bfloat16 and not getattr(pool, "use_hnd", False)
                    and not pool.requires_physical_write_loc
                    and getattr(layer, "k_scale", None) is None and getattr(layer, "v_scale", None) is None)

        def _fallback_reason(self, layer, q, forward_batch) -> str | None:
            """Why this layer's decode goes to torch_native, or None when the kernel runs it."""
            if q.dtype != torch.bfloat16:
                return f"{q.dtype} queries"
            if forward_batch.encoder_lens is not None:
                return "cross attention"
            reason = self.layer_plan(layer)[0]
            indices = self.step_req_indices
            if reason is None and (indices is None or indices.shape[0] != forward_batch.batch_size):
                return "a decode batch without its step metadata"
            return reason

        @staticmethod
        def _new_rows(t, heads: int, dim: int, rows: int):
            """The step's K or V rows as [rows, heads, dim] with contiguous heads, or None when they are not bf16
            or not one row per request (then the pool's own set_kv_buffer writes them)."""
            if t.dtype != torch.bfloat16 or t.numel() != rows * heads * dim:
                return None
            t = t.reshape(rows, heads, dim)
            return t if t.stride(-1) == 1 and t.stride(1) == dim else t.contiguous()

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            reason = self._fallback_reason(layer, q, forward_batch)
            if reason is not None:
                log_once(logger, f"kt_cpu attention leaves layer %d's decode to torch_native: {reason}",
                         layer.layer_id, level=logging.WARNING)  # once per reason, not per layer and step
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            Hq, Hkv, D, Dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
            q = q.reshape(-1, Hq, D)
            if q.stride(-1) != 1 or q.stride(1) != D:
                q = q.contiguous()
            B = q.shape[0]
            new_k = new_v = loc = None
            if save_kv_cache and k is not None and v is not None:
                loc = forward_batch.out_cache_loc
                if (self.layer_plan(layer)[1] and loc.dtype == torch.int64 and loc.is_contiguous()
                        and loc.shape == (B,)):
                    new_k, new_v = self._new_rows(k, Hkv, D, B), self._new_rows(v, Hkv, Dv, B)
                if new_k is None or new_v is None:
                    new_k = new_v = loc = None
                    self.token_to_kv_pool.set_kv_buffer(
                        layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
            o = q.new_empty((q.shape[0], Hq, Dv))
            run_decode_attention(q, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                                 self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                                 self.req_to_token_pool.req_to_token, self.step_req_indices, self.step_seq_lens,
                                 layer.scaling, o, "auto", new_k, new_v, loc)
            return o.view(-1, Hq * Dv)

    _cls = KTCPUAttnBackend
    return _cls
