"""Offline API behaviour on a tiny model: preemption, sampling features, bad input, outputs' shape."""
import pytest

from tiny_models import make_model
from voltllm import LLM, SamplingParams
from voltllm.engine.core import InvalidRequestError
from voltllm.engine.frontend import InvalidPromptError
from voltllm.sampling.params import SamplingParamsError

PROMPTS = ["The quick brown fox", "What is the capital of France? The capital of", "Hello world! Voltllm",
           "0123456789 0123", "def add(a, b):"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "qwen3", max_position_embeddings=256)


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(tiny_path, block_size=4, max_num_batched_tokens=32)


def test_preemption_gives_identical_outputs(tiny_path, llm):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=40, ignore_eos=True, seed=7)
    params = [greedy, seeded, greedy, seeded, greedy]
    free = llm.generate(PROMPTS, params)
    tight = LLM(tiny_path, block_size=4, max_num_batched_tokens=32, num_gpu_blocks_override=24)
    constrained = tight.generate(PROMPTS, params)
    assert tight.engine.stats().num_preemptions > 0
    for a, b in zip(free, constrained):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    tight.engine.check_integrity()
    assert tight.engine.kv.usage() == 0.0


def test_seed_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, max_tokens=20, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], p)[0].outputs[0].token_ids
    batched = llm.generate(PROMPTS, [p] + [SamplingParams(temperature=1.0, max_tokens=25)] * 4)
    assert batched[0].outputs[0].token_ids == alone
    other = llm.generate(PROMPTS[0], p.clone(seed=99))[0].outputs[0].token_ids
    assert other != alone


def test_n_logprobs_and_finish_reasons(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(n=3, temperature=1.0, max_tokens=6, logprobs=3, seed=3))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert c.finish_reason == "length" and len(c.token_ids) == 6
        assert len(c.logprobs) == 6
        for tid, pos in zip(c.token_ids, c.logprobs):
            assert tid in pos and 3 <= len(pos) <= 4
            assert all(lp.logprob <= 0 for lp in pos.values())
            # the top 3 ranked 1..3; a sampled token outside them has its rank in the whole vocabulary
            assert sorted(lp.rank for t, lp in pos.items() if len(pos) == 3 or t != tid) == [1, 2, 3]
            assert (pos[tid].rank > 3) == (len(pos) == 4)
        assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))


def test_stop_token_ids_and_strings(llm):
    base = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    o = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_id]))[0].outputs[0]
    assert o.token_ids == base.token_ids[: first + 1] and o.finish_reason == "stop" and o.stop_reason == stop_id
    text = base.text
    stop = text[5:8]
    if stop.strip() and "\ufffd" not in stop:
        o = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
        o = o[0].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == stop
        assert o.text == text[: text.index(stop)]
    llm.engine.check_integrity()


def test_min_tokens_and_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    p = SamplingParams(temperature=0, max_tokens=10, min_tokens=10, stop_token_ids=list(range(0, 400, 2)))
    o = llm.generate(PROMPTS[0], p)[0].outputs[0]
    assert len(o.token_ids) == 10 and all(t % 2 == 1 for t in o.token_ids[:-1]) and eos not in o.token_ids[:-1]


def test_penalties_change_output(llm):
    plain = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    rep = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                  repetition_penalty=1.8, frequency_penalty=1.5))[0]
    assert len(set(rep.outputs[0].token_ids)) >= len(set(plain.outputs[0].token_ids))


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(n=0), dict(max_tokens=0), dict(min_p=2), dict(logprobs=-1),
                                    dict(min_tokens=5, max_tokens=2), dict(presence_penalty=3)])
def test_invalid_sampling_params(kwargs):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_healthy(llm):
    with pytest.raises(InvalidPromptError):
        llm.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.generate("hello " * 300, SamplingParams(max_tokens=2))
    # past the context, generation stops at it ("length"), as vLLM's offline engine does (the server refuses)
    room = llm.config.model.max_model_len - len(llm.get_tokenizer().encode("hello"))
    capped = llm.generate("hello", SamplingParams(max_tokens=10**6, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(capped.token_ids) == room and capped.finish_reason == "length"
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 10**6]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):  # masked in the logits under min_tokens
        llm.generate("hello", SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=[10**6]))
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be <= the vocabulary"):  # (topk's k)
        llm.generate(["hi", "hello"], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=1,
                                                                                    prompt_logprobs=10**6)])
    for bad, match in (({"foo": 1}, "needs 'prompt'"), ({"prompt_token_ids": ["a", "b"]}, "list of integers"),
                       ({"prompt_token_ids": [1.5]}, "list of integers"), ([True, 2], "list of integers")):
        with pytest.raises(InvalidPromptError, match=match):
            llm.generate(bad, SamplingParams(max_tokens=1))
    with pytest.raises(TypeError, match="prompts must be"):
        llm.generate(123)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        llm.generate("hi", "x")
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate("hi", SamplingParams(max_tokens=1), lora_request=object())
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def test_chat_takes_vllm_arguments(llm):
    """OpenAI content parts are flattened to text for a template that takes strings (vLLM's "auto" format), kept
    as parts for one that loops over them; continue_final_message continues the
    assistant's last message; lora_request=None and numpy token ids are accepted."""
    import numpy as np

    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hello"}]}], greedy,
                     lora_request=None)[0]
    plain = llm.chat([{"role": "user", "content": "Hello"}], greedy)[0]
    assert parts.prompt == plain.prompt and parts.outputs[0].token_ids == plain.outputs[0].token_ids
    conv = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "The answer is"}]
    cont = llm.chat(conv, greedy, continue_final_message=True, add_generation_prompt=False)[0]
    assert cont.prompt.rstrip().endswith("The answer is")
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(conv, greedy, continue_final_message=True)
    with pytest.raises(ValueError, match="image"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy)
    # content formats: a template that loops over the parts gets them ("auto" detects it, "openai" forces it)
    looping = "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
    two = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    assert llm.chat(two, greedy, chat_template=looping)[0].prompt == "<Hel><lo>"
    assert llm.chat(two, greedy, chat_template="{{ messages[0]['content'] }}",
                    chat_template_content_format="openai")[0].prompt.startswith("[{'type': 'text'")
    with pytest.raises(ValueError, match="chat_template_content_format 'xml'"):
        llm.chat(two, greedy, chat_template_content_format="xml")
    ids = np.array(plain.prompt_token_ids, dtype=np.int64)
    assert llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids == plain.outputs[0].token_ids


def test_seeds_of_n_children_stay_in_int64(llm):
    out = llm.generate("hi", SamplingParams(n=2, seed=2 ** 63 - 1, temperature=1.0, max_tokens=2))[0]
    assert len(out.outputs) == 2


def test_chat_and_token_prompts(llm):
    tok = llm.get_tokenizer()
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=4,
                                                                         ignore_eos=True))[0]
    assert out.prompt.startswith("<|im_start|>user\nHello<|im_end|>") and out.prompt.endswith("assistant\n")
    by_ids = llm.generate({"prompt_token_ids": out.prompt_token_ids},
                          SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert by_ids.outputs[0].token_ids == out.outputs[0].token_ids
    assert tok.decode(out.prompt_token_ids) == out.prompt


def test_async_scheduling_equals_sync(tiny_path, llm):
    """Async mode schedules step N+1 before step N's tokens reach the host; outputs must not change."""
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=15, seed=5, logprobs=2),
              SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[7, 8, 9, 10, 11]),
              # min_tokens needs only the count of earlier tokens, so it keeps the overlap
              SamplingParams(temperature=0, max_tokens=14, min_tokens=6, stop_token_ids=[t for t in range(llm.engine.vocab_size) if not 5 <= t <= 9])]
    sync = LLM(tiny_path, block_size=4, max_num_batched_tokens=32, async_scheduling=False)
    assert llm.engine.async_scheduling and not sync.engine.async_scheduling
    runner = llm.engine.runner
    waits = []
    needs = runner.needs_host_history
    runner.needs_host_history = lambda sched: waits.append(needs(sched)) or waits[-1]
    try:
        a = llm.generate(PROMPTS[:4], params)
    finally:
        del runner.needs_host_history
    b = sync.generate(PROMPTS[:4], params)
    assert waits and not any(waits)  # no step waited for the host history
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason
    mins = a[3].outputs[0].token_ids  # 6 tokens from the 5 allowed ones, then a stop token at once
    assert len(mins) == 7 and all(5 <= t <= 9 for t in mins[:6]) and mins[6] not in range(5, 10), mins
    llm.engine.check_integrity()
    assert llm.engine.kv.usage() == 0.0


def test_fp16_residual_stream_does_not_overflow(tiny_path):
    """fp16 models keep the residual stream in fp32: activations past fp16's 65504 stay finite."""
    import math

    import torch

    llm = LLM(tiny_path, dtype="half", block_size=4, max_num_batched_tokens=32)
    model = llm.engine.runner.model
    with torch.no_grad():
        model.embed_tokens.weight[:, 0] = 60000.0  # near fp16's max already

    def add_big(module, inputs, output):  # every MLP adds 2e4 to channel 0, as outlier channels do
        output = output.clone()
        output[:, 0] += 20000.0
        return output

    hooks = [layer.mlp.register_forward_hook(add_big) for layer in model.layers]
    try:
        out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, logprobs=1, ignore_eos=True))
    finally:
        for h in hooks:
            h.remove()
    assert model.embed_tokens.weight.dtype == torch.float16
    for o in out:
        for pos in o.outputs[0].logprobs:
            assert all(math.isfinite(lp.logprob) for lp in pos.values())


def test_steps_run_in_inference_mode(llm, monkeypatch):
    """The model's forward runs under torch.inference_mode (no autograd state on the per-step hot path)."""
    import torch

    model = llm.engine.runner.model
    seen = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: seen.append(torch.is_inference_mode_enabled())
                        or forward(*a, **k))
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=3))
    assert seen and all(seen)
