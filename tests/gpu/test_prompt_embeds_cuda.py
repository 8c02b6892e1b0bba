"""--enable-prompt-embeds on the GPU (CUDA graphs on): a prompt given as the model's own embedding rows of its ids
answers as the ids do, in fp32 exactly (greedy tokens) and in fp16 within rounding, native and --compat sm70; the
rows' prompt step runs eagerly, the decode steps after it replay graphs."""
import pytest
import torch

from tiny_models import make_model
from voltllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

IDS = [5, 17, 3, 60, 22, 9, 41, 8, 13, 77, 4, 30, 19, 2, 55, 61, 7, 12, 90, 33, 14]


@pytest.mark.parametrize("dtype,compat", [("float32", None), ("float16", None), ("float32", "sm70"),
                                          ("float16", "sm70")])
def test_rows_answer_as_their_ids(tmp_path, dtype, compat):
    path = make_model(str(tmp_path / "m"), "qwen3")
    kw = {"compat": compat} if compat else {}
    llm = LLM(path, device="cuda", dtype=dtype, gpu_memory_utilization=0.2, enable_prompt_embeds=True, **kw)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    want = llm.generate([{"prompt_token_ids": IDS}, {"prompt_token_ids": IDS[:7]}], params, use_tqdm=False)
    with torch.no_grad():
        rows = [llm.engine.runner.model.embed_tokens(torch.tensor(ids, device="cuda")).cpu()
                for ids in (IDS, IDS[:7])]
    replays = llm.engine.runner.graphs.replays
    got = llm.generate([{"prompt_embeds": rows[0]}, {"prompt_embeds": rows[1]}], params, use_tqdm=False)
    assert llm.engine.runner.graphs.replays > replays, "the decode steps must replay graphs"
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(x[t].logprob - y[t].logprob) < (1e-4 if dtype == "float32" else 2e-2)
