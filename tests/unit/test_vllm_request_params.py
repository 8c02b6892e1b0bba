"""vLLM's request parameters that shape the prompt (truncate_prompt_tokens, add_special_tokens, reasoning_effort,
documents) and the ones voltllm refuses (not built), checked against a fake tokenizer and engine."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from voltllm.engine.detokenizer import IncrementalDetokenizer
from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from voltllm.entrypoints.openai.serving_chat import start_chat
from voltllm.entrypoints.openai.serving_common import ServerState
from voltllm.entrypoints.openai.serving_completion import _engine_prompt

BOS = 1


class FakeTokenizer:
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def __init__(self):
        self.template_kwargs = None
        self.template_tools = None

    def encode(self, text, add_special_tokens=True):
        return ([BOS] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, chat_template=None,
                            tools=None, **kwargs):
        self.template_kwargs = kwargs
        self.template_tools = tools
        return "".join(m["content"] for m in messages)


class FakeEngine:
    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.prompts = []
        self.priorities = []

    def add_request(self, rid, prompt, params, cache_salt=None, priority=0, lora_request=None, trace_headers=None):
        self.prompts.append(prompt)
        self.priorities.append(priority)
        return SimpleNamespace(close=lambda: None)

    def abort(self, rid):
        pass


class FakeRaw:
    headers: dict = {}
    scope: dict = {}

    async def receive(self):
        await asyncio.sleep(3600)


def _state(max_model_len=100):
    return ServerState(engine=FakeEngine(), served_model_names=["m"], max_model_len=max_model_len, model_path="m")


def _chat(state, **body):
    async def run():
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hello"}], max_tokens=1, **body)
        plan, _, watcher = await start_chat(state, req, FakeRaw())
        watcher.stop()
        return plan, state.engine.prompts[-1]
    return asyncio.run(run())


def test_chat_encodes_without_special_tokens_unless_asked():
    state = _state()
    assert _chat(state)[1]["prompt_token_ids"][0] != BOS
    assert _chat(state, add_special_tokens=True)[1]["prompt_token_ids"][0] == BOS


def test_completions_encode_with_special_tokens_unless_asked():
    state = _state()
    assert _engine_prompt(state, CompletionRequest(prompt="hi"), "hi")["prompt_token_ids"] == [BOS, 104, 105]
    req = CompletionRequest(prompt="hi", add_special_tokens=False)
    assert _engine_prompt(state, req, "hi") == {"prompt": "hi", "prompt_token_ids": [104, 105]}


def test_truncate_prompt_tokens_keeps_the_last_tokens():
    state = _state(max_model_len=4)
    assert _chat(state, truncate_prompt_tokens=2)[1]["prompt_token_ids"] == [ord("l"), ord("o")]
    assert _chat(state, truncate_prompt_tokens=-1)[1]["prompt_token_ids"] == [ord(c) for c in "ello"]
    req = CompletionRequest(prompt=[5, 6, 7, 8, 9], truncate_prompt_tokens=3)
    assert _engine_prompt(state, req, [5, 6, 7, 8, 9]) == {"prompt_token_ids": [7, 8, 9]}
    with pytest.raises(OpenAIError) as e:
        _chat(state, truncate_prompt_tokens=5)
    assert e.value.param == "truncate_prompt_tokens"
    for bad in (0, -2):
        with pytest.raises(OpenAIError) as e:
            _chat(state, truncate_prompt_tokens=bad)
        assert e.value.param == "truncate_prompt_tokens"


def test_truncation_side_picks_the_end_that_is_cut():
    """vLLM's truncation_side (chat and completions): right keeps the prompt's first k tokens, left (the default)
    its last k; without truncate_prompt_tokens it changes nothing."""
    state = _state(max_model_len=10)
    assert _chat(state, truncate_prompt_tokens=2, truncation_side="right")[1]["prompt_token_ids"] == [ord("h"),
                                                                                                       ord("e")]
    assert _chat(state, truncate_prompt_tokens=2, truncation_side="left")[1]["prompt_token_ids"] == [ord("l"),
                                                                                                      ord("o")]
    assert _chat(state, truncation_side="right")[1]["prompt_token_ids"] == [ord(c) for c in "hello"]
    req = CompletionRequest(prompt=[5, 6, 7, 8, 9], truncate_prompt_tokens=3, truncation_side="right")
    assert _engine_prompt(state, req, [5, 6, 7, 8, 9]) == {"prompt_token_ids": [5, 6, 7]}
    req = CompletionRequest(prompt="hi", truncate_prompt_tokens=2, truncation_side="right")
    assert _engine_prompt(state, req, "hi") == {"prompt_token_ids": [BOS, 104]}  # (the cut text is dropped)
    for make in (lambda: ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], truncation_side="mid"),
                 lambda: CompletionRequest(prompt="x", truncation_side="mid")):
        with pytest.raises(ValidationError, match="truncation_side"):
            make()


def test_reasoning_effort_none_turns_thinking_off_and_documents_reach_the_template():
    state = _state()
    _chat(state, reasoning_effort="none", documents=[{"title": "t", "text": "x"}])
    kw = state.tokenizer.template_kwargs
    assert kw["enable_thinking"] is False and kw["reasoning_effort"] == "none"
    assert kw["documents"] == [{"title": "t", "text": "x"}]
    _chat(state, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert state.tokenizer.template_kwargs["enable_thinking"] is True  # the request's own kwargs win
    _chat(state, reasoning_effort="low")  # vLLM's rule: an effort other than "none" turns thinking on
    assert state.tokenizer.template_kwargs["enable_thinking"] is True


def test_reasoning_effort_turns_thinking_on_over_the_servers_default():
    """--default-chat-template-kwargs '{"enable_thinking": false}' and a request asking for reasoning: thinking on,
    as in vLLM; the request's own chat_template_kwargs still decide, and no effort leaves the default."""
    state = _state()
    state.default_chat_template_kwargs = {"enable_thinking": False}
    _chat(state, reasoning_effort="high")
    assert state.tokenizer.template_kwargs["enable_thinking"] is True
    _chat(state, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert state.tokenizer.template_kwargs["enable_thinking"] is False
    _chat(state)
    assert state.tokenizer.template_kwargs["enable_thinking"] is False


@pytest.mark.parametrize("field,value", [("logits_processors", ["a.b"]),
                                         ("kv_transfer_params", {"do_remote_prefill": True}),
                                         ("ec_transfer_params", {"x": 1}), ("vllm_xargs", {"k": 1}),
                                         ("logprob_token_ids", [5, 6]), ("mm_processor_kwargs", {"fps": 2}),
                                         ("media_io_kwargs", {"video": {}}), ("prompt_embeds", "AAAA")])
def test_unbuilt_vllm_fields_are_refused(field, value):
    makers = [lambda **b: ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **b)]
    if field != "prompt_embeds":  # (/v1/completions takes them, with --enable-prompt-embeds)
        makers.append(lambda **b: CompletionRequest(prompt="x", **b))
    for make in makers:
        with pytest.raises(OpenAIError) as e:
            make(**{field: value}).check()
        assert e.value.param == field and e.value.code == "unsupported_parameter" and e.value.status == 400
    if field == "prompt_embeds":
        CompletionRequest(prompt_embeds=value).check()


@pytest.mark.parametrize("field,value", [("use_beam_search", False),
                                         ("length_penalty", 1.0), ("logits_processors", []), ("priority", 0),
                                         ("kv_transfer_params", None), ("vllm_xargs", {}), ("ec_transfer_params", None),
                                         ("logprob_token_ids", None), ("mm_processor_kwargs", {}),
                                         ("max_repetition_pattern_size", 0), ("repetition_detection", None)])
def test_unbuilt_vllm_fields_at_their_defaults_pass(field, value):
    ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **{field: value}).check()
    CompletionRequest(prompt="x", **{field: value}).check()


def test_priority_reaches_the_engine_from_chat_completions_and_responses():
    """The engine checks it against --scheduling-policy (AsyncLLM; tests/server/test_priority_server.py)."""
    from voltllm.entrypoints.openai.responses_protocol import ResponsesRequest

    state = _state()
    _chat(state, priority=-3)
    _chat(state, priority=None)  # null: the default
    _chat(state)
    assert state.engine.priorities == [-3, 0, 0]
    assert ResponsesRequest(input="hi", priority=4).to_chat([{"role": "user", "content": "hi"}]).priority == 4
    assert ResponsesRequest(input="hi").to_chat([{"role": "user", "content": "hi"}]).priority == 0


def test_a_stop_token_leaves_no_text_unless_asked():
    from tiny_models import make_tokenizer
    import tempfile
    tok = make_tokenizer(tempfile.mkdtemp())
    ids = tok.encode("Hello world") + [tok.eos_token_id]
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    d.add(ids[:-1])
    d.add(ids[-1:], stop_terminated=True)
    assert d.text == "Hello world"
    d2 = IncrementalDetokenizer(tok, [], skip_special_tokens=False, include_stop_str_in_output=True)
    d2.add(ids, stop_terminated=True)
    assert d2.text == "Hello world<|im_end|>"


def test_thinking_token_budget_reaches_the_sampling_params():
    """vLLM's field on chat and completions: a budget, -1 (no cap, as unset), a negative one a 400-worthy error."""
    from voltllm.sampling.params import SamplingParamsError

    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], thinking_token_budget=64)
    chat.check()
    assert chat.sampling_params(16, None).thinking_token_budget == 64
    comp = CompletionRequest(prompt="x", thinking_token_budget=-1)
    comp.check()
    assert comp.sampling_params(16, None).thinking_token_budget is None
    assert CompletionRequest(prompt="x", thinking_token_budget=0).sampling_params(16, None).thinking_token_budget == 0
    with pytest.raises(SamplingParamsError, match="thinking_token_budget"):
        CompletionRequest(prompt="x", thinking_token_budget=-2).sampling_params(16, None)
    with pytest.raises(OpenAIError) as e:  # (beam search cannot force the beams' ends)
        CompletionRequest(prompt="x", thinking_token_budget=8, use_beam_search=True, n=2).check()
    assert e.value.param == "thinking_token_budget"
