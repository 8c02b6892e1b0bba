"""`voltllm serve MODEL --max-model-len auto --kv-cache-memory-bytes N`: the API process takes the length the engine
fitted to its KV cache (reported at start, in /v1/models and in its length checks)."""
from __future__ import annotations

import httpx

from server_helpers import ServerProc, free_port, wait_gone
from tiny_models import make_model

# the tiny llama: 3 layers x K and V x 2 KV heads x 16 dims x fp32 x 4-token blocks
PER_BLOCK = 3 * 2 * 2 * 16 * 4 * 4


def test_the_api_uses_the_fitted_length(tmp_path):
    path = make_model(str(tmp_path / "tiny"), "llama")  # 1,024 positions
    srv = ServerProc([path, "--device", "cpu", "--dtype", "float32", "--block-size", "4", "--max-model-len", "auto",
                      "--kv-cache-memory-bytes", str(50 * PER_BLOCK), "--served-model-name", "tiny",
                      "--disable-log-stats", "--disable-uvicorn-access-log"], free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        models = httpx.get(srv.base + "/v1/models", timeout=30).json()["data"]
        assert models[0]["max_model_len"] == 200  # 50 blocks of 4 tokens
        assert "max_model_len 200" in srv.log_text()
        ok = httpx.post(srv.base + "/v1/completions", json={"model": "tiny", "prompt": [5] * 150, "max_tokens": 2,
                                                              "ignore_eos": True}, timeout=60)
        assert ok.status_code == 200, ok.text
        long = httpx.post(srv.base + "/v1/completions", json={"model": "tiny", "prompt": [5] * 190, "max_tokens": 20},
                          timeout=60)
        assert long.status_code == 400 and "200" in long.json()["error"]["message"]
    finally:
        srv.stop()
        assert not wait_gone(srv.descendants, 5)
