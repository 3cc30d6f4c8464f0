"""Fast checks of the plugin's pure-Python parts (no server): batch -> slot mapping and the flag round trip."""

import time

import pytest
import torch

pytest.importorskip("sglang")

from kt_serve.sglang_plugin.adapters.batch import AdapterBatch, slots_for  # noqa: E402
from kt_serve.sglang_plugin.config import KTServeConfig  # noqa: E402


def test_token_slots_follow_request_lengths():
    slots = {None: -1, "a": 0, "b": 3}
    batch = AdapterBatch.build(["a", None, "b", "a"], [3, 1, 2, 1], slots.get)
    got = slots_for(batch, 7, default_slot=-1)
    # hand-written expectation: 3 tokens of a, 1 base, 2 of b, 1 of a
    assert got.tolist() == [0, 0, 0, -1, 3, 3, 0]
    assert got.dtype == torch.int32
    with pytest.raises(RuntimeError, match="6 tokens"):
        slots_for(batch, 6, default_slot=-1)


def test_uniform_batch_passes_one_slot_and_no_batch_uses_default():
    assert slots_for(AdapterBatch.build(["a", "a"], [4, 1], {"a": 2}.get), 5, default_slot=-1) == 2
    assert slots_for(None, 9, default_slot=5) == 5


def test_config_round_trips_through_the_environment():
    env = {}
    KTServeConfig(expert_lora_path="/x", threads=3, max_expert_loras="5").export(env)
    assert env["KT_SERVE_EXPERT_LORA_PATH"] == "/x" and env["KT_SERVE_THREADS"] == "3"
    assert KTServeConfig.from_env(env) == KTServeConfig(expert_lora_path="/x", threads=3, max_expert_loras="5")
    with pytest.raises(ValueError, match="kt-moe"):
        KTServeConfig(moe="maybe")


@pytest.mark.parametrize("flag, field", [("--kt-dense-dtype", "dense_dtype"), ("--kt-lm-head-dtype", "lm_head_dtype")])
def test_dense_dtype_needs_the_packed_cpu_ops_and_a_known_format(flag, field):
    env = {}
    KTServeConfig(**{field: "int4"}).export(env)
    assert getattr(KTServeConfig.from_env(env), field) == "int4"
    with pytest.raises(ValueError, match=f"{flag} int8 quantizes layers --kt-cpu-ops packs"):
        KTServeConfig(**{field: "int8"}, cpu_ops="off")
    with pytest.raises(ValueError, match=f"{flag} int8 quantizes"):
        KTServeConfig(**{field: "int8"}, moe="off")  # cpu_ops auto follows --kt-moe
    with pytest.raises(ValueError, match=f"{flag}='fp8': expected bf16, int8, int4"):
        KTServeConfig(**{field: "fp8"})


def test_dense_dtype_refused_where_sglangs_own_kernels_run_the_dense_layers(monkeypatch):
    """--kt-dense-dtype quantizes the layers the plugin packs; on an AMX or GPU host SGLang's kernels run them in
    bf16, so the flag is refused at start with the reason instead of being ignored; so is --kt-lm-head-dtype where
    SGLang's LoRA layer would run lm_head."""
    from types import SimpleNamespace

    import sglang.srt.utils.common as common

    from kt_serve.sglang_plugin import args
    from kt_serve.sglang_plugin.cpu_host import compat as cpu_compat

    int8 = KTServeConfig(dense_dtype="int8")
    assert args.unpacked_dense_layers(KTServeConfig()) is None  # bf16: nothing to refuse anywhere
    monkeypatch.setattr(cpu_compat, "cpu_only_host", lambda: True)
    monkeypatch.setattr(common, "cpu_has_amx_support", lambda: False)
    assert args.unpacked_dense_layers(int8) is None
    monkeypatch.setattr(common, "cpu_has_amx_support", lambda: True)
    assert args.unpacked_dense_layers(int8).startswith("--kt-dense-dtype int8: the kt_serve kernel runs the linear "
                                                       "layers on CPU-only hosts without AMX")
    monkeypatch.setattr(common, "cpu_has_amx_support", lambda: False)
    monkeypatch.setattr(cpu_compat, "cpu_only_host", lambda: False)  # a GPU host
    assert "drop the flag" in args.unpacked_dense_layers(int8)
    monkeypatch.setattr(cpu_compat, "cpu_only_host", lambda: True)
    head = KTServeConfig(lm_head_dtype="int4")
    assert args.unpacked_dense_layers(head, SimpleNamespace(lora_target_modules=["q_proj", "v_proj"])) is None
    assert args.unpacked_dense_layers(head, SimpleNamespace(lora_target_modules=["q_proj", "lm_head"])).startswith(
        "--kt-lm-head-dtype int4: --lora-target-modules lm_head q_proj puts LoRA on lm_head")


@pytest.mark.parametrize("lm_head_dtype", ["bf16", "int8"])
def test_lm_head_lora_from_the_start_up_adapters_refuses_a_quantized_lm_head(monkeypatch, lm_head_dtype):
    """Target modules inferred from --lora-paths adapters can name lm_head too (SGLang then wraps it once LoRA is set
    up, and its LoRA layer runs lm_head in bf16): a quantized lm_head is refused at start; bf16 is served."""
    from types import SimpleNamespace

    from kt_serve.sglang_plugin.cpu_host import linear

    monkeypatch.setattr(linear, "get_config", lambda: KTServeConfig(lm_head_dtype=lm_head_dtype))
    plain, wrapped = SimpleNamespace(lm_head_module=None), SimpleNamespace(lm_head_module=object())
    assert linear.refuse_lora_on_quantized_lm_head("done", plain) == "done"
    if lm_head_dtype == "bf16":
        assert linear.refuse_lora_on_quantized_lm_head("done", wrapped) == "done"
        return
    with pytest.raises(ValueError, match=r"^--kt-lm-head-dtype int8: the LoRA target modules include lm_head"):
        linear.refuse_lora_on_quantized_lm_head("done", wrapped)


def test_torch_omp_spin_is_shortened_only_where_unset_and_kernel_on():
    env = {}
    KTServeConfig().export(env)
    assert env["GOMP_SPINCOUNT"] == "10000"
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    KTServeConfig().export(env)
    assert "GOMP_SPINCOUNT" not in env  # the user's choice wins
    env = {}
    KTServeConfig(moe="off").export(env)
    assert "GOMP_SPINCOUNT" not in env  # SGLang's own MoE path: leave torch as it is


@pytest.mark.parametrize("nodes, tp, user, expected", [
    (["0,1,2,3"], 2, None, "0,1|2,3"),           # one node, two ranks: cores split evenly
    (["0,1,2,3"], 3, None, "0|1|2"),
    (["0,1", "2,3"], 2, None, None),             # a node per rank: SGLang's own binding
    (["0,1"], 4, None, None),                    # more ranks than cores: SGLang explains
    (["0,1,2,3"], 2, "0-1|2-3", "0-1|2-3"),      # the user's binding wins
])
def test_cores_split_between_tp_ranks(monkeypatch, nodes, tp, user, expected):
    import sglang.srt.utils.common as common
    from types import SimpleNamespace

    from kt_serve.sglang_plugin.cpu_host import compat as cpu_compat

    monkeypatch.setattr(common, "get_cpu_ids_by_node", lambda: nodes)
    monkeypatch.setattr(cpu_compat, "cpu_only_host", lambda: True)
    env = {} if user is None else {"SGLANG_CPU_OMP_THREADS_BIND": user}
    cpu_compat.split_cores_between_ranks(SimpleNamespace(tp_size=tp, pp_size=1, dp_size=1), env)
    assert env.get("SGLANG_CPU_OMP_THREADS_BIND") == expected


@pytest.mark.parametrize("x_dtype, ids_dtype", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)])
def test_offload_round_trip_logic_on_cpu(x_dtype, ids_dtype):
    """The accelerator path (copies to host buffers, kernel into a given output, copy back in the caller's dtype),
    driven with CPU tensors: same numbers as the fp32 reference, output in x's dtype."""
    from kt_serve.kernel.experts import ExpertLoRA, MoEExperts
    from kt_serve.sglang_plugin.experts import KTRoutedExpertsMethod
    from moe_reference import moe_lora_reference

    E, H, I, r, T, k = 6, 48, 40, 4, 5, 2
    g = torch.Generator().manual_seed(3)
    gate, up, down = ((torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((E, I, H), (E, I, H), (E, H, I)))
    shapes = [(E, r, H), (E, I, r), (E, r, H), (E, I, r), (E, r, I), (E, H, r)]
    lora = ExpertLoRA(*((torch.randn(*s, generator=g) * 0.1).bfloat16() for s in shapes), alpha=8.0)
    method = KTRoutedExpertsMethod.__new__(KTRoutedExpertsMethod)
    method.experts = MoEExperts(gate, up, down)
    method.experts.set_adapter(1, lora)
    x = torch.randn(T, H, generator=g).bfloat16().to(x_dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(ids_dtype)
    w = torch.rand(T, k, generator=g).half()  # routing weights arrive in the model's dtype
    y = method._forward_offload(x, ids, w, 1)
    assert y.dtype == x_dtype and y.shape == (T, H)
    ref = moe_lora_reference(x.bfloat16(), ids.long(), w.float(), gate, up, down, lora=lora.to_kt() | {"alpha": 8.0})
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    assert torch.equal(y, method._forward_cpu(x, ids, w, 1))


def test_tensor_parallel_expert_slices_sum_to_the_full_adapted_experts():
    """Two TP ranks' kernels, each with its half of every expert's intermediate dimension (gate / up rows, down
    columns) and ExpertLoRA.shard's half of the adapter: their outputs sum to the fp32 reference of the whole adapted
    experts (what SGLang's all-reduce computes), and each holds half of the packed expert bytes."""
    from kt_serve.kernel.experts import ExpertLoRA, MoEExperts
    from moe_reference import moe_lora_reference

    E, H, I, r, T, k, ranks = 6, 64, 128, 4, 7, 2, 2
    g = torch.Generator().manual_seed(5)
    gate, up, down = ((torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((E, I, H), (E, I, H), (E, H, I)))
    shapes = [(E, r, H), (E, I, r), (E, r, H), (E, I, r), (E, r, I), (E, H, r)]
    lora = ExpertLoRA(*((torch.randn(*s, generator=g) * 0.1).bfloat16() for s in shapes), alpha=8.0)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    total = torch.zeros(T, H)
    for rank in range(ranks):
        rows = slice(rank * I // ranks, (rank + 1) * I // ranks)
        experts = MoEExperts(gate[:, rows], up[:, rows], down[:, :, rows])
        experts.set_adapter(0, lora.shard(rank, ranks))
        total += experts.forward_sft(x, ids, w, save_for_backward=False, slots=0).float()
    ref = moe_lora_reference(x, ids, w, gate, up, down, lora=lora.to_kt() | {"alpha": 8.0}).float()
    assert ((total - ref).norm() / ref.norm()).item() < 1e-2
    unsharded = MoEExperts(gate, up, down)
    assert experts.weight_bytes * ranks == unsharded.weight_bytes
    unsharded.set_adapter(0, lora.shard(0, 1))  # one rank: the adapter whole
    assert ((unsharded.forward_sft(x, ids, w, save_for_backward=False, slots=0).float() - ref).norm()
            / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("given,cpu_ops,amx,mla,expected", [
    ({}, True, False, False, "kt_cpu"),                                   # SGLang would fall back to torch_native
    ({"attention_backend": "torch_native"}, True, False, False, "torch_native"),  # the user's choice stays
    ({"decode_attention_backend": "torch_native"}, True, False, False, None),
    ({}, False, False, False, None),                                       # --kt-cpu-ops off / --kt-moe off
    ({}, True, True, False, None),                                         # AMX: SGLang's intel_amx kernels
    ({}, True, False, True, None),                                         # MLA latent cache (DeepSeek)
])
def test_kt_cpu_attention_is_the_default_only_where_it_replaces_torch_native(tmp_path, monkeypatch, given, cpu_ops,
                                                                              amx, mla, expected):
    import argparse
    import json

    import sglang.srt.utils.common as common

    from kt_serve.sglang_plugin.cpu_host import attention as cpu_attention

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.setattr(common, "cpu_has_amx_support", lambda: amx)
    (tmp_path / "config.json").write_text(json.dumps({"kv_lora_rank": 512} if mla else {"num_key_value_heads": 4}))
    ns = argparse.Namespace(model_path=str(tmp_path), attention_backend=None, prefill_attention_backend=None,
                            decode_attention_backend=None)
    for key, value in given.items():
        setattr(ns, key, value)
    cpu_attention.default_on_cpu(ns, cpu_ops)
    assert ns.attention_backend == expected


def test_expert_adapter_budget_is_a_count_a_size_or_auto():
    from kt_serve.sglang_plugin.config import ExpertBudget

    assert ExpertBudget.parse("8") == ExpertBudget(slots=8) and ExpertBudget.parse(8).kernel_slots == 8
    assert ExpertBudget.parse("24GiB") == ExpertBudget(nbytes=24 * 2**30)
    assert ExpertBudget.parse("1.5 gib").nbytes == 3 * 2**29 and ExpertBudget.parse("512MB").nbytes == 512 * 10**6
    auto = ExpertBudget.parse("auto")
    assert auto.auto and auto.resolved(4 * 2**30) == ExpertBudget(nbytes=2**30, auto=True)
    for bad in ("0", "-3", "lots", "12 GB of RAM", "0GiB"):
        with pytest.raises(ValueError, match=rf"^--kt-max-expert-loras={bad}: expected"):
            KTServeConfig(max_expert_loras=bad)


def test_a_layer_filled_by_several_loader_threads_is_packed_once(monkeypatch):
    """DeepSeek's SGLang loader fills a layer's expert tensors from a thread pool: the last tensors of a layer can
    arrive together, and the layer must still be packed exactly once (packing releases the staging tensors)."""
    import sys
    import threading
    from types import SimpleNamespace

    from kt_serve.sglang_plugin import experts as plugin_experts

    E, H, I, threads, layers = 4, 8, 4, 8, 20
    monkeypatch.setattr(plugin_experts, "get_registry", lambda: SimpleNamespace())  # no scheduler context here
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the window between two bytecodes counts
    try:
        for layer_id in range(layers):
            method = plugin_experts.KTRoutedExpertsMethod()
            method.shape = (E, H, I)
            method._loaded = _YieldingSet()  # a thread switch right after each record, where it hurts most
            packs = []
            # packing takes long and releases the GIL (the kernel packs in C++) before the staging is released
            method._pack = lambda layer, packs=packs, m=method: (packs.append(layer.layer_id), time.sleep(0.002),
                                                                  setattr(m, "experts", object()), m._loaded.clear())
            layer = SimpleNamespace(layer_id=layer_id, w13_weight=torch.zeros(E, 2 * I, H),
                                    w2_weight=torch.zeros(E, H, I))
            load = method._weight_loader(layer)
            jobs = [(e, shard) for e in range(E) for shard in ("w1", "w3", "w2")]
            barrier = threading.Barrier(threads)

            def worker(part):
                barrier.wait()
                for e, shard in part:
                    param = layer.w2_weight if shard == "w2" else layer.w13_weight
                    shape = (H, I) if shard == "w2" else (I, H)
                    load(param, torch.ones(shape), f"experts.{e}.{shard}", shard_id=shard, expert_id=e)

            pool = [threading.Thread(target=worker, args=(jobs[i::threads],)) for i in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
            assert packs == [layer_id], f"layer {layer_id} packed {len(packs)} times"
    finally:
        sys.setswitchinterval(interval)


def test_fp8_experts_staged_at_the_checkpoints_size_and_rank_slices_of_whole_blocks(monkeypatch):
    """The staging holds the checkpoint's intermediate size (SGLang's CPU engine pads its config's), with partial
    edge blocks of FP8 scales at one rank; a TP rank's slice that would split a scale block is refused, naming the
    sizes."""
    from types import SimpleNamespace

    from kt_serve.sglang_plugin import experts as plugin_experts

    monkeypatch.setattr(plugin_experts, "get_registry", lambda: SimpleNamespace())
    config = SimpleNamespace(activation="silu", is_gated=True, apply_router_weight_on_input=False)

    def staged(checkpoint_i, sglang_i, ranks):
        monkeypatch.setattr(plugin_experts, "checkpoint_moe_intermediate_size", lambda: checkpoint_i)
        layer = SimpleNamespace(layer_id=3, moe_tp_rank=ranks - 1, moe_tp_size=ranks, moe_runner_config=config)
        layer.register_parameter = lambda name, param: setattr(layer, name, param)
        plugin_experts.KTRoutedExpertsMethod(fp8_block=(128, 128)).create_weights(layer, 4, 192, sglang_i,
                                                                                   torch.bfloat16)
        return {name: tuple(getattr(layer, name).shape) for name in ("w13_weight", "w2_weight",
                                                                     "w13_weight_scale_inv", "w2_weight_scale_inv")}

    assert staged(160, 256, 1) == {"w13_weight": (4, 320, 192), "w2_weight": (4, 192, 160),
                                   "w13_weight_scale_inv": (4, 4, 2), "w2_weight_scale_inv": (4, 2, 2)}
    assert staged(512, 256, 2)["w2_weight"] == (4, 192, 256)
    with pytest.raises(ValueError, match=r"^kt_serve: MoE layer 3: intermediate size 384 over --tp-size 2 is 192 a "
                                         r"rank, not a multiple of the FP8 blocks \[128, 128\]"):
        staged(384, 192, 2)


class _YieldingSet(set):
    def add(self, item):
        super().add(item)
        time.sleep(0.0005)
