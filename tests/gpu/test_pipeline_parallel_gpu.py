"""Pipeline parallelism over two GPUs (NCCL point-to-point): -pp 2 against one GPU on a tiny qwen3 and a tiny dense
hybrid (qwen3_5, 8 layers) with decode CUDA graphs on (the hand-overs captured inside each rank's graphs), fp32 and
fp16; EAGLE-3 and DFlash drafters (their target layers' rows riding the hand-overs); with 4 devices also
-tp 2 -pp 2. Needs 2 CUDA devices (benchmarks/run_h200.sh s146pp, kind nvidia-h200-x2);
skipped otherwise."""
import pytest
import torch

from tiny_models import make_model, make_tiny_hybrid
from voltllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

PROMPTS = ["The quick brown fox jumps", "What is the capital of France?", "Hi", "0123456789 " * 30]


def _greedy(llm, prompts=PROMPTS, n=24):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_pp2_matches_one_gpu_with_cuda_graphs(tmp_path, dtype):
    path = make_model(str(tmp_path), "qwen3", num_hidden_layers=4, max_position_embeddings=2048)
    one = LLM(path, device="cuda", dtype=dtype, gpu_memory_utilization=0.3)
    ref = _greedy(one)
    del one
    two = LLM(path, device="cuda", dtype=dtype, gpu_memory_utilization=0.3, pipeline_parallel_size=2)
    try:
        assert two.engine.runner.graphs is not None and two.engine.runner.pp is not None
        got = _greedy(two)
        assert two.engine.runner.graphs.replays > 0
        assert _greedy(two) == got  # prefix-cache hits on both stages
        two.engine.check_integrity()
    finally:
        two.engine.shutdown()
    if dtype == "float32":
        assert got == ref
    else:  # (the same kernels on each stage's layers: the split changes no arithmetic, but allow tie flips)
        agree = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)) / sum(len(x) for x in ref)
        assert agree >= 0.97, agree


def test_pp2_hybrid_matches_one_gpu(tmp_path):
    path = make_tiny_hybrid(str(tmp_path), "qwen3_5", seed=0, gen_seed=1, num_hidden_layers=8)
    if path is None:
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    prompts = [{"prompt_token_ids": [(7 * i + 3) % 190 for i in range(n)]} for n in (19, 5, 260)]
    kw = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3, skip_tokenizer_init=True)
    ref = _greedy(LLM(path, **kw), prompts)
    two = LLM(path, pipeline_parallel_size=2, **kw)
    try:
        assert _greedy(two, prompts) == ref
        assert two.engine.runner.graphs.replays > 0
    finally:
        two.engine.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
def test_tp2_pp2_matches_one_gpu(tmp_path):
    """Two stages of two tensor-parallel ranks (their all-reduces and the hand-overs in the decode graphs)."""
    path = make_model(str(tmp_path), "llama", num_hidden_layers=4, max_position_embeddings=2048, vocab_size=401)
    kw = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    ref = _greedy(LLM(path, **kw))
    four = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **kw)
    try:
        assert _greedy(four) == ref
        assert four.engine.runner.graphs.replays > 0
    finally:
        four.engine.shutdown()


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_pp2_aux_drafters_match_one_gpu(tmp_path, monkeypatch, method):
    """An EAGLE-3 head (vLLM's default layers 2 / 4 / 5 of an 8-layer llama: layers 1 and 3 on stage 0, 4 on stage 1)
    and a DFlash drafter (layers 0, 5 and the last, 7) under -pp 2 with decode CUDA graphs: each stage's aux rows
    ride the hand-overs captured in its graphs. Greedy tokens, acceptance counts and every proposal's draft logits
    equal one GPU's (fp32)."""
    from dflash_models import make_dflash, record_block_logits
    from eagle3_models import make_eagle3
    from mtp_models import record_draft_logits

    target = make_model(str(tmp_path / "target"), "llama", num_hidden_layers=8, max_position_embeddings=2048)
    if method == "eagle3":
        spec = {"method": "eagle3", "model": make_eagle3(str(tmp_path / "head"), 64, 400, draft_vocab=96),
                "num_speculative_tokens": 3}
    else:
        spec = {"method": "dflash", "model": make_dflash(str(tmp_path / "dflash"), 64, 400, 8, [0, 5, 7],
                                                         block_size=4), "num_speculative_tokens": 3}
    kw = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3, speculative_config=spec)

    def run(**extra):
        seen = record_draft_logits(monkeypatch) if method == "eagle3" else None
        llm = LLM(target, **kw, **extra)
        try:
            records = seen if seen is not None else record_block_logits(llm.engine.runner.draft)
            outs = _greedy(llm)
            assert llm.engine.runner.graphs.replays > 0
            llm.engine.check_integrity()
            stats = llm.engine.stats().extra
        finally:
            llm.engine.shutdown()
        monkeypatch.undo()
        logits = ([lg for _, _, got, _ in records for lg in got] if method == "eagle3"
                  else [r["logits"] for r in records if r["rows"]])
        return outs, (stats["spec_accepted_tokens"], stats["spec_draft_tokens"]), logits

    one = run()
    two = run(pipeline_parallel_size=2)
    assert two[0] == one[0] and two[1] == one[1] and two[1][1] > 0
    assert len(two[2]) == len(one[2])
    for a, b in zip(two[2], one[2]):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).nan_to_num().abs().max()
