"""What an expert adapter costs to load and to keep: resident bytes, peak bytes while loading, load time.

    python evals/bench_adapter_memory.py [--layers 4 --experts 128 --hidden 2048 --intermediate 768 --rank 8]
                                         [--adapters 3] [--base-format int4] [--out DIR]

Defaults are Qwen3-30B-A3B's MoE layer shapes with 4 layers. The base experts are packed in ``--base-format`` (int4
keeps the run small; an adapter's bytes do not depend on it). Each adapter is a KT SFT output on disk (a random
``fused_expert_lora.safetensors`` + ``adapter_config.json``), loaded the way a server loads a composite adapter's
expert half: ``formats.open_adapter_dir`` then ``ExpertSlots.load`` into a free kernel slot of every layer (which
reads the file one layer at a time). Printed per adapter, against its size in the kernel, 6·E·r·(H+I) bytes a layer (six
bf16 tensors: A [E, r, in], B [E, out, r]):

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

import torch  # noqa: E402

from kt_serve.formats import FUSED_EXPERT_LORA_FILE, SafetensorsWriter, fused_key, open_adapter_dir  # noqa: E402
from kt_serve.formats.names import kt_shapes  # noqa: E402
from kt_serve.kernel.experts import MoEExperts  # noqa: E402
from kt_serve.kernel.threads import cpu_isa  # noqa: E402
from kt_serve.sglang_plugin.adapters.registry import ExpertSlots  # noqa: E402

_libc = ctypes.CDLL("libc.so.6")


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


def write_adapter(path: Path, layers: int, shapes: dict, rank: int, seed: int) -> int:
    """A KT SFT output with random expert LoRA; returns the fused file's bytes."""
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    layout = {fused_key(layer, name): (torch.bfloat16, shape) for layer in range(layers) for name, shape in shapes.items()}
    writer = SafetensorsWriter(path / FUSED_EXPERT_LORA_FILE, layout)
    for layer in range(layers):
        for name, shape in shapes.items():
            writer.write(fused_key(layer, name), (torch.randn(*shape, generator=gen) * 0.01).bfloat16())
    writer.close()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["gate_proj", "up_proj",
              "down_proj"], "task_type": "CAUSAL_LM", "base_model_name_or_path": "bench"}
    (path / "adapter_config.json").write_text(json.dumps(config) + "\n")
    return (path / FUSED_EXPERT_LORA_FILE).stat().st_size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=3, help="adapters loaded one after another, each in its slot")
    ap.add_argument("--base-format", default="int4", choices=("bf16", "fp8", "int8", "int4"))
    ap.add_argument("--out", default=None, help="where the adapters are written (default: a temp dir)")
    a = ap.parse_args(argv)
    E, H, I, r, L = a.experts, a.hidden, a.intermediate, a.rank, a.layers
    shapes = kt_shapes(E, H, I, r)
    expected = 6 * E * r * (H + I) * L

    slots = ExpertSlots(max_slots=a.adapters)
    for layer in range(L):
        g = torch.Generator().manual_seed(layer)
        base = [(torch.randn(*s, generator=g) * 0.02).bfloat16() for s in ((E, I, H), (E, I, H), (E, H, I))]
        slots.layers[layer] = MoEExperts(*base, max_slots=a.adapters, max_tokens=64, weight_format=a.base_format)
        del base
    out = Path(a.out or tempfile.mkdtemp(prefix="kt_adapter_mem_"))
    files = [write_adapter(out / f"adapter{i}", L, shapes, r, seed=100 + i) for i in range(a.adapters)]
    gc.collect()

    print(f"{L} layers x {E} experts, H {H}, I {I}, r {r}; base {a.base_format}; {cpu_isa()}; "
          f"{os.cpu_count()} CPUs; torch {torch.__version__}")
    print(f"kernel bytes per adapter, 6*E*r*(H+I)*layers: {expected / 2**20:.1f} MiB")
    print("| adapter | file MiB | resident MiB | resident / kernel bytes | peak MiB | load s | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for i, size in enumerate(files):
        before = rss()
        peak = PeakRSS()
        start = time.perf_counter()
        adapter = open_adapter_dir(out / f"adapter{i}")
        slots.load(f"adapter{i}", adapter)
        del adapter
        seconds = time.perf_counter() - start
        top = peak.stop()
        gc.collect()
        resident = rss() - before
        print(f"| {i} | {size / 2**20:.1f} | {resident / 2**20:.1f} | {resident / expected:.2f} | "
              f"{(top - before) / 2**20:.1f} | {seconds:.3f} | {size / seconds / 1e9:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
