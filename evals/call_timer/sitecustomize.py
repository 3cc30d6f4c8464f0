"""Put on a server's PYTHONPATH by ``evals/profile_decode.py --call-times``: when KT_SERVE_CALL_TIMES is set, every
process of the server times the kernel's calls (routed experts, packed dense linears) by kind and shape, and the
ones that made any write their running totals to ``$KT_SERVE_CALL_TIMES.<pid>.json`` twice a second. A wall clock
around each call, so the shares add up where py-spy's sampling leaves part of a call to its Python callers."""

import os

if os.environ.get("KT_SERVE_CALL_TIMES"):
    import json
    import threading
    import time

    def _install(prefix: str) -> None:
        import kt_serve.dense as dense
        import kt_serve.kernel as kernel

        totals: dict[str, list] = {}

        def timed(kind, shape_of, fn):
            def wrapper(self, x, *args, **kwargs):
                start = time.perf_counter()
                out = fn(self, x, *args, **kwargs)
                entry = totals.setdefault(f"{kind} {shape_of(self, x)}", [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - start
                return out
            return wrapper

        rows = lambda x: int(x.numel() // x.shape[-1])  # noqa: E731
        dense.PackedLinear.forward = dense.PackedLinear.__call__ = timed(
            "dense", lambda m, x: f"{m.in_features}->{m.out_features} x{rows(x)}", dense.PackedLinear.forward)
        for name in ("forward_routed", "forward_sft"):
            setattr(kernel.MoEExperts, name, timed(
                "experts", lambda m, x: f"x{rows(x)}", getattr(kernel.MoEExperts, name)))

        def write():
            path = f"{prefix}.{os.getpid()}.json"
            while True:
                time.sleep(0.5)
                if totals:
                    with open(path + ".tmp", "w") as f:
                        json.dump({"time": time.time(), "calls": totals}, f)
                    os.replace(path + ".tmp", path)

        threading.Thread(target=write, daemon=True).start()

    _install(os.environ["KT_SERVE_CALL_TIMES"])
