"""What tests, benchmarks and the quickstart run the product with, shipped in the wheel so an installed kt_serve
can run its own quickstart: tiny random checkpoints with an offline tokenizer (tiny_model.py), a brief base
pre-training (pretrain.py), a real SGLang server that is always cleaned up (server.py), and the adapter-effect
scorer over the OpenAI API with its report writers (eval_adapter.py, report.py)."""
