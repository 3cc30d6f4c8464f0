"""What an expert adapter costs to load and to keep: resident bytes, peak bytes while loading, load time and GB/s.

    python evals/bench_adapter_memory.py [--preset qwen3-30b-a3b|deepseek-v3] [--layers N --experts E --hidden H
                                         --intermediate I --rank r] [--adapters 3] [--base-format int4]
                                         [--share-layer] [--cold] [--out DIR]

Presets: ``qwen3-30b-a3b`` (default): its MoE layer shapes, 4 layers × 128 experts, H 2048, I 768, r 8.
``deepseek-v3``: the whole model's expert LoRA, 58 MoE layers (3..60) × 256 experts, H 7168, I 2048, r 8: 6.1 GiB.
The base experts are packed in ``--base-format`` (int4 keeps the run small; an adapter's bytes do not depend on
it). With ``--share-layer`` (the deepseek-v3 default: 58 layers of its base would not fit this machine) every
layer id maps to one kernel layer, so each layer's adapter overwrites the previous one in the same slot: the load
does all the reading and packing of the whole adapter, but holds one layer at the end.

Each adapter is a KT SFT output on disk (a random ``fused_expert_lora.safetensors`` + ``adapter_config.json``),
registered the way a server registers a composite adapter's expert half: ``formats.open_adapter_dir`` then
``ExpertPool.register`` (header checked against every layer, then one layer at a time read and packed into its
slot). The pool holds all but one adapter: the last registration evicts the least recently used one, whose slot
is rewritten in place, and a batch naming the evicted one loads it again (row "reload"). ``--cold`` drops each
file from the page cache first (posix_fadvise), so the read comes from disk. Printed per load, against the
adapter's size in the kernel, 6·E·r·(H+I) bytes a layer (six bf16 tensors: A [E, r, in], B [E, out, r]):

  resident  RSS after the load, minus RSS before it (freed heap given back with malloc_trim first)
  peak      the highest RSS sampled during the load (every 2 ms), minus RSS before it
  load s    wall time of the load; GB/s of the file read and packed
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from kt_serve.kernel.threads import share_cores_with_torch

share_cores_with_torch()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kt_serve.formats import FUSED_EXPERT_LORA_FILE, SafetensorsWriter, fused_key, open_adapter_dir  # noqa: E402
from kt_serve.formats.names import kt_shapes  # noqa: E402
from kt_serve.kernel.experts import MoEExperts  # noqa: E402
from kt_serve.kernel.threads import cpu_isa  # noqa: E402
from kt_serve.sglang_plugin.adapters.expert_pool import ExpertPool  # noqa: E402
from kt_serve.sglang_plugin.config import ExpertBudget  # noqa: E402

_libc = ctypes.CDLL("libc.so.6")
PRESETS = {
    "qwen3-30b-a3b": dict(layers=4, first_layer=0, experts=128, hidden=2048, intermediate=768, rank=8,
                          share_layer=False),
    "deepseek-v3": dict(layers=58, first_layer=3, experts=256, hidden=7168, intermediate=2048, rank=8,
                        share_layer=True),
}


def rss() -> int:
    """Resident bytes of this process, after handing freed heap back to the OS."""
    _libc.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * page)
            self._stop.wait(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def write_adapter(path: Path, layer_ids, shapes: dict, rank: int, seed: int) -> int:
    """A KT SFT output with random expert LoRA, written tensor by tensor; returns the fused file's bytes."""
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    layout = {fused_key(layer, name): (torch.bfloat16, shape) for layer in layer_ids for name, shape in shapes.items()}
    writer = SafetensorsWriter(path / FUSED_EXPERT_LORA_FILE, layout)
    for layer in layer_ids:
        for name, shape in shapes.items():
            writer.write(fused_key(layer, name), (torch.randn(*shape, generator=gen) * 0.01).bfloat16())
    writer.close()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["gate_proj", "up_proj",
              "down_proj"], "task_type": "CAUSAL_LM", "base_model_name_or_path": "bench"}
    (path / "adapter_config.json").write_text(json.dumps(config) + "\n")
    return (path / FUSED_EXPERT_LORA_FILE).stat().st_size


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def base_layer(E: int, H: int, I: int, seed: int, zero: bool):
    """A layer's bf16 base experts: random, or zeros from untouched calloc pages (no RSS until packed)."""
    shapes = ((E, I, H), (E, I, H), (E, H, I))
    if zero:
        return [torch.from_numpy(np.zeros(s, dtype=np.uint16)).view(torch.bfloat16) for s in shapes]
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) * 0.02).bfloat16() for s in shapes]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="qwen3-30b-a3b")
    for flag in ("layers", "experts", "hidden", "intermediate", "rank"):
        ap.add_argument(f"--{flag}", type=int, default=None, help="default: the preset's")
    ap.add_argument("--adapters", type=int, default=3, help="adapters registered one after another (the pool holds "
                                                             "one less, so the last evicts the first)")
    ap.add_argument("--base-format", default="int4", choices=("bf16", "fp8", "int8", "int4"))
    ap.add_argument("--share-layer", action=argparse.BooleanOptionalAction, default=None,
                    help="every layer id on one kernel layer (default: the preset's)")
    ap.add_argument("--cold", action="store_true", help="drop each adapter file from the page cache before its load")
    ap.add_argument("--out", default=None, help="where the adapters are written (default: a temp dir)")
    a = ap.parse_args(argv)
    preset = PRESETS[a.preset]
    for key, value in preset.items():
        if getattr(a, key, None) is None:
            setattr(a, key, value)
    E, H, I, r, L = a.experts, a.hidden, a.intermediate, a.rank, a.layers
    layer_ids = list(range(a.first_layer, a.first_layer + L))
    shapes = kt_shapes(E, H, I, r)
    expected = 6 * E * r * (H + I) * L
    if a.adapters < 2:
        ap.error("--adapters: at least 2 (the last one evicts the first)")

    pool = ExpertPool(ExpertBudget(slots=a.adapters - 1))
    pool.max_per_batch = 1
    t0 = time.perf_counter()
    shared = None
    for layer in layer_ids:
        if shared is None or not a.share_layer:
            base = base_layer(E, H, I, seed=layer, zero=a.share_layer)
            shared = MoEExperts(*base, max_slots=a.adapters - 1, max_tokens=64, weight_format=a.base_format)
            del base
        pool.layers[layer] = shared
    build_s = time.perf_counter() - t0
    out = Path(a.out or tempfile.mkdtemp(prefix="kt_adapter_mem_"))
    t0 = time.perf_counter()
    files = [write_adapter(out / f"adapter{i}", layer_ids, shapes, r, seed=100 + i) for i in range(a.adapters)]
    write_s = time.perf_counter() - t0
    gc.collect()

    print(f"preset {a.preset}: {L} layers x {E} experts, H {H}, I {I}, r {r}; base {a.base_format} "
          f"({'one kernel layer for every layer id' if a.share_layer else 'one kernel layer each'}, built in "
          f"{build_s:.0f} s); {cpu_isa()}; {os.cpu_count()} CPUs; torch {torch.__version__}; adapters written in "
          f"{write_s:.0f} s; page cache {'dropped before each load (cold)' if a.cold else 'warm'}")
    print(f"kernel bytes per adapter, 6*E*r*(H+I)*layers: {expected / 2**20:.1f} MiB; pool of {a.adapters - 1} "
          f"resident")
    print("| load | file MiB | resident MiB | resident / kernel bytes | peak MiB | load s | GB/s |")
    print("|---|---|---|---|---|---|---|")

    def measure(label: str, size: int, load) -> None:
        before = rss()
        peak = PeakRSS()
        start = time.perf_counter()
        load()
        seconds = time.perf_counter() - start
        top = peak.stop()
        gc.collect()
        resident = rss() - before
        print(f"| {label} | {size / 2**20:.1f} | {resident / 2**20:.1f} | {resident / expected:.2f} | "
              f"{(top - before) / 2**20:.1f} | {seconds:.3f} | {size / seconds / 1e9:.2f} |", flush=True)

    for i, size in enumerate(files):
        if a.cold:
            drop_from_page_cache(out / f"adapter{i}" / FUSED_EXPERT_LORA_FILE)
        evicts = i == a.adapters - 1
        measure(f"adapter{i}" + (" (evicts adapter0, its slot rewritten in place)" if evicts else ""), size,
                lambda: pool.register(f"adapter{i}", open_adapter_dir(out / f"adapter{i}")))
    if a.cold:
        drop_from_page_cache(out / "adapter0" / FUSED_EXPERT_LORA_FILE)
    measure("reload adapter0 for a batch (evicts adapter1)", files[0], lambda: pool.prepare({"adapter0"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
