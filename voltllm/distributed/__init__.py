"""Tensor parallelism (--tensor-parallel-size N): process groups, weight sharding arithmetic and the worker processes.

Rank 0 is the engine's own ModelRunner; ranks 1..N-1 are spawned worker processes (worker.py) that build the same
model shard and replay each step rank 0 sends them (executor.py), so the model's all-reduces line up. Which models
and features run under TP is decided once, in support.py. docs/architecture.md, "Tensor parallelism".
"""
