"""SGLang plugin: routed experts on kt_serve's CPU MoE-LoRA kernel, expert LoRA per request.

Registered through the ``sglang.srt.plugins`` entry point (pyproject.toml), so stock sglang==0.5.23 calls
``register()`` in the launcher and again in every scheduler process (spawn re-imports everything). This package
is the only code in kt_serve that touches SGLang internals; ``hooks.py`` lists every patched target.
"""

_registered = False


def register() -> None:
    """Entry point: register this process's hooks (idempotent; SGLang applies them right after)."""
    global _registered
    if _registered:
        return
    _registered = True
    from .hooks import register_hooks

    register_hooks()
