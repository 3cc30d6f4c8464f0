"""Benchmarks and reports for kt_serve: kernel, serving and training speed (the adapter-effect scorer and the report
writers they share live in kt_serve.harness)."""
