"""Shared by the bench tests: `voltllm bench` end to end on a tiny random Qwen3 on the CPU, and the body of a mock
server's SSE stream."""
from __future__ import annotations

import json


def run_tiny_bench(tmp_path, name: str, *flags: str) -> dict:
    """`voltllm bench` in process on a 2-layer random Qwen3 (written once under tmp_path), 1 cold + 1 warm run, no
    limit measurement; returns the result file."""
    from transformers import Qwen3Config

    from voltllm.bench.cli import main

    model_dir = tmp_path / "tiny"
    if not model_dir.exists():
        Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=256).save_pretrained(model_dir)
    out = tmp_path / "results"
    assert main(["--random-weights", str(model_dir), "--device", "cpu", "--output-dir", str(out), "--name", name,
                 "--commit", "abc123", "--no-limits", "--num-warm", "1", *flags]) == 0
    with open(out / f"{name}.json") as f:
        return json.load(f)


def sse_body(objs: list) -> bytes:
    """Server-sent events: each object as a `data:` line (bytes as they are, e.g. b"[DONE]")."""
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)
