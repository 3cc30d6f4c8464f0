"""Evals and benchmarks for kt_serve: adapter effect (eval_adapter), serving speed, shared report writers."""
