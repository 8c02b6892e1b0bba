"""Tensor parallelism on the CPU (gloo): tiny fp32 models with -tp 2 against the same models with -tp 1, through
the offline LLM API (rank 0 in this process, rank 1 a spawned worker), and the workers' life cycle."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from parallel_checks import ENGINE, PROMPTS, assert_logits_match
from tiny_models import make_model
from voltllm import LLM, SamplingParams
from voltllm.distributed.executor import TPWorkerError

CASES = {
    # tied head, o_proj bias (added by rank 0 only), a vocabulary that does not divide by 2 (padded shard),
    # 2 KV heads: one per rank
    "llama-tied": ("llama", dict(attention_bias=True, vocab_size=401)),
    # untied head, QK-norm, one KV head: replicated on both ranks
    "qwen3-untied-kv1": ("qwen3", dict(num_key_value_heads=1)),
    # QKV bias (sharded with its rows)
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=list(CASES))
def engines(request, tmp_path_factory):
    kind, overrides = CASES[request.param]
    path = make_model(str(tmp_path_factory.mktemp(request.param)), kind, **overrides)
    one = LLM(path, **ENGINE)
    two = LLM(path, tensor_parallel_size=2, **ENGINE)
    yield one, two
    two.engine.shutdown()


def test_logits_match_tp1(engines):
    """Full distributions at every prompt position (prompt logprobs over the whole vocabulary), batched."""
    assert_logits_match(*engines)


def test_greedy_matches_tp1_chunked_and_cached(engines):
    one, two = engines
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params)] == expected
    hits = two.engine.stats().prefix_cache_hits
    warm = two.generate(PROMPTS, params)  # the same prompts again: prefix-cache hits on every rank's cache
    assert [o.outputs[0].token_ids for o in warm] == expected
    assert two.engine.stats().prefix_cache_hits > hits
    two.engine.check_integrity()


def test_sampling_features_match_tp1(engines):
    """Rank 0 samples from the gathered logits: penalties, logprobs and a seeded request give tp=1's results."""
    one, two = engines
    params = [SamplingParams(temperature=0, max_tokens=12, min_tokens=12, repetition_penalty=1.5),
              SamplingParams(temperature=0, max_tokens=12, logprobs=3),
              SamplingParams(temperature=0.7, seed=11, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=12, stop=["fox"])]
    a, b = one.generate(PROMPTS, params), two.generate(PROMPTS, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
    for x, y in zip(a[1].outputs[0].logprobs, b[1].outputs[0].logprobs):
        assert x.keys() == y.keys()
        assert all(abs(x[t].logprob - y[t].logprob) < 2e-5 for t in x)


def test_each_rank_caches_its_kv_heads(engines):
    one, two = engines
    heads = one.engine.runner.kv_caches[0].shape[-2]
    local = two.engine.runner.kv_caches[0].shape[-2]
    assert local == max(1, heads // 2)
    q_heads = [e.engine.runner.model.layers[0].self_attn.num_heads for e in (one, two)]
    assert q_heads[1] == q_heads[0] // 2


def test_four_ranks(tmp_path):
    """tp=4 over 4 query / 2 KV heads: one query head per rank, each KV head on two ranks; three workers."""
    path = make_model(str(tmp_path), "llama")
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    expected = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(PROMPTS, params)]
    four = LLM(path, tensor_parallel_size=4, **ENGINE)
    try:
        assert len(four.engine.tp_workers.procs) == 3
        assert [o.outputs[0].token_ids for o in four.generate(PROMPTS, params)] == expected
    finally:
        four.engine.shutdown()


def test_quantized_checkpoint_dequantized_at_load(tmp_path):
    """An AWQ checkpoint under TP: dequantized at load (the CPU's policy), then sharded
    (kept quantized: test_tensor_parallel_quantized.py)."""
    from quant_checkpoints import quantize_checkpoint

    path = make_model(str(tmp_path), "qwen3")
    quantize_checkpoint(path, "awq")
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    expected = [o.outputs[0].token_ids for o in LLM(path, **ENGINE).generate(PROMPTS, params)]
    two = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        assert two.config.model.quantized_weights == "dequantized"
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params)] == expected
    finally:
        two.engine.shutdown()


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("llama-life")), "llama")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def _wait_gone(pids, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_worker_error_is_raised_in_engine_and_shutdown_stops_workers(llama_path):
    llm = LLM(llama_path, tensor_parallel_size=2, **ENGINE)
    pids = [p.pid for p in llm.engine.tp_workers.procs]
    assert all(_alive(p) for p in pids)
    llm.engine.tp_workers.fail_worker(1, "injected failure")
    with pytest.raises(TPWorkerError, match="tensor-parallel worker 1 failed: RuntimeError: injected failure"):
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4))
    llm.engine.shutdown()
    assert _wait_gone(pids)


def test_rank0_failure_mid_step_stops_the_group(llama_path):
    """Rank 0 raising inside a step (here its sampler) leaves the workers possibly inside that step's collectives:
    the group is stopped and later steps raise, rather than pair collectives of different steps."""
    llm = LLM(llama_path, tensor_parallel_size=2, **ENGINE)
    pids = [p.pid for p in llm.engine.tp_workers.procs]

    def boom(*args, **kwargs):
        raise RuntimeError("sampler boom")

    llm.engine.runner.sampler.sample_argmax = boom
    with pytest.raises(RuntimeError, match="sampler boom"):
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4))
    assert _wait_gone(pids)
    with pytest.raises(TPWorkerError, match="rank 0 failed mid-step"):
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))


def test_killed_worker_is_reported(llama_path):
    llm = LLM(llama_path, tensor_parallel_size=2, **ENGINE)
    pid = llm.engine.tp_workers.procs[0].pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(TPWorkerError, match="tensor-parallel worker 1 exited"):
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4))
    llm.engine.shutdown()


def test_workers_die_with_a_crashed_engine(llama_path):
    """The engine's process dies without any clean-up (os._exit): its workers exit too (no orphans)."""
    script = textwrap.dedent(f"""
        import os
        from voltllm import LLM
        if __name__ == "__main__":
            llm = LLM({llama_path!r}, tensor_parallel_size=2, block_size=4)
            print("PIDS", *[p.pid for p in llm.engine.tp_workers.procs], flush=True)
            os._exit(3)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 3, r.stderr[-2000:]
    pids = [int(p) for line in r.stdout.splitlines() if line.startswith("PIDS") for p in line.split()[1:]]
    assert pids and _wait_gone(pids)
