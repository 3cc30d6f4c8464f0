"""Start a real ``python -m sglang.launch_server`` for tests, evals and the quickstart, and always clean it up.

    with SGLangServer("/tmp/tiny", extra_args=["--kt-expert-lora-path", "/tmp/ad"]) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")

The server runs in its own process group, so exit, Ctrl-C or a failed start kill the whole tree (launcher,
schedulers, detokenizer). Readiness means a real 1-token ``/generate`` succeeded: ``/health`` can answer while the
scheduler is already dying. The log goes to a file whose tail is shown when start-up fails.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


# Below Linux's ephemeral range (32768-60999), so a port the kernel hands out for bind(0) or connect() (SGLang's
# ZMQ sockets, another server's clients) never takes the HTTP port between our check and SGLang's bind; and below
# 22000-29999, where SGLang picks its NCCL/TCPStore port (get_free_port_below_ephemeral) to bind later.
_PORT_RANGE = (10000, 22000)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free TCP port outside the ephemeral range (chosen at random so concurrent test runs rarely meet)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*_PORT_RANGE)
        if _port_is_free(port):
            return port
    raise RuntimeError(f"no free TCP port in {_PORT_RANGE[0]}-{_PORT_RANGE[1]}")


def cpu_env() -> dict[str, str]:
    """Environment for SGLang's CPU engine (harmless where the CPU shims already set it)."""
    env = dict(os.environ)
    env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


class ServerStartError(RuntimeError):
    pass


class _PortTaken(Exception):
    """SGLang could not bind its HTTP port (someone took it between free_port() and the bind)."""


_BIND_FAILED = "error while attempting to bind"
_BOUND = "Uvicorn running on"


class SGLangServer:
    """Context manager around one SGLang server process tree.

    model_path: checkpoint dir; extra_args: further launch_server flags; device: "cpu" sets the CPU engine env;
    max_total_tokens: KV-cache size (keep it small on CPU, else SGLang reserves most of the RAM; None: SGLang's
    own sizing); env: variables
    for the server on top of this process's (None removes one).
    """

    def __init__(self, model_path, extra_args=(), *, device: str = "cpu", port: int | None = None,
                 max_total_tokens: int | None = 2048, startup_timeout: float = 300.0, log_path=None,
                 env: dict[str, str | None] | None = None, python: str = sys.executable, cwd=None):
        self.model_path = str(model_path)
        self._port_given = port is not None
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="sglang_", suffix=".log")[1])
        self._base_cmd = [python, "-m", "sglang.launch_server", "--model-path", self.model_path,
                          "--host", "127.0.0.1", "--device", device,
                          *(["--max-total-tokens", str(max_total_tokens)] if max_total_tokens else []),
                          *map(str, extra_args)]
        self._use_port(port or free_port())
        self.env = cpu_env() if device == "cpu" else dict(os.environ)
        for key, value in (env or {}).items():  # None unsets a variable
            if value is None:
                self.env.pop(key, None)
            else:
                self.env[key] = value
        self.cwd = cwd  # the server's working directory (None: ours); `python -m` puts it first on sys.path
        self.proc: subprocess.Popen | None = None

    def _use_port(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.cmd = [*self._base_cmd, "--port", str(port)]

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self, attempts: int = 3) -> "SGLangServer":
        """Launch and wait until a generate request answers; a port taken meanwhile by another process is
        retried on a fresh one (unless the caller chose the port)."""
        for attempt in range(attempts):
            log = open(self.log_path, "wb")
            try:
                self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                             cwd=self.cwd, start_new_session=True)
            finally:
                log.close()
            try:
                self._wait_ready()
                return self
            except _PortTaken:
                self.stop()
                if self._port_given or attempt == attempts - 1:
                    raise ServerStartError(f"port {self.port} is taken by another process; log {self.log_path}:\n"
                                           f"{self.log_tail()}") from None
                self._use_port(free_port())
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        if self.proc is None:
            return
        kill_process_group(self.proc)  # start_new_session: the launcher leads its own process group
        self.proc = None

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers ---------------------------------------------------------------------------------------------
    def log_tail(self, n_lines: int = 150) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n_lines:])

    def post(self, path: str, payload: dict, timeout: float = 120.0) -> tuple[int, dict]:
        """POST JSON; returns (HTTP status, decoded body) also for 4xx/5xx answers."""
        req = urllib.request.Request(self.base_url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return e.code, json.loads(body or b"{}")
            except json.JSONDecodeError:
                return e.code, {"error": body.decode(errors="replace")}

    def greedy(self, model: str, prompt: list[int], max_tokens: int, *, ignore_eos: bool = False,
               timeout: float = 120.0) -> tuple[list[int], list[float]]:
        """A greedy completion through the official openai client: (token ids, per-token logprobs)."""
        import openai

        client = openai.OpenAI(base_url=self.base_url + "/v1", api_key="none", timeout=timeout, max_retries=0)
        extra = {"return_token_ids": True, **({"ignore_eos": True} if ignore_eos else {})}
        r = client.completions.create(model=str(model), prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      logprobs=1, extra_body=extra)
        choice = r.choices[0]
        return list(choice.token_ids), list(choice.logprobs.token_logprobs)

    def get(self, path: str, timeout: float = 30.0) -> dict:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")

    # -- readiness: one look at a time (_probe), so a subclass for another server only says how it looks --------
    name = "SGLang"
    start_error = ServerStartError

    def _probe(self) -> str | None:
        """None once a real 1-token /generate answers, else what was seen instead."""
        log = self.log_tail(400)
        if _BIND_FAILED in log:
            raise _PortTaken()
        if _BOUND not in log:  # probe only our own uvicorn: a squatter on the port could hang or answer
            return "HTTP port not bound yet"
        probe = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        status, body = self.post("/generate", probe, timeout=30)
        return None if status == 200 and body.get("meta_info") else f"HTTP {status}: {str(body)[:200]}"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.start_error(f"{self.name} exited with code {self.proc.returncode} during start-up; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
            try:
                last = self._probe()
                if last is None:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                last = repr(e)
            time.sleep(1.0)
        raise self.start_error(f"{self.name} not ready after {self.startup_timeout:.0f}s (last probe: {last}); "
                               f"log {self.log_path}:\n{self.log_tail()}")


def kill_process_group(proc: subprocess.Popen, term_wait: float = 3.0, kill_wait: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, the whole process group that ``proc`` leads (``start_new_session=True``)."""
    pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, kill_wait)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.1)
        if not _group_alive(pgid):
            break
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds for zombies; reap what is ours and treat a group of zombies as gone.
    try:
        out = subprocess.run(["ps", "-o", "stat=", "--sid", str(pgid)], capture_output=True, text=True).stdout
    except OSError:
        return True
    return any(s and not s.startswith("Z") for s in out.split())
