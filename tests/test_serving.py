"""End-to-end: stock ``python -m sglang.launch_server`` + the kt_serve plugin on CPU, queried with ``openai``.

Every served logprob is compared with an fp32 HF transformers reference with the LoRA merged in plain torch
(kt_serve/harness/reference.py), within TOL nats. Five server start-ups in all: Qwen3-MoE with composite adapters,
Qwen3-MoE with a global --kt-expert-lora-path, Qwen2-MoE (shared expert), Qwen3-MoE with --tp-size 2, and a
refused start (mismatched expert adapter).
"""

from __future__ import annotations

import concurrent.futures
import re

import openai
import pytest

from kt_serve.harness.server import ServerStartError, SGLangServer
from kt_serve.harness.tiny_model import build_tiny_moe
from kt_serve.harness import reference
from kt_serve.harness.reference import HFReference, write_expert_peft_adapter, write_kt_adapter

TOL = 0.02  # nats; bf16 serving vs fp32 reference (notes: 0.001-0.013 observed)
MIN_EFFECT = 5 * TOL  # an adapter must move some logprob by far more than the tolerance, else a no-op would pass
PROMPT_LEN = 5
MAX_TOKENS = 6
# Routing near-ties: where the reference's last chosen and first rejected expert probabilities are closer than this,
# the bf16 server may pick the other expert and the two stop being the same computation. Measured: a margin of
# 1.22e-3 (layer 0, the 8th token of the global-expert test) was tipped by the rounding of a bf16 attention output,
# and the fp32 reference with that one choice flipped matched all six served logprobs within 0.009 nats.
TIE_MARGIN = 2e-3
LORA_ARGS = ["--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", "4",
             "--max-running-requests", "8"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serving")


@pytest.fixture(scope="module")
def qwen3(workdir):
    model = str(build_tiny_moe(workdir / "qwen3", "qwen3_moe"))
    adapters = {
        "both": write_kt_adapter(workdir / "both", model, seed=1),                       # attention + experts
        "attn": write_kt_adapter(workdir / "attn", model, seed=2, experts=False),        # non-expert only
        "both2": write_kt_adapter(workdir / "both2", model, seed=3, gates=True),        # + router LoRA
        "global": write_expert_peft_adapter(workdir / "global", model, seed=4),          # expert only
    }
    ref = HFReference(model)
    sets = [[], [adapters["attn"]], [adapters["both"]], [adapters["both2"]], [adapters["global"]],
            [adapters["attn"], adapters["global"]]]
    return model, adapters, ref, pick_prompts(ref, sets)


def pick_prompts(ref, adapter_sets, n=3, seed=0, tie_margin=TIE_MARGIN):
    """PROMPT_LEN-token prompts with no reference routing near-tie under any of the adapter sets."""
    return reference.pick_prompts(ref, adapter_sets, n=n, length=PROMPT_LEN, tie_margin=tie_margin, seed=seed)


def complete(server, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS, ignore_eos: bool = False):
    """Greedy completion: (token ids, per-token logprobs)."""
    return server.greedy(model, prompt, max_tokens, ignore_eos=ignore_eos)


def assert_matches_reference(ref, prompt, ids, logprobs, adapter_dirs, *, tie_margin=TIE_MARGIN, min_compared=1):
    """Every served logprob predicted before the reference's first routing near-tie (closer than ``tie_margin``)
    is within TOL, and at least ``min_compared`` are. Returns the positions compared."""
    keep, want, first_tie = reference.compared_positions(ref, prompt, ids, adapter_dirs, tie_margin)
    assert len(keep) >= min_compared, (f"routing near-tie at position {first_tie} leaves {len(keep)} tokens to "
                                       f"compare; pick another prompt")
    diff = max(abs(logprobs[i] - want[i]) for i in keep)
    assert diff < TOL, (f"served {logprobs} vs reference {want} (max diff {diff:.4f} over {len(keep)} "
                        f"tokens, adapters {adapter_dirs})")
    return keep


def concurrent_equals_sequential(run, jobs) -> dict:
    """``run(job) -> (ids, logprobs)`` for every job alone, then for all at once (one mixed batch): each job's
    tokens equal and its logprobs within TOL. Returns the concurrent results by job."""
    sequential = {job: run(job) for job in jobs}
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {job: pool.submit(run, job) for job in jobs}
        results = {job: f.result() for job, f in futures.items()}
    for job in jobs:
        (seq_ids, seq_lp), (con_ids, con_lp) = sequential[job], results[job]
        assert con_ids == seq_ids, job
        assert max(abs(a - b) for a, b in zip(con_lp, seq_lp)) < TOL, job
    return results


# -- server 1: Qwen3-MoE, composite adapters per request, dynamic load/unload ---------------------------------
@pytest.fixture(scope="module")
def server_q3(qwen3):
    model, adapters, _, _ = qwen3
    args = LORA_ARGS + ["--lora-paths", f"both={adapters['both']}", f"attn={adapters['attn']}"]
    with SGLangServer(model, args) as server:
        yield server


@pytest.mark.parametrize("name", [None, "attn", "both"])
def test_per_request_adapter_matches_reference(server_q3, qwen3, name):
    model, adapters, ref, prompts = qwen3
    served = model if name is None else f"{model}:{name}"
    dirs = [] if name is None else [adapters[name]]
    prompt = prompts[0]
    ids, logprobs = complete(server_q3, served, prompt)
    assert_matches_reference(ref, prompt, ids, logprobs, dirs)
    if name is not None:  # the adapter really acted
        base = ref.logprobs(prompt + ids, len(prompt), [])
        assert max(abs(a - b) for a, b in zip(logprobs, base)) > MIN_EFFECT


def test_expert_half_is_applied(server_q3, qwen3):
    """':both' differs from the same adapter without its expert half (attention-only reference)."""
    model, adapters, ref, prompts = qwen3
    prompt = prompts[1]
    ids, logprobs = complete(server_q3, f"{model}:both", prompt)
    assert_matches_reference(ref, prompt, ids, logprobs, [adapters["both"]])
    # reference without the experts: the non-expert half only, merged from a PEFT dir written by the test
    from kt_serve.formats import load_adapter_dir, write_peft_adapter

    half = load_adapter_dir(adapters["both"])
    nonexpert_dir = write_peft_adapter(adapters["both"].parent / "both_nonexpert", half.nonexpert,
                                       {"r": half.rank, "lora_alpha": half.alpha}, overwrite=True)
    without_experts = ref.logprobs(prompt + ids, len(prompt), [nonexpert_dir])
    assert max(abs(a - b) for a, b in zip(logprobs, without_experts)) > MIN_EFFECT


def test_concurrent_mixed_batch_equals_sequential(server_q3, qwen3):
    model, adapters, ref, prompts = qwen3
    jobs = [(name, tuple(prompt)) for prompt in prompts for name in (None, "attn", "both")]

    def run(job):
        name, prompt = job
        return complete(server_q3, model if name is None else f"{model}:{name}", list(prompt))

    for (name, prompt), (ids, logprobs) in concurrent_equals_sequential(run, jobs).items():
        assert_matches_reference(ref, list(prompt), ids, logprobs, [] if name is None else [adapters[name]])


def test_unknown_adapter_is_4xx_and_server_keeps_serving(server_q3, qwen3):
    model, _, _, prompts = qwen3
    with pytest.raises(openai.APIStatusError) as err:
        complete(server_q3, f"{model}:no_such_adapter", prompts[0])
    assert 400 <= err.value.status_code < 500
    complete(server_q3, model, prompts[0])


def test_dynamic_load_unload_composite_under_traffic(server_q3, qwen3, workdir):
    model, adapters, ref, prompts = qwen3
    prompt = prompts[2]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        traffic = [pool.submit(complete, server_q3, f"{model}:both", prompt) for _ in range(4)]
        status, body = server_q3.post("/load_lora_adapter", {"lora_name": "dyn", "lora_path": str(adapters["both2"])})
        assert status == 200 and body.get("success"), body
        for f in traffic:
            ids, logprobs = f.result()
            assert_matches_reference(ref, prompt, ids, logprobs, [adapters["both"]])
    ids, logprobs = complete(server_q3, f"{model}:dyn", prompt)
    assert_matches_reference(ref, prompt, ids, logprobs, [adapters["both2"]])
    status, body = server_q3.post("/unload_lora_adapter", {"lora_name": "dyn"})
    assert status == 200 and body.get("success"), body
    # the slot is free again: reload under another name works and gives the same numbers
    status, body = server_q3.post("/load_lora_adapter", {"lora_name": "dyn2", "lora_path": str(adapters["both2"])})
    assert status == 200 and body.get("success"), body
    assert complete(server_q3, f"{model}:dyn2", prompt)[0] == ids


def test_corrupt_adapter_load_is_4xx_and_nothing_half_loaded(server_q3, qwen3, workdir):
    model, adapters, ref, prompts = qwen3
    bad = workdir / "corrupt"
    bad.mkdir()
    for f in adapters["both"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    fused = bad / "fused_expert_lora.safetensors"
    fused.write_bytes(fused.read_bytes()[: fused.stat().st_size // 2])  # truncated expert file
    status, body = server_q3.post("/load_lora_adapter", {"lora_name": "bad", "lora_path": str(bad)})
    assert 400 <= status < 500 and not body.get("success", False), body
    with pytest.raises(openai.APIStatusError):
        complete(server_q3, f"{model}:bad", prompts[0])
    ids, logprobs = complete(server_q3, f"{model}:both", prompts[0])
    assert_matches_reference(ref, prompts[0], ids, logprobs, [adapters["both"]])


# -- server 2: Qwen3-MoE with a global expert adapter -------------------------------------------------------
@pytest.fixture(scope="module")
def server_q3_global(qwen3):
    model, adapters, _, _ = qwen3
    args = ["--kt-expert-lora-path", str(adapters["global"]), "--kt-threads", "1"] + LORA_ARGS + [
        "--lora-paths", f"attn={adapters['attn']}", f"both={adapters['both']}"]
    with SGLangServer(model, args) as server:
        yield server


@pytest.mark.parametrize("name, expected", [(None, ["global"]), ("attn", ["attn", "global"]), ("both", ["both"])])
def test_global_expert_adapter(server_q3_global, qwen3, name, expected):
    """Base requests get the global expert adapter; a non-expert adapter adds to it; a composite replaces it."""
    model, adapters, ref, prompts = qwen3
    prompt = prompts[1]
    ids, logprobs = complete(server_q3_global, model if name is None else f"{model}:{name}", prompt)
    assert_matches_reference(ref, prompt, ids, logprobs, [adapters[k] for k in expected])


# -- server 3: Qwen2-MoE (shared expert + sigmoid gate); shared-expert LoRA must not wrap FusedMoE; router and
# shared-expert-gate LoRA (the plugin's gate LoRA) --------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2(workdir):
    model = str(build_tiny_moe(workdir / "qwen2", "qwen2_moe"))
    both = write_kt_adapter(workdir / "q2both", model, seed=5, shared_expert=True, gates=True)
    ref = HFReference(model)
    return model, both, ref, pick_prompts(ref, [[], [both]], n=1)


@pytest.fixture(scope="module")
def server_q2(qwen2):
    model, both, _, _ = qwen2
    with SGLangServer(model, LORA_ARGS + ["--lora-paths", f"both={both}"]) as server:
        yield server


@pytest.mark.parametrize("with_adapter", [False, True])
def test_qwen2_moe_shared_expert(server_q2, qwen2, with_adapter):
    model, both, ref, (prompt,) = qwen2
    ids, logprobs = complete(server_q2, f"{model}:both" if with_adapter else model, prompt)
    assert_matches_reference(ref, prompt, ids, logprobs, [both] if with_adapter else [])


# -- server 4: tensor parallel on CPU (--tp-size 2) ---------------------------------------------------------
def test_tensor_parallel_two_ranks(qwen3, server_q3):
    """--tp-size 2: attention sharded by SGLang, and each rank's kernel holds and computes half of every expert's
    intermediate dimension (the expert halves of the global and the composite adapters sliced to match), summed by
    SGLang's all-reduce; router LoRA (the plugin's gate LoRA) on every rank. Against the fp32 reference, alone and
    mixed in one batch, and equal to the tp=1 server; each rank packs half of every expert.
    On this one-NUMA-node host the plugin splits the cores between the ranks (no SGLANG_CPU_OMP_THREADS_BIND)."""
    model, adapters, ref, prompts = qwen3
    args = ["--tp-size", "2", "--kt-expert-lora-path", str(adapters["global"])] + LORA_ARGS + [
        "--lora-paths", f"both2={adapters['both2']}", f"both={adapters['both']}"]
    expected = {None: ["global"], "both2": ["both2"], "both": ["both"]}
    with SGLangServer(model, args) as server:
        jobs = [(name, tuple(prompt)) for prompt in prompts[:2] for name in expected]

        def run(job):
            name, prompt = job
            return complete(server, model if name is None else f"{model}:{name}", list(prompt))

        results = concurrent_equals_sequential(run, jobs)
        tp2_log = server.log_path.read_text()
    for (name, prompt), (ids, logprobs) in results.items():
        assert_matches_reference(ref, list(prompt), ids, logprobs, [adapters[k] for k in expected[name]])
        if name == "both":  # served by the tp=1 server too
            ids1, logprobs1 = complete(server_q3, f"{model}:both", list(prompt))
            assert ids1 == ids and max(abs(a - b) for a, b in zip(logprobs, logprobs1)) < TOL
    full = packed_mib(server_q3.log_path.read_text())
    per_rank = packed_mib(tp2_log)
    assert set(per_rank) == {(layer, rank) for layer, _ in full for rank in (0, 1)}, per_rank
    for (layer, rank), (intermediate, mib) in per_rank.items():  # exactly half where I/2 fills the kernel's 64-row
        assert intermediate * 2 == full[(layer, None)][0] and mib < full[(layer, None)][1]  # blocks (units test)


def packed_mib(log: str) -> dict:
    """(MoE layer, TP rank or None) -> (intermediate size held, MiB packed), from the plugin's log lines."""
    found = re.findall(r"MoE layer (\d+) \(E=\d+, H=\d+, I=(\d+)(?:: TP rank (\d+)'s 1/\d+)?\) in the "
                       r"kernel: .*?, ([\d.]+) MiB", log)
    return {(int(layer), int(rank) if rank else None): (int(i), float(mib)) for layer, i, rank, mib in found}


# -- refused start-up ---------------------------------------------------------------------------------------
def test_mismatched_expert_adapter_refused_at_start(qwen3, workdir):
    model, _, _, prompts = qwen3
    other = build_tiny_moe(workdir / "qwen3_wide", "qwen3_moe", moe_intermediate_size=32)
    wrong = write_expert_peft_adapter(workdir / "wrong_shape", other, seed=6)
    with pytest.raises(ServerStartError) as err:
        with SGLangServer(model, ["--kt-expert-lora-path", str(wrong)]):
            pass
    message = str(err.value)
    assert "layer 0" in message and "[8, 32, 4]" in message and "[8, 64, 4]" in message, message[-2000:]


def test_cpu_ops_run_on_the_kernel(server_q3):
    """On a CPU host the plugin runs the bf16 linear layers, lm_head (sglang_plugin/cpu_host/linear.py), their LoRA
    (cpu_host/lora_segments.py), RMSNorm (cpu_host/norm.py), q / k norms with rotary embeddings (cpu_host/rotary.py)
    and whole MoE blocks (cpu_host/moe_block.py) on the kernel, and without AMX decode attention too
    (cpu_host/attention.py, chosen by default where SGLang would run torch_native) and whole decode steps
    (cpu_host/decode_stack.py): every served-vs-reference test above went through them."""
    from sglang.srt.utils.common import cpu_has_amx_support

    log = server_q3.log_tail(100000)
    assert "dense layers (linear and lm_head) on the kt_serve kernel" in log, log[-3000:]
    # cpu_host/lora_segments.py: the adapters above
    assert "dense-layer LoRA on the kt_serve kernel (segmented" in log, log[-3000:]
    if not cpu_has_amx_support():  # with AMX SGLang's own intel_amx kernels run norms, rotary, gate and attention
        assert "RMSNorm on the kt_serve kernel" in log, log[-3000:]
        assert "q / k norm and rotary embedding on the kt_serve kernel" in log, log[-3000:]  # Qwen3's, fused
        assert "MoE blocks in one kernel call (router gate, softmax top-k, routed experts)" in log, log[-3000:]
        # both2's requests (router LoRA, loaded under traffic above): the gate module's logits, the kernel's routing
        assert "MoE blocks with router LoRA: SGLang's gate module for the logits, then one kernel call" in log, \
            log[-3000:]
        assert "decode attention on the kt_serve kernel (attention backend kt_cpu" in log, log[-3000:]
        # decode batches ran as one DecodeStack call (cpu_host/decode_stack.py), the adapters' q/k/v and o LoRA in it
        assert re.search(r"decode steps in one kernel call \(\d+ layers and the final norm\)", log), log[-3000:]
        assert "decode steps apply SGLang's LoRA of the layers' projections inside that call" in log, log[-3000:]
    # decode logits straight from the packed lm_head (cpu_host/linear.py decode_logits): the logprobs compared above
    assert "decode logits straight from the packed lm_head" in log, log[-3000:]
    released = re.search(r"([0-9.]+) MiB of torch weights released", log)  # the tests above ran without them
    assert released and float(released.group(1)) > 0, log[-3000:]


def _process_group_cpu_seconds(pgid: int) -> float:
    """user + system CPU time of every live process in a process group, from /proc/<pid>/stat."""
    import os

    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields[2] is the 5th stat field, pgrp; utime, stime are the 14th, 15th
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def test_idle_server_does_not_hold_a_core(server_q3):
    """An idle stock SGLang scheduler polls its sockets in a busy loop (one core at 100%); the plugin turns on
    sleep_on_idle, so between requests the server's processes together use a small fraction of one core."""
    import time

    complete(server_q3, server_q3.model_path, [5, 6, 7])  # the server has just worked, then goes idle
    time.sleep(2.0)
    before, t0 = _process_group_cpu_seconds(server_q3.proc.pid), time.monotonic()
    time.sleep(6.0)
    used = (_process_group_cpu_seconds(server_q3.proc.pid) - before) / (time.monotonic() - t0)
    assert used < 0.3, f"idle server used {used:.2f} cores"
