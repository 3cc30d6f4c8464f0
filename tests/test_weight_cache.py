"""The packed-weight cache (kt_serve/kernel/weight_cache.py) and the checkpoint reader that skips what it holds
(sglang_plugin/checkpoint.py), without a server: a layer read back is the kernel state packing gave, bit for bit, in
every format; a stale, truncated or corrupt file is refused with the reason, never served; a crash while writing
leaves no file; the checkpoint's expert tensors of cached layers are not read, every other tensor is, exactly."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from kt_serve.formats.safetensors_io import read_header
from kt_serve.kernel import weight_cache
from kt_serve.kernel.experts import MoEExperts
from kt_serve.kernel.weights import WEIGHT_FORMATS

E, H, I = 4, 192, 160  # K values that are not multiples of the 128 group, N not of the 64-column block


def experts(fmt: str, shape=(E, H, I)) -> MoEExperts:
    e, h, i = shape
    g = torch.Generator().manual_seed(1)
    w = {n: torch.randn(s, generator=g) * 0.05 for n, s in (("gate_proj", (e, i, h)), ("up_proj", (e, i, h)),
                                                           ("down_proj", (e, h, i)))}
    return MoEExperts(**w, weight_format=fmt, group_size=64, max_slots=2)


def key(fmt: str, shape=(E, H, I), **changes) -> weight_cache.LayerKey:
    fields = dict(source="ab" * 32, weight_format=fmt, group_size=64, shard=(0, 1), shape=shape)
    return weight_cache.LayerKey(**{**fields, **changes})


# the large layer's regions are MiBs in 2 MiB-aligned kernel buffers: read with O_DIRECT, their tails buffered
@pytest.mark.parametrize("fmt, shape", [(f, (E, H, I)) for f in WEIGHT_FORMATS] + [("int4", (8, 1024, 1056))])
def test_a_cached_layer_is_the_packed_layer_bit_for_bit(tmp_path, fmt, shape):
    packed = experts(fmt, shape)
    path = tmp_path / "layer_0003.safetensors"
    weight_cache.store(path, packed, key(fmt, shape))
    read = weight_cache.load(path, key(fmt, shape), max_slots=2)
    assert read.weight_format == fmt and read.group_size == packed.group_size
    for a, b in zip(packed.packed_regions(), read.packed_regions()):
        assert torch.equal(a, b)
    want, got = packed.dequantized(), read.dequantized()
    assert all(torch.equal(want[name], got[name]) for name in want)
    x = torch.randn(5, shape[1]).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [1, 2], [3, 3], [2, 0], [1, 1]])
    w = torch.rand(5, 2)
    assert torch.equal(packed.forward_sft(x, ids, w, save_for_backward=False),
                       read.forward_sft(x, ids, w, save_for_backward=False))
    # the file is a plain safetensors file of uint8 regions, readable by any safetensors tool
    with safe_open(str(path), "pt") as f:
        regions = [k for k in f.keys() if not k.endswith(".pad")]
        assert sorted(regions) == [weight_cache.region_key(i) for i in range(len(packed.packed_regions()))]
        assert json.loads(f.metadata()["key"])["weight_format"] == fmt
    header, start = read_header(path)
    assert all((start + header[k]["data_offsets"][0]) % weight_cache.ALIGN == 0 for k in regions)


def _flip(path, offset_from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_stale_truncated_or_corrupt_files_are_refused_with_the_reason(tmp_path, fmt, monkeypatch):
    path = tmp_path / "layer_0000.safetensors"
    weight_cache.store(path, experts(fmt), key(fmt))
    size = path.stat().st_size
    with pytest.raises(weight_cache.CacheMiss, match="not cached yet"):
        weight_cache.load(tmp_path / "layer_0001.safetensors", key(fmt))
    for changed in (dict(source="cd" * 32), dict(group_size=128), dict(shard=(1, 2)), dict(weight_format="int8")):
        with pytest.raises(weight_cache.CacheMiss, match=f"stale \\({next(iter(changed))} changed"):
            weight_cache.load(path, key(fmt, **changed))
    monkeypatch.setattr(weight_cache, "LAYOUT_VERSION", weight_cache.LAYOUT_VERSION + 1)
    with pytest.raises(weight_cache.CacheMiss, match="stale \\(kernel layout version"):
        weight_cache.load(path, key(fmt))
    monkeypatch.undo()
    # one flipped bit anywhere in a region's bytes (the padding between regions carries nothing)
    header, start = read_header(path)
    for name, entry in header.items():
        if name == "__metadata__" or name.endswith(".pad"):
            continue
        begin, end = entry["data_offsets"]
        for offset in sorted({begin, (begin + end) // 2, end - 1}):
            _flip(path, size - (start + offset))
            with pytest.raises(weight_cache.CacheMiss, match=f"corrupt \\({name}'s bytes"):
                weight_cache.load(path, key(fmt))
            _flip(path, size - (start + offset))
    weight_cache.load(path, key(fmt))  # restored: served again
    with open(path, "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(weight_cache.CacheMiss, match="truncated"):
        weight_cache.load(path, key(fmt))
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(weight_cache.CacheMiss, match="unreadable"):
        weight_cache.load(path, key(fmt))


def test_a_read_error_is_a_cache_miss_and_no_read_outlives_it(tmp_path, monkeypatch):
    """An I/O error on the cache disk makes the layer packed from the checkpoint again (a CacheMiss naming it),
    not a failed start; and the error is raised only once every other read into the layer's memory is done."""
    import threading
    import time

    path = tmp_path / "layer_0000.safetensors"
    weight_cache.store(path, experts("int4", (8, 1024, 1056)), key("int4", (8, 1024, 1056)))
    real, calls, finished = weight_cache.pread_into, [], []
    lock = threading.Lock()

    def failing_then_slow(fd, part, offset):  # the first chunk's sectors are bad, direct or buffered
        with lock:
            calls.append(offset)
        if offset == calls[0]:
            raise OSError(5, "Input/output error")
        time.sleep(0.05)
        got = real(fd, part, offset)
        finished.append(offset)
        return got

    monkeypatch.setattr(weight_cache, "pread_into", failing_then_slow)
    monkeypatch.setattr(weight_cache, "CHUNK", 1 << 20)  # several reads a region
    with pytest.raises(weight_cache.CacheMiss, match=r"layer_0000.safetensors: unreadable \(.*Input/output error"):
        weight_cache.load(path, key("int4", (8, 1024, 1056)))
    assert len(set(calls)) > 2 and len(finished) == len([c for c in calls if c != calls[0]])


def test_a_write_that_fails_leaves_no_file(tmp_path, monkeypatch):
    path = tmp_path / "layer_0000.safetensors"

    def dies_half_way(target, tensors, metadata, align):
        target.write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weight_cache, "save_tensors", dies_half_way)
    with pytest.raises(OSError, match="No space"):
        weight_cache.store(path, experts("int8"), key("int8"))
    assert list(tmp_path.iterdir()) == []


def test_the_checkpoint_reader_skips_cached_layers_and_reads_the_rest_exactly(tmp_path):
    pytest.importorskip("sglang")
    from kt_serve.harness.tiny_model import build_tiny_moe
    from kt_serve.sglang_plugin import checkpoint

    model = build_tiny_moe(tmp_path / "m", "qwen3_moe", num_layers=3)
    files = sorted(str(p) for p in model.glob("*.safetensors"))
    reference = {}
    for f in files:
        with safe_open(f, "pt") as handle:
            reference.update({k: handle.get_tensor(k) for k in handle.keys()})
    got = dict(checkpoint.checkpoint_tensors(files))
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)


    class LayerRead:  # a layer file whose header matched; its regions read fine, or prove corrupt only when read
        def __init__(self, layer_id, corrupt):
            self.layer_id, self.corrupt = layer_id, corrupt

        def read(self):
            if self.corrupt:
                raise weight_cache.CacheMiss(f"layer_{self.layer_id:04d}.safetensors: corrupt")
            return self.layer_id

    installed = []
    checkpoint.CACHE_READS.add(str(model), 1, LayerRead(1, False), installed.append)
    checkpoint.CACHE_READS.add(str(model), 2, LayerRead(2, True), installed.append)
    got = list(checkpoint.checkpoint_tensors(files))
    names = [name for name, _ in got]
    experts = {i: {k for k in reference if k.startswith(f"model.layers.{i}.mlp.experts.")} for i in range(3)}
    assert len(experts[1]) == 3 * 8 and len(names) == len(set(names))
    assert set(names) == reference.keys() - experts[1]  # layer 1 from the cache, layer 2's after all
    assert set(names[-len(experts[2]):]) == experts[2]  # ... once its file proved corrupt, at the end
    assert all(torch.equal(tensor, reference[name]) for name, tensor in got)
    assert installed == [1] and checkpoint.CACHE_READS.of(str(model)) == frozenset()


def test_a_layers_source_digest_changes_with_its_checkpoint_file(tmp_path):
    from kt_serve.harness.tiny_model import build_tiny_moe

    model = build_tiny_moe(tmp_path / "m", "qwen3_moe", num_layers=2)
    before = weight_cache.expert_sources(str(model))
    assert sorted(before) == [0, 1] and before[0] != before[1]
    weight_cache._sources.clear()
    shard = next(model.glob("*.safetensors"))
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # rewritten in place: a new mtime
    assert weight_cache.expert_sources(str(model)) != before


def test_a_server_reads_its_experts_from_the_cache_and_rebuilds_a_corrupt_layer(tmp_path):
    """Three starts of one model with int4 experts: the first packs and writes the cache, the second reads every
    layer from it (the checkpoint's experts not read) and answers with the same logprobs bit for bit, the third
    finds one file corrupted, packs that layer from the checkpoint again, says so, and answers the same."""
    pytest.importorskip("sglang")
    from kt_serve.harness.server import SGLangServer
    from kt_serve.harness.tiny_model import build_tiny_moe

    model = build_tiny_moe(tmp_path / "m", "qwen3_moe", num_layers=3)
    cache = tmp_path / "cache"
    flags = ["--kt-expert-dtype", "int4", "--kt-weight-cache", str(cache)]
    answers, logs = [], []
    for start in range(3):
        if start == 2:
            victim = next(cache.rglob("layer_0001.safetensors"))
            header, data_start = read_header(victim)
            _flip(victim, victim.stat().st_size - (data_start + header["0.gate"]["data_offsets"][0] + 5))
        with SGLangServer(model, flags) as server:
            answers.append([server.greedy(str(model), [5 + i, 17, 40 + 3 * i, 9], 6) for i in range(2)])
            logs.append(server.log_path.read_text())
    assert logs[0].count("int4 experts packed from a bf16 checkpoint") == 3, logs[0][-3000:]
    assert "packed-weight cache: 3 MoE layers written" in logs[0]
    assert logs[1].count("int4 experts read from the packed-weight cache") == 3, logs[1][-3000:]
    assert "packed from a bf16 checkpoint" not in logs[1]
    assert "MoE layer 1 packed from the checkpoint again: layer_0001.safetensors: corrupt (0.gate's bytes" in logs[2]
    assert logs[2].count("read from the packed-weight cache") == 2 and "packed-weight cache: 1 MoE layers written" in logs[2]
    assert answers[1] == answers[0] and answers[2] == answers[0]  # token ids and logprobs, exactly
    stored = json.loads(read_header(victim)[0]["__metadata__"]["key"])  # the rewritten file serves again
    weight_cache.load(victim, weight_cache.LayerKey(stored["source"], "int4", 128, (0, 1), tuple(stored["shape"])))


def test_the_reader_waits_while_two_layers_are_in_flight_and_one_packs(tmp_path, monkeypatch):
    """DeepSeek's loader packs on its worker threads while the reader runs on: the reader must not hand out a third
    MoE layer while two are in flight and a pack is running (their staging and the queue would grow layer by
    layer), and goes on once that pack is done."""
    pytest.importorskip("sglang")
    import threading
    import time

    from kt_serve.formats.checkpoint import expert_layer
    from kt_serve.harness.tiny_model import build_tiny_moe
    from kt_serve.sglang_plugin import checkpoint

    model = build_tiny_moe(tmp_path / "m", "qwen3_moe", num_layers=4)
    files = sorted(str(p) for p in model.glob("*.safetensors"))
    flight = checkpoint._LayersInFlight(limit=2)
    monkeypatch.setattr(checkpoint, "IN_FLIGHT", flight)
    seen = []
    pack = flight.packing(0)
    pack.__enter__()  # a worker packing layer 0
    reader = threading.Thread(target=lambda: seen.extend(name for name, _ in checkpoint.checkpoint_tensors(files)))
    reader.start()
    time.sleep(1.0)
    assert reader.is_alive() and {expert_layer(n) for n in seen} - {None} <= {0, 1}
    pack.__exit__(None, None, None)
    reader.join(30)
    assert not reader.is_alive() and {expert_layer(n) for n in seen} - {None} == {0, 1, 2, 3}
    # nothing packs layers 1-3 here: with no pack running the reader never waits (a loader that packs on the
    # reading thread would otherwise stop), so layer 3 joined 1 and 2
    assert flight.peak == 3


def test_a_cache_that_cannot_be_written_is_left_aside_and_deleted_models_are_pruned(tmp_path):
    from kt_serve.harness.tiny_model import build_tiny_moe

    model = build_tiny_moe(tmp_path / "m", "qwen3_moe", num_layers=2)
    fields = dict(weight_format="int4", group_size=128, shard=(0, 1), shape=(8, 128, 64))
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert weight_cache.layer_file(blocked / "cache", str(model), 0, fields) is None  # no crash, no cache
    root = tmp_path / "cache"
    path, key = weight_cache.layer_file(root, str(model), 1, fields)
    assert path.parent.parent.parent == root and key.shape == (8, 128, 64)
    gone = build_tiny_moe(tmp_path / "gone", "qwen3_moe", num_layers=2)
    weight_cache.layer_file(root, str(gone), 0, fields)
    assert len(list(root.glob("*/source.json"))) == 2
    import shutil

    shutil.rmtree(gone)
    weight_cache._model_dirs.clear()  # a new process
    weight_cache.layer_file(root, str(model), 0, fields)
    assert [json.loads(p.read_text())["model_path"] for p in root.glob("*/source.json")] == [str(model.resolve())]


def test_checkpoints_deleted_with_their_parents_are_pruned_unmounted_ones_kept(tmp_path):
    """A benchmark's checkpoint in a throwaway directory deleted whole (its parent gone too) is pruned; one on a
    drive that is unmounted (the nearest directory that is left is on another device) is kept."""
    from kt_serve.harness.tiny_model import build_tiny_moe

    fields = dict(weight_format="int4", group_size=128, shard=(0, 1), shape=(8, 128, 64))
    root = tmp_path / "cache"
    throwaway = build_tiny_moe(tmp_path / "run" / "models" / "m", "qwen3_moe", num_layers=2)
    mounted = build_tiny_moe(tmp_path / "drive" / "models" / "m", "qwen3_moe", num_layers=2)
    for model in (throwaway, mounted):
        weight_cache.layer_file(root, str(model), 0, fields)
    made = {json.loads(p.read_text())["model_path"]: p for p in root.glob("*/source.json")}
    assert set(made) == {str(throwaway.resolve()), str(mounted.resolve())}
    source = json.loads(made[str(mounted.resolve())].read_text())
    source["device"] += 1  # as recorded on the drive, not the filesystem its mount point is on
    made[str(mounted.resolve())].write_text(json.dumps(source))
    import shutil

    shutil.rmtree(tmp_path / "run")
    shutil.rmtree(tmp_path / "drive" / "models")  # what an unmounted drive's mount point looks like
    weight_cache._model_dirs.clear()  # a new process
    weight_cache.layer_file(root, str(build_tiny_moe(tmp_path / "other", "qwen3_moe", num_layers=2)), 0, fields)
    kept = {json.loads(p.read_text())["model_path"] for p in root.glob("*/source.json")}
    assert str(throwaway.resolve()) not in kept and str(mounted.resolve()) in kept


def test_a_checkpoint_with_a_dtype_the_reader_lacks_goes_to_sglangs_reader_saying_so(tmp_path, caplog):
    pytest.importorskip("sglang")
    import struct

    from kt_serve.sglang_plugin import checkpoint

    path = tmp_path / "odd.safetensors"
    header = json.dumps({"x": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 2]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00\x00")
    calls = []
    with caplog.at_level("WARNING"):
        out = checkpoint.replace_safetensors_iterator(lambda files, *a, **k: calls.append(files) or iter(()),
                                                      [str(path)])
    assert calls == [[str(path)]] and list(out) == []
    assert "holds F8_E5M2 tensors, which the kt_serve checkpoint reader does not read" in caplog.text
