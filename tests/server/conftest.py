"""Fixtures for the server tests: a real `voltllm serve` subprocess on 127.0.0.1, talked to over HTTP."""
from __future__ import annotations

import pytest

from lora_adapters import make_adapter
from server_helpers import API_KEY, EMBED_MAX_LEN, EMBED_NAME, MODEL_NAMES, ServerProc, free_port, wait_gone
from tiny_models import make_model


@pytest.fixture(scope="session")
def model_path(smollm2_gguf: str) -> str:
    return smollm2_gguf


@pytest.fixture(scope="session")
def server(model_path: str):
    """The shared server: SmolLM2 GGUF on the CPU, API key on, two served names, small KV cache."""
    port = free_port()
    srv = ServerProc([model_path, "--device", "cpu", "--max-model-len", "2048", "--num-gpu-blocks-override", "400",
                      "--max-num-seqs", "32", "--api-key", API_KEY, "--served-model-name", *MODEL_NAMES,
                      "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"], port)
    try:
        srv.wait_healthy(300)
        yield srv
    finally:
        srv.stop()
        leftover = wait_gone(srv.descendants, 5)
        assert not leftover, f"orphan processes left by voltllm serve: {leftover}"


@pytest.fixture(scope="session")
def client(server: ServerProc):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def aclient(server: ServerProc):
    import openai

    return openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """A tiny random llama on the CPU, served as "tiny": quick to start; shared by the structured-output and
    tool_choice tests. One torch thread (OMP_NUM_THREADS, read by torch in the server's processes), as the
    `one_torch_thread` fixture does in process: a tiny model's steps on a busy 2-core machine otherwise take 5 to
    40 times as long, and vary as much."""
    path = make_model(str(tmp_path_factory.mktemp("tiny")), "llama")
    # a LoRA adapter served as "tiny-lora" (tests/server/test_lora_server.py); the others' requests run without one
    lora = make_adapter(str(tmp_path_factory.mktemp("tiny-lora")), path, rank=8, alpha=16)
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "tiny",
                      "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"tiny-lora={lora}",
                      "--disable-log-stats", "--disable-uvicorn-access-log"], free_port(), env={"OMP_NUM_THREADS": "1"})
    srv.model_path, srv.lora_path = path, lora  # (the beam-search and LoRA tests compare with transformers)
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def embed_path(tmp_path_factory) -> str:
    return make_model(str(tmp_path_factory.mktemp("tiny_embed")), "qwen3", max_position_embeddings=256)


@pytest.fixture(scope="session")
def embed_server(embed_path):
    """The tiny qwen3 as an embedding model (vLLM's --task embed spelling, to cover it), matryoshka at 16 / 32, served
    as EMBED_NAME; shared by the embeddings and the embedding-score tests. One torch thread, as the other tiny
    servers."""
    srv = ServerProc([embed_path, "--device", "cpu", "--task", "embed", "--block-size", "4",
                      "--max-model-len", str(EMBED_MAX_LEN), "--served-model-name", EMBED_NAME, "--disable-log-stats",
                      "--disable-uvicorn-access-log", "--hf-overrides", '{"matryoshka_dimensions": [16, 32]}'],
                     free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()
