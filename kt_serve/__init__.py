"""kt_serve: serve and train MoE LoRA adapters with routed experts on a CPU kernel."""

__version__ = "0.1.0"
