"""llama.cpp as the CPU peer in the serving benchmark: build it, convert our checkpoints and adapters, serve them.

    python evals/llamacpp.py build [--llama-server PATH]      # find or build llama-server, print where it is

Benchmarks only: no test needs llama.cpp. ``LlamaCpp.locate()`` takes an explicit ``llama-server`` (flag), then one
on PATH, then one built earlier in the cache; else it builds one from the llama-cpp-python sdist on the package
index (its vendored llama.cpp, about 7 minutes on 2 cores) into ``~/.cache/kt_serve/llama.cpp-<version>``. The
converters (``convert_hf_to_gguf.py``, ``convert_lora_to_gguf.py``, ``gguf-py``) always come from that source tree,
downloaded when missing. Every failure is a ``LlamaCppUnavailable`` with one line saying why, so the benchmark can
skip the rows and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from kt_serve.harness.server import SGLangServer

VERSION = "0.3.36"  # llama-cpp-python release whose vendored llama.cpp we build (see shared notes)
CACHE = Path(os.environ.get("KT_SERVE_CACHE", Path.home() / ".cache" / "kt_serve")) / f"llama.cpp-{VERSION}"

# convert_hf_to_gguf.py identifies a tokenizer by hashing its output and refuses unknown ones; our home-made
# byte-level BPE gets the name of the Qwen2 pre-tokenizer (the benchmark sends token ids, so only the model matters).
# Qwen3.5 / Qwen3-Next models are converted without MTP layers (the converters expect them; our checkpoints have
# none): the model converter's --no-mtp, set on the classes both converters share.
_CONVERT = """
import runpy, sys
sys.path.insert(0, {src!r})
from conversion.base import ModelBase, TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
ModelBase.no_mtp = {no_mtp!r}
sys.argv = [{script!r}, *{args!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def _without_mtp(model_dir: Path) -> bool:
    architecture = (json.loads((model_dir / "config.json").read_text()).get("architectures") or [""])[0]
    return architecture.startswith(("Qwen3_5", "Qwen3Next"))


class LlamaCppUnavailable(RuntimeError):
    pass


def _run(cmd: list[str], what: str, log: Path, **kw) -> None:
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n".encode())
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if proc.returncode:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise LlamaCppUnavailable(f"{what} failed (exit {proc.returncode}; log {log}): {tail[0][:300]}")


class LlamaCpp:
    """A llama.cpp source tree (converters) and a llama-server binary."""

    def __init__(self, server: Path, src: Path):
        self.server, self.src = server, src

    @classmethod
    def locate(cls, explicit: str | None = None, cache: Path = CACHE) -> "LlamaCpp":
        cache.mkdir(parents=True, exist_ok=True)
        src = cls._source(cache)
        if explicit:
            if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
                raise LlamaCppUnavailable(f"--llama-server {explicit}: not an executable file")
            return cls(Path(explicit), src)
        for candidate in (shutil.which("llama-server"), cache / "build" / "bin" / "llama-server"):
            if candidate and Path(candidate).is_file():
                return cls(Path(candidate), src)
        return cls(cls._build(src, cache), src)

    @staticmethod
    def _source(cache: Path) -> Path:
        src = cache / "src"
        if (src / "convert_hf_to_gguf.py").is_file():
            return src
        log = cache / "download.log"
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            # --no-build-isolation: only the sdist is wanted; with isolation pip first builds cmake from source
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "--no-binary",
                  "llama-cpp-python", f"llama-cpp-python=={VERSION}", "-d", tmp, "-q"],
                 f"downloading the llama-cpp-python {VERSION} sdist", log)
            sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if not sdists:
                raise LlamaCppUnavailable(f"pip download left no llama-cpp-python sdist in {tmp}")
            with tarfile.open(sdists[0]) as tar:
                tar.extractall(tmp, filter="data")
            vendored = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
            staged = cache / "src.partial"
            shutil.rmtree(staged, ignore_errors=True)
            shutil.move(str(vendored), staged)
            staged.rename(src)  # whole or not at all
        return src

    @staticmethod
    def _build(src: Path, cache: Path) -> Path:
        build, log = cache / "build", cache / "build.log"
        print(f"building llama-server from llama-cpp-python {VERSION}'s llama.cpp (log {log}) ...", flush=True)
        t0 = time.monotonic()
        _run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
              "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
             "configuring llama.cpp", log)
        _run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", "llama-server"],
             "building llama-server", log)
        binary = build / "bin" / "llama-server"
        if not binary.is_file():
            raise LlamaCppUnavailable(f"the build left no {binary} (log {log})")
        print(f"built {binary} in {time.monotonic() - t0:.0f} s", flush=True)
        return binary

    def _python_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.src / "gguf-py"), env.get("PYTHONPATH", "")])
        return env

    def _converter(self, script: str, args: list[str], model_dir: Path) -> str:
        return _CONVERT.format(src=str(self.src), script=str(self.src / script), args=args,
                               no_mtp=_without_mtp(model_dir))

    def convert_model(self, model_dir: Path, out: Path) -> Path:
        """The checkpoint as a BF16 GGUF, by llama.cpp's own converter."""
        if not out.is_file():
            args = [str(model_dir), "--outfile", str(out) + ".partial", "--outtype", "bf16"]
            _run([sys.executable, "-c", self._converter("convert_hf_to_gguf.py", args, model_dir)],
                 f"convert_hf_to_gguf.py {model_dir}", out.with_suffix(".log"), env=self._python_env())
            Path(str(out) + ".partial").rename(out)
        return out

    def quantize(self, gguf: Path, kind: str, out: Path) -> Path:
        """The GGUF quantized to ``kind`` (Q8_0, Q4_0, ...) by llama.cpp's own llama-quantize (built beside
        llama-server when missing), with its default choices for the output and embedding tensors."""
        if not out.is_file():
            tool = self.server.parent / "llama-quantize"
            if not tool.is_file():
                build = self.server.parents[1]
                _run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", "llama-quantize"],
                     "building llama-quantize", build.parent / "build.log")
            _run([str(tool), str(gguf), str(out) + ".partial", kind, str(os.cpu_count() or 2)],
                 f"llama-quantize {gguf.name} {kind}", out.with_suffix(".log"))
            Path(str(out) + ".partial").rename(out)
        return out

    def convert_adapter(self, adapter_dir: Path, model_dir: Path, out: Path) -> Path:
        """A PEFT adapter (per-expert keys for expert LoRA) as a GGUF LoRA, by llama.cpp's own converter."""
        if not out.is_file():
            args = [str(adapter_dir), "--base", str(model_dir), "--outfile", str(out) + ".partial", "--outtype", "bf16"]
            _run([sys.executable, "-c", self._converter("convert_lora_to_gguf.py", args, model_dir)],
                 f"convert_lora_to_gguf.py {adapter_dir}", out.with_suffix(".log"), env=self._python_env())
            Path(str(out) + ".partial").rename(out)
        return out


class LlamaServer(SGLangServer):
    """``llama-server`` with the SGLangServer lifecycle and ``post``: own process group, ready when a 1-token
    completion answers. Adapters are loaded at scale 0 so that a request without a ``lora`` field is the base
    model; a request selects them with ``"lora": [{"id": i, "scale": 1.0}]``."""

    def __init__(self, llama: LlamaCpp, gguf: Path, adapters=(), *, threads: int, parallel: int, ctx_per_slot: int,
                 log_path=None, startup_timeout: float = 300.0):
        super().__init__(gguf, log_path=log_path, startup_timeout=startup_timeout)
        self._base_cmd = [str(llama.server), "-m", str(gguf), "--host", "127.0.0.1", "-t", str(threads),
                          "-tb", str(threads), "-np", str(parallel), "-c", str(ctx_per_slot * parallel),
                          "--no-webui", *(["--lora-scaled", ",".join(f"{a}:0" for a in adapters)] if adapters else [])]
        self._use_port(self.port)

    name = "llama-server"
    start_error = LlamaCppUnavailable

    def _probe(self) -> str | None:
        status, body = self.post("/completion", {"prompt": [1, 2, 3], "n_predict": 1}, timeout=30)
        return None if status == 200 else f"HTTP {status}: {str(body)[:200]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["build"])
    ap.add_argument("--llama-server", default=None)
    a = ap.parse_args(argv)
    try:
        llama = LlamaCpp.locate(a.llama_server)
    except LlamaCppUnavailable as e:
        sys.exit(f"llama.cpp unavailable: {e}")
    print(json.dumps({"llama_server": str(llama.server), "source": str(llama.src)}))


if __name__ == "__main__":
    main()
