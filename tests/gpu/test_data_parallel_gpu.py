"""An engine on the second GPU and a `-dp 2` server over two GPUs: an engine past cuda:0 makes its card current
(Triton launches, streams and graph captures use the current device), so its greedy answers equal cuda:0's with
decode CUDA graphs on, and each data-parallel engine's memory sits on its own card. Needs 2 CUDA devices
(benchmarks/run_h200.sh s141dp, kind nvidia-h200-x2); skipped otherwise."""
import asyncio
import os
import signal
import sys

import pytest
import torch

from tiny_models import make_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))  # the server tests' ServerProc
from server_helpers import ServerProc, descendants_of, free_port, wait_gone  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

PROMPTS = ["The quick brown fox jumps", "What is the capital of France?", "Hi", "0123456789 " * 30]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny-dp")), "qwen3", max_position_embeddings=2048)


def _greedy(llm, n=24):
    from voltllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, min_tokens=n))
    return [o.outputs[0].token_ids for o in outs]


def test_an_engine_on_the_second_gpu_matches_the_first(tiny):
    from voltllm import LLM

    first = LLM(tiny, device="cuda:0", dtype="float32", gpu_memory_utilization=0.3)
    want = _greedy(first)
    del first
    torch.cuda.set_device(0)  # (the engine below must move to its card itself)
    second = LLM(tiny, device="cuda:1", dtype="float32", gpu_memory_utilization=0.3)
    try:
        assert torch.cuda.current_device() == 1
        assert second.engine.runner.graphs is not None
        assert _greedy(second) == want
        assert second.engine.runner.graphs.replays > 0
    finally:
        del second
        torch.cuda.set_device(0)


def test_dp2_server_uses_both_gpus(tiny):
    import openai
    from voltllm import LLM, SamplingParams

    llm = LLM(tiny, device="cuda:0", dtype="float32", gpu_memory_utilization=0.3)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))]
    del llm
    torch.cuda.empty_cache()
    srv = ServerProc([tiny, "--device", "cuda", "-dp", "2", "--dtype", "float32", "--gpu-memory-utilization", "0.3",
                      "--served-model-name", "tiny", "--disable-log-stats"], free_port())
    try:
        srv.wait_healthy(600)
        pids = descendants_of(srv.proc.pid)
        used = [torch.cuda.mem_get_info(i) for i in range(2)]
        assert all(total - free > 1 << 30 for free, total in used), used  # each card holds an engine's KV cache

        async def together():
            c = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=300)
            outs = await asyncio.gather(*(c.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
                                          for p in PROMPTS * 2))
            return [o.choices[0].text for o in outs]

        assert asyncio.run(together()) == want * 2
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0, srv.log_text()[-3000:]
        assert not wait_gone(pids, 10)
    finally:
        srv.stop()
