"""`voltllm bench`: DESIGN.md's benchmark metrics, in-process or against a server, with hardware limits.

Modules: shapes (named random-weight shapes), metrics (definitions on timestamps), limits (measured copy
bandwidth / matmul rate and the model's roofline), inprocess (scenarios, protocol, EngineCore runner),
client (streaming /v1/completions runner), hf_baseline (transformers generate), cli (the command).
"""
