"""The expert-adapter pool on a real server: 32 composite adapters registered over 4 resident, skewed traffic.

A reference server holds all of them resident (``--kt-max-expert-loras 33``) and answers each (adapter, prompt) once;
the pool server (``--kt-max-expert-loras 4``, batches of up to 4 adapters) then serves 8 client threads for
``KT_SERVE_PROBE_SECONDS`` (default 45) with a Zipf-like choice of adapter per request and base requests mixed in:
every answer must equal the reference server's, with no error status, evictions and reloads counted in the log and
in ``/get_server_info``, the server's memory flat. SGLang itself keeps 16 of the 32 loaded (``--max-loaded-loras``),
so both halves of an adapter are also unloaded and loaded again under the traffic. Also here: an adapter found by
name under ``--kt-lora-dir`` on first use, unloading an adapter with requests in flight, and a
name registered twice.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import threading
import time

import openai
import psutil
import pytest

from kt_serve.harness.server import SGLangServer
from kt_serve.harness.tiny_model import build_tiny_moe
from kt_serve.harness.reference import write_kt_adapter
from test_serving import TOL, complete

N_ADAPTERS = 32
RESIDENT = 4
PROMPTS = [[11, 42, 7, 300, 5], [901, 17, 64, 3, 250], [5, 5, 80, 123, 777]]
MAX_TOKENS = 4
THREADS = 8
SECONDS = float(os.environ.get("KT_SERVE_PROBE_SECONDS", "45"))
ARGS = ["--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", str(RESIDENT),
        "--max-running-requests", "8"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    model = str(build_tiny_moe(root / "qwen3", "qwen3_moe"))
    paths = {f"a{i}": write_kt_adapter(root / f"a{i}", model, seed=100 + i, gates=i % 4 == 0)
             for i in range(N_ADAPTERS)}
    write_kt_adapter(root / "found", model, seed=99)  # in --kt-lora-dir only: loaded on first use
    return model, paths, root


def lora_paths(paths: dict) -> list[str]:
    return ["--lora-paths", *(f"{name}={path}" for name, path in paths.items())]


@pytest.fixture(scope="module")
def reference(adapters):
    """(adapter or None, prompt index) -> (token ids, logprobs), every adapter resident."""
    model, paths, root = adapters
    every = {**paths, "found": root / "found"}
    with SGLangServer(model, ARGS + ["--kt-max-expert-loras", str(N_ADAPTERS + 1)] + lora_paths(every)) as server:
        return {(name, p): complete(server, model if name is None else f"{model}:{name}", PROMPTS[p], MAX_TOKENS)
                for name in [None, *every] for p in range(len(PROMPTS))}


@pytest.fixture(scope="module")
def pool_server(adapters):
    """Half the adapters registered at start, the other half through /load_lora_adapter; SGLang keeps 16 loaded
    (--max-loaded-loras: it unloads the least recently used and loads it again when a request names it), the
    expert pool 4 resident."""
    model, paths, root = adapters
    names = list(paths)
    first = {name: paths[name] for name in names[: N_ADAPTERS // 2]}
    args = ARGS + ["--kt-max-expert-loras", str(RESIDENT), "--max-loaded-loras", str(N_ADAPTERS // 2),
                   "--kt-lora-dir", str(root)]
    with SGLangServer(model, args + lora_paths(first)) as server:
        for name in names[N_ADAPTERS // 2:]:
            status, body = server.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(paths[name])})
            assert status == 200 and body.get("success"), body
        yield server


def adapter_state(server) -> dict:
    return server.get("/get_server_info")["internal_states"][0]["kt_expert_adapters"]


def group_rss(server) -> int:
    procs = [psutil.Process(server.proc.pid)]
    procs += procs[0].children(recursive=True)
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def assert_same(got, want, what):
    ids, logprobs = got
    assert ids == want[0], f"{what}: tokens {ids} vs {want[0]} from the server holding every adapter"
    assert max(abs(a - b) for a, b in zip(logprobs, want[1])) < TOL, f"{what}: {logprobs} vs {want[1]}"


def test_skewed_traffic_over_more_adapters_than_slots_matches_all_resident(pool_server, adapters, reference):
    model, paths, _ = adapters
    names = list(paths)
    weights = [1.0 / (rank + 1) for rank in range(len(names))]  # Zipf, s = 1
    state = adapter_state(pool_server)
    assert len(state["adapters"]) == N_ADAPTERS // 2 and sum(a["resident"] for a in state["adapters"]) <= RESIDENT
    rss_start = group_rss(pool_server)
    rss_peak = rss_start
    stop = time.monotonic() + SECONDS
    failures, done = [], []

    def client_thread(seed):
        rng = random.Random(seed)
        while time.monotonic() < stop:
            name = None if rng.random() < 0.2 else rng.choices(names, weights)[0]
            p = rng.randrange(len(PROMPTS))
            try:
                got = complete(pool_server, model if name is None else f"{model}:{name}", PROMPTS[p], MAX_TOKENS)
                assert_same(got, reference[name, p], f"{name} on prompt {p}")
                done.append(name)
            except Exception as e:  # an HTTP error or a wrong answer: collected, the traffic goes on
                failures.append(f"{name} on prompt {p}: {type(e).__name__}: {e}")

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(client_thread, seed) for seed in range(THREADS)]
        while not all(f.done() for f in futures):
            rss_peak = max(rss_peak, group_rss(pool_server))
            time.sleep(1.0)
        for f in futures:
            f.result()
    assert not failures, f"{len(failures)} of {len(failures) + len(done)} requests failed: {failures[:5]}"
    state = adapter_state(pool_server)
    distinct = {name for name in done if name is not None}
    assert len(distinct) > 2 * RESIDENT, f"only {len(distinct)} adapters drawn in {SECONDS} s"
    assert state["evictions"] > 0 and state["loads"] >= len(distinct), state
    assert sum(a["resident"] for a in state["adapters"]) <= RESIDENT
    assert state["resident_bytes"] <= RESIDENT * max(a["bytes"] for a in state["adapters"])
    log = pool_server.log_tail(1_000_000)
    counted = re.findall(r"(\d+) loads, (\d+) evictions so far", log)
    assert counted and tuple(map(int, counted[-1])) == (state["loads"], state["evictions"])
    assert "Reloading evicted adapter" in log  # SGLang's --max-loaded-loras unloaded some and loaded them again
    # memory: flat under load (the resident set is bounded; a leak per load would grow with the loads)
    assert rss_peak - rss_start < 64 * 2**20, (f"server RSS grew {(rss_peak - rss_start) / 2**20:.1f} MiB over "
                                               f"{state['loads']} adapter loads")
    print(f"\nprobe: {len(done)} requests in {SECONDS:.0f} s over {len(distinct)} adapters; {state['loads']} loads, "
          f"{state['evictions']} evictions; RSS {rss_start / 2**20:.0f} -> peak {rss_peak / 2**20:.0f} MiB")


def test_unload_with_requests_in_flight_finishes_them_first(pool_server, adapters, reference):
    """The unload waits for the adapter's requests in flight (their answers are whole and right), then both halves
    go; a later request naming it has SGLang load it again from its path, expert half included."""
    model, paths, _ = adapters
    name = "a5"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        traffic = [pool.submit(complete, pool_server, f"{model}:{name}", PROMPTS[i % 3], 32, ignore_eos=True)
                   for i in range(4)]
        time.sleep(0.5)
        status, body = pool_server.post("/unload_lora_adapter", {"lora_name": name})
        assert status == 200 and body.get("success"), body
        assert all(f.done() for f in traffic)
        for i, f in enumerate(traffic):
            ids, logprobs = f.result()
            assert len(ids) == 32
            assert_same((ids[:MAX_TOKENS], logprobs[:MAX_TOKENS]), reference[name, i % 3], f"{name} in its unload")
    assert name not in {a["name"] for a in adapter_state(pool_server)["adapters"]}
    assert_same(complete(pool_server, f"{model}:{name}", PROMPTS[1], MAX_TOKENS), reference[name, 1], "reloaded")
    assert name in {a["name"] for a in adapter_state(pool_server)["adapters"]}


def test_a_name_registered_twice_is_refused_and_the_first_kept(pool_server, adapters, reference):
    """A name that is loaded now (SGLang's --max-loaded-loras decides which are) cannot be loaded again from
    another path; the first keeps serving."""
    model, paths, _ = adapters
    name = next(a["name"] for a in adapter_state(pool_server)["adapters"] if a["name"] in paths)
    other = next(n for n in paths if n != name)
    status, body = pool_server.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(paths[other])})
    assert 400 <= status < 500 and not body.get("success", False), body
    assert_same(complete(pool_server, f"{model}:{name}", PROMPTS[2], MAX_TOKENS), reference[name, 2], "kept")
    assert sum(a["name"] == name for a in adapter_state(pool_server)["adapters"]) == 1

def test_an_adapter_under_the_lora_dir_is_found_on_first_use(pool_server, adapters, reference):
    """--kt-lora-dir: 'found' was never loaded; the first request naming it loads it (both halves) and gets the
    answer of the server that had it from the start. A name that is not there, or not a plain name, stays a 4xx."""
    model, _, _ = adapters
    assert "found" not in {a["name"] for a in adapter_state(pool_server)["adapters"]}
    assert_same(complete(pool_server, f"{model}:found", PROMPTS[0], MAX_TOKENS), reference["found", 0], "found")
    assert "found" in {a["name"] for a in adapter_state(pool_server)["adapters"]}
    for name in ("missing", "..", "qwen3/.."):
        with pytest.raises(openai.APIStatusError) as err:
            complete(pool_server, f"{model}:{name}", PROMPTS[0], MAX_TOKENS)
        assert 400 <= err.value.status_code < 500, name
    assert_same(complete(pool_server, model, PROMPTS[1], MAX_TOKENS), reference[None, 1], "base after refusals")
