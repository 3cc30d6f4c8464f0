"""A small OpenAI-compatible HTTP server with canned outputs, for testing client-side harness logic.

Not a model: each model name maps to a function prompt -> text. model="<served>" is the base and
model="<served>:<adapter>" an adapter, as in SGLang. Errors mimic SGLang's: an unknown adapter gets 400 with
SGLang's top-level {"object": "error", "message": ...} body; an unknown base name gets 404. Transient failures
can be injected (fail_next) and every generation request is logged, with the peak number in flight.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Output = Callable[[str], str]


class FakeOpenAIServer:
    def __init__(self, served_name: str, base: Output, adapters: dict[str, Output], *, delay: float = 0.0):
        self.served_name = served_name
        self.outputs = {served_name: base, **{f"{served_name}:{k}": v for k, v in adapters.items()}}
        self.adapters = list(adapters)
        self.delay = delay  # seconds each generation request is held, to make concurrency observable
        self.requests: list[dict] = []  # {"path", "model", "prompt", "max_tokens", "temperature", "status"}
        self.max_in_flight = 0
        self._in_flight = 0
        self._failures: list[int] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    def fail_next(self, count: int, status: int = 503) -> None:
        """The next `count` generation requests answer `status` instead of generating."""
        with self._lock:
            self._failures += [status] * count

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeOpenAIServer":
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = False  # server_close() then waits for handlers still sleeping in `delay`
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # -- request handling (called from the HTTP threads) --

    def models(self) -> tuple[int, dict]:
        cards = [{"id": self.served_name, "object": "model", "created": 0, "owned_by": "fake"}]
        cards += [{"id": a, "object": "model", "created": 0, "owned_by": "fake", "parent": self.served_name}
                  for a in self.adapters]
        return 200, {"object": "list", "data": cards}

    def generate(self, path: str, body: dict) -> tuple[int, dict]:
        model = body.get("model", "")
        chat = path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body.get("prompt", "")
        entry = {"path": path, "model": model, "prompt": prompt, "max_tokens": body.get("max_tokens"),
                 "temperature": body.get("temperature")}
        with self._lock:
            self.requests.append(entry)
            status = self._failures.pop(0) if self._failures else None
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            time.sleep(self.delay)
            if status is None:
                status, reply = self._reply(model, prompt, chat, body.get("max_tokens"))
            else:
                reply = _error(status, "injected transient failure")
            entry["status"] = status
            return status, reply
        finally:
            with self._lock:
                self._in_flight -= 1

    def _reply(self, model: str, prompt: str, chat: bool, max_tokens: int | None) -> tuple[int, dict]:
        if model not in self.outputs:
            base, _, adapter = model.partition(":")
            if adapter and base == self.served_name:  # SGLang: a ValueError in the tokenizer manager -> 400
                return 400, _error(400, f"Got LoRA adapter that has never been loaded: {adapter}\n"
                                        f"All loaded adapters: {self.adapters}.")
            return 404, _error(404, f"The model `{model}` does not exist.")
        words = self.outputs[model](prompt).split(" ")
        text = " ".join(words[:max_tokens] if max_tokens else words)  # one "token" per space-separated word
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(text.split()),
                 "total_tokens": len(prompt.split()) + len(text.split())}
        common = {"id": "fake-1", "created": 0, "model": model, "usage": usage}
        if chat:
            return 200, {**common, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
        return 200, {**common, "object": "text_completion", "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}]}


def _error(status: int, message: str) -> dict:
    return {"object": "error", "message": message, "type": "BadRequest" if status < 500 else "ServiceUnavailable",
            "param": None, "code": status}


def _handler(server: FakeOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._send(*server.models())
            else:
                self._send(404, _error(404, f"no route {self.path}"))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path in ("/v1/completions", "/v1/chat/completions"):
                self._send(*server.generate(self.path, body))
            else:
                self._send(404, _error(404, f"no route {self.path}"))

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client timed out and hung up
                pass

        def log_message(self, *args):  # keep pytest output clean
            pass

    return Handler
