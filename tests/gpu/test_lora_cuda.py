"""LoRA adapters on a CUDA GPU: mixed batches through the decode and prompt CUDA graphs give transformers' merged
tokens (fp32) and agree with --enforce-eager (fp16); a step's adapter choice (slot loads, the mask upload) never makes
the host wait for the GPU. Run on the GPU machine: pytest -m gpu tests/gpu/test_lora_cuda.py (not run yet)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lora_adapters import make_adapter, merged_model
from tiny_models import make_model
from voltllm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox jumps", "What is the capital of France?", "Hi", "0123456789 " * 20,
           "def add(a, b):", "Paris"]
NAMES = [None, "a1", "a2", "a1", None, "a2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = make_model(str(root / "qwen3"), "qwen3", max_position_embeddings=2048)
    paths = {"a1": make_adapter(str(root / "a1"), model, rank=8, alpha=16, seed=1),
             "a2": make_adapter(str(root / "a2"), model, rank=4, alpha=8, seed=2, rslora=True,
                                targets=("q_proj", "v_proj", "down_proj"))}
    return model, paths, {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(paths.items(), 1)}


def _greedy(llm, loras, n=16):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, min_tokens=n),
                        lora_request=[None if name is None else loras[name] for name in NAMES], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_fp32_graphs_give_the_merged_models_tokens(setup):
    model, paths, loras = setup
    llm = LLM(model, device="cuda", dtype="float32", gpu_memory_utilization=0.3, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.prompt_graphs is not None
    got = _greedy(llm, loras)
    tok = llm.get_tokenizer()
    refs = {name: merged_model(model, None if name is None else paths[name]) for name in (None, "a1", "a2")}
    for prompt, name, tokens in zip(PROMPTS, NAMES, got):
        ids = tok.encode(prompt)
        with torch.no_grad():
            want = refs[name].generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert tokens == want[0, len(ids):].tolist(), (prompt, name)
    assert runner.graphs.replays > 0 and runner.prompt_graphs.replays > 0
    # a base-only batch after adapter batches replays the same graphs over an all-zero mask
    base = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)
    for prompt, out in zip(PROMPTS[:2], base):
        ids = tok.encode(prompt)
        with torch.no_grad():
            want = refs[None].generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert out.outputs[0].token_ids == want[0, len(ids):].tolist()
    llm.engine.check_integrity()


@pytest.mark.parametrize("method", ["draft_model", "eagle", "dflash"])
def test_fp32_device_drafters_keep_the_adapters_tokens(setup, tmp_path, method):
    """A device drafter (the base checkpoint as draft model, a tiny random EAGLE-1 head or DFlash drafter) proposes
    without the adapters, its graphs beside the target's: every request's greedy tokens stay plain decoding's with its
    adapter (fp32, graphs on both)."""
    import json

    from dflash_models import make_dflash
    from eagle1_models import make_eagle1

    model, paths, loras = setup
    with open(f"{model}/config.json") as f:
        cfg = json.load(f)
    hidden, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    drafter = {"draft_model": lambda: model, "eagle": lambda: make_eagle1(str(tmp_path / "e1"), hidden, vocab),
               "dflash": lambda: make_dflash(str(tmp_path / "df"), hidden, vocab, layers, [0, layers - 1])}[method]()
    kw = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # (no min_tokens: such requests do not draft)

    def run(llm):
        outs = llm.generate(PROMPTS, sp, lora_request=[None if n is None else loras[n] for n in NAMES],
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    plain = run(LLM(model, **kw))
    llm = LLM(model, speculative_config={"method": method, "model": drafter, "num_speculative_tokens": 3}, **kw)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.draft.graphs is not None
    assert run(llm) == plain
    assert llm.engine.stats().extra["spec_draft_tokens"] > 0
    llm.engine.check_integrity()


def test_fp16_graphs_agree_with_eager(setup):
    model, _, loras = setup
    kw = dict(device="cuda", dtype="float16", gpu_memory_utilization=0.3, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    eager = LLM(model, enforce_eager=True, async_scheduling=False, **kw)
    ref = _greedy(eager, loras)
    del eager
    fast = LLM(model, **kw)
    fast.engine.runner.prompt_graphs = None  # (padded prompt steps round differently: test_engine_gpu.py says why)
    got = _greedy(fast, loras)
    agree = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)) / sum(len(x) for x in ref)
    assert agree >= 0.97, agree


def test_a_steps_adapter_choice_does_not_sync(setup):
    model, _, loras = setup
    llm = LLM(model, device="cuda", dtype="float16", gpu_memory_utilization=0.3, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    manager = llm.engine.runner.lora
    keys = {name: manager.register(r) for name, r in loras.items()}

    def step(names, counts):
        return [SimpleNamespace(request=SimpleNamespace(lora_key=keys.get(n)), num_new_tokens=c)
                for n, c in zip(names, counts)]

    manager.prepare_step(step(["a1"], [3]), 4)  # warm-up (first pinned allocations)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        manager.prepare_step(step(["a2", None, "a1"], [5, 1, 2]), 8)  # a2 takes the free slot: copies
        manager.prepare_step(step([None, None], [1, 1]), 2)  # base only: the mask rows cleared on the device
        manager.prepare_step(step(["a1", "a2"], [1, 1]), 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    slot = manager.resident()
    mask = manager.batch.mask[:4].float().cpu()
    want = torch.zeros(4, 2)
    want[0, slot[keys["a1"]]] = want[1, slot[keys["a2"]]] = 1
    assert torch.equal(mask, want)
