"""--enable-mfu-metrics' step estimate (perf_metrics.StepPerf) against hand arithmetic, and in the engine: its
counters against the same estimate of the steps a greedy request takes, and off by default."""
from types import SimpleNamespace

import pytest

from voltllm.bench.limits import ModelCost
from voltllm.perf_metrics import FLOPS, READ, WRITE, StepPerf

COST = ModelCost(weight_bytes=1000, matmul_params=300, logits_params=50, kv_bytes_per_token=8,
                 state_bytes_per_request=0, attention_layers=2, q_heads=3, head_dim=4)


def _sched(start, n, prompt, spec=0):
    return SimpleNamespace(start=start, num_new_tokens=n, spec_tokens=[7] * spec,
                           request=SimpleNamespace(num_prompt_tokens=prompt))


def test_a_step_of_a_prompt_chunk_a_last_chunk_and_a_verification():
    perf = StepPerf(COST, gpus=2)
    attn = 4 * 2 * 3 * 4  # per attended position
    perf.add([_sched(0, 4, 10), _sched(6, 4, 10), _sched(20, 3, 12, spec=2)])
    flops = (2 * 300 * 4 + attn * 4 * 2.5  # chunk 0..3 of a 10-token prompt: no logits
             + 2 * 300 * 4 + 2 * 50 * 1 + attn * 4 * 8.5  # its last chunk 6..9: one sampled row
             + 2 * 300 * 3 + 2 * 50 * 3 + attn * 3 * 22)  # a verification: the known token and 2 drafts
    read = 1000 + 8 * (4 + 10 + 23)
    write = 8 * (4 + 4 + 3)
    assert perf.totals() == {FLOPS: flops / 2, READ: read / 2, WRITE: write / 2}
    perf.add([])  # (an empty step adds nothing)
    assert perf.totals()[READ] == read / 2


def test_windows_and_experts():
    cost = ModelCost(weight_bytes=1000, matmul_params=300, logits_params=0, kv_bytes_per_token=8,
                     state_bytes_per_request=5, attention_layers=2, q_heads=1, head_dim=1, expert_bytes=600,
                     expert_params=200, expert_fraction=0.25, layer_windows=(4, 0))
    perf = StepPerf(cost)
    perf.add([_sched(99, 1, 10)])  # one decode row at position 99: layers attend 4 and 100 positions
    active = 300 - 200 * 0.75
    assert perf.flops == pytest.approx(2 * active + 4 * 2 * 52)
    assert perf.read == pytest.approx(1000 - 600 * 0.75 + 8 * 52 + 5)
    assert perf.write == 8 + 5


def test_engine_counters(tmp_path):
    from tiny_models import make_model
    from voltllm import LLM, SamplingParams
    from voltllm.bench.limits import model_cost

    path = make_model(str(tmp_path / "m"), "llama")
    assert FLOPS not in LLM(path, block_size=4).engine.stats().extra
    llm = LLM(path, block_size=4, enable_mfu_metrics=True)
    prompt = list(range(3, 14))  # 11 tokens, then 5 generated: the prompt step and 4 decode steps
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    ref = StepPerf(model_cost(llm.engine.runner.model, llm.engine.config.model.hf_config, llm.engine.runner.kv_dtype))
    ref.add([_sched(0, 11, 11)])
    for start in range(11, 15):
        ref.add([_sched(start, 1, 11)])
    got = llm.engine.stats().extra
    assert got[FLOPS] == pytest.approx(ref.flops) and got[READ] == pytest.approx(ref.read)
    assert got[WRITE] == pytest.approx(ref.write) and ref.flops > 0
