"""Put on a server's PYTHONPATH by ``evals/profile_decode.py --call-times`` / ``--timers``: when KT_SERVE_CALL_TIMES
is set, every process of the server times the kernel's calls (routed experts, packed dense linears, decode
attention, RMSNorm, rotary, segmented LoRA, a whole decoder stack's step) by kind and shape, and the ones that made
any write their running totals to ``$KT_SERVE_CALL_TIMES.<pid>.json`` twice a second. A wall clock around each call, so the shares add up where
py-spy's sampling leaves part of a call to its Python callers.

With KT_SERVE_MODULE_TIMES=1 as well, torch's global module hooks (a public torch API, so every model family is
covered the same way) also time every ``nn.Module`` call by class: its exclusive time (its own Python and torch
ops, less the modules and kernel calls inside it), and per class of an outermost module (the model, the sampler)
its calls and inclusive time, which count the steps; and per class of an outermost module the last steps' intervals
(start to next start) with the kernel time inside each, whose medians give a step's fixed cost free of the gaps
between requests. The hooks cost a few µs a module call: the step they measure
is that much slower than an untimed one."""

import os

if os.environ.get("KT_SERVE_CALL_TIMES"):
    import collections
    import json
    import threading
    import time

    def _install(prefix: str, modules: bool) -> None:
        import torch

        from kt_serve.kernel import attention, decode_stack, experts, linear, lora_segments, norm, rotary

        calls: dict[str, list] = {}  # kernel call -> [count, seconds]
        exclusive: dict[str, list] = {}  # module class -> [count, seconds less its children]
        outermost: dict[str, list] = {}  # module class called at depth 0 -> [count, inclusive seconds]
        intervals: dict[str, collections.deque] = {}  # that class -> [(start to next start, kernel seconds in it)]
        last_start: dict[str, tuple] = {}  # that class -> (its last start, kernel seconds until then)
        kernel_seconds = [0.0]  # every timed kernel call, summed
        local = threading.local()  # per thread: a stack of [start, seconds spent in children]

        def stack():
            s = getattr(local, "stack", None)
            if s is None:
                s = local.stack = []
            return s

        def leave(totals, key):
            """Pop the innermost frame; its exclusive time goes to totals[key], its inclusive time to the parent."""
            s = stack()
            start, children = s.pop()
            spent = time.perf_counter() - start
            entry = totals.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += spent - children
            if s:
                s[-1][1] += spent
            return spent

        def timed(kind, shape_of, fn):
            def wrapper(*args, **kwargs):
                stack().append([time.perf_counter(), 0.0])
                try:
                    return fn(*args, **kwargs)
                finally:
                    try:
                        shape = shape_of(*args)
                    except (IndexError, TypeError, AttributeError):  # called with keywords: no shape to name
                        shape = "x?"
                    kernel_seconds[0] += leave(calls, f"{kind} {shape}")
            return wrapper

        rows = lambda x: int(x.numel() // x.shape[-1]) if isinstance(x, torch.Tensor) and x.dim() else 0  # noqa: E731
        linear.PackedLinear.forward = linear.PackedLinear.__call__ = timed(
            "dense", lambda m, x, *a: f"{m.in_features}->{m.out_features} x{rows(x)}", linear.PackedLinear.forward)
        for name in ("forward_routed", "forward_sft"):
            setattr(experts.MoEExperts, name, timed("experts", lambda m, x, *a: f"x{rows(x)}",
                                                   getattr(experts.MoEExperts, name)))
        decode_stack.DecodeStack.forward = timed("decode stack (all layers)", lambda m, x, *a: f"x{rows(x)}",
                                                 decode_stack.DecodeStack.forward)
        # module-level functions the plugin imports at call time (or when it builds its attention backend, after
        # this ran), so replacing the module attribute reaches every caller
        by_rows = lambda x, *a: f"x{rows(x)}"  # noqa: E731
        for module, name, kind, shape_of in (
                (attention, "run_decode_attention", "decode attention", lambda q, *a: f"x{q.shape[0]}"),
                (norm, "rms_norm", "rms_norm", by_rows),
                (rotary, "qk_norm_rope", "qk_norm_rope", by_rows),
                (rotary, "rotary_embedding", "rotary", lambda positions, *a: f"x{positions.numel()}"),
                (lora_segments, "lora_shrink", "lora_shrink", by_rows),
                (lora_segments, "lora_expand", "lora_expand", by_rows)):
            setattr(module, name, timed(kind, shape_of, getattr(module, name)))

        if modules:
            def pre_hook(module, args):
                now = time.perf_counter()
                if not stack():
                    key = type(module).__name__
                    if key in last_start:
                        start, kernel = last_start[key]
                        intervals.setdefault(key, collections.deque(maxlen=1000)).append(
                            (now - start, kernel_seconds[0] - kernel))
                    last_start[key] = (now, kernel_seconds[0])
                stack().append([now, 0.0])

            def post_hook(module, args, output):
                if not stack():
                    return  # entered before the hooks were installed
                key = type(module).__name__
                spent = leave(exclusive, key)
                if not stack():
                    entry = outermost.setdefault(key, [0, 0.0])
                    entry[0] += 1
                    entry[1] += spent

            torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
            torch.nn.modules.module.register_module_forward_hook(post_hook, always_call=True)

        def write():
            path = f"{prefix}.{os.getpid()}.json"
            while True:
                time.sleep(0.5)
                if calls or outermost:
                    with open(path + ".tmp", "w") as f:
                        json.dump({"time": time.time(), "calls": calls, "modules": exclusive, "outermost": outermost,
                                   "intervals": {k: list(v) for k, v in intervals.items()}}, f)
                    os.replace(path + ".tmp", path)

        threading.Thread(target=write, daemon=True).start()

    _install(os.environ["KT_SERVE_CALL_TIMES"], os.environ.get("KT_SERVE_MODULE_TIMES") == "1")
