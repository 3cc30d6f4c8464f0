"""Fast checks of the plugin's pure-Python parts (no server): batch -> slot mapping and the flag round trip."""

import pytest
import torch

pytest.importorskip("sglang")

from kt_serve.sglang_plugin import batch  # noqa: E402
from kt_serve.sglang_plugin.config import KTServeConfig  # noqa: E402


def test_token_slots_follow_request_lengths():
    slots = {None: -1, "a": 0, "b": 3}
    batch.set_batch(["a", None, "b", "a"], [3, 1, 2, 1], slots.get)
    try:
        got = batch.slots_for(7, default_slot=-1)
        # hand-written expectation: 3 tokens of a, 1 base, 2 of b, 1 of a
        assert got.tolist() == [0, 0, 0, -1, 3, 3, 0]
        assert got.dtype == torch.int32
        with pytest.raises(RuntimeError, match="6 tokens"):
            batch.slots_for(6, default_slot=-1)
    finally:
        batch.clear_batch()


def test_uniform_batch_passes_one_slot_and_no_batch_uses_default():
    batch.set_batch(["a", "a"], [4, 1], {"a": 2}.get)
    try:
        assert batch.slots_for(5, default_slot=-1) == 2
    finally:
        batch.clear_batch()
    assert batch.slots_for(9, default_slot=5) == 5


def test_config_round_trips_through_the_environment():
    env = {}
    KTServeConfig(expert_lora_path="/x", threads=3, max_expert_loras=5).export(env)
    assert env["KT_SERVE_EXPERT_LORA_PATH"] == "/x" and env["KT_SERVE_THREADS"] == "3"
    assert KTServeConfig.from_env(env) == KTServeConfig(expert_lora_path="/x", threads=3, max_expert_loras=5)
    with pytest.raises(ValueError, match="kt-moe"):
        KTServeConfig(moe="maybe")
