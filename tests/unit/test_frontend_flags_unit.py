"""vLLM's newer frontend flags built here, checked without a server: --stream-interval / stream_interval (fewer,
larger stream chunks), --disable-access-log-for-endpoints, GET /tokenizer_info's body, --max-logprobs -1 and
--exclude-tools-when-tool-choice-none."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from test_vllm_request_params import _chat, _state
from voltllm.entrypoints.openai.access_log import EndpointFilter, endpoint_paths
from voltllm.entrypoints.openai.errors import OpenAIError
from voltllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from voltllm.entrypoints.openai.stream_interval import IntervalStream, stream_interval
from voltllm.entrypoints.openai.tokenizer_info import tokenizer_info_of


class _Outputs:
    """A request's cumulative outputs: token counts per step for one choice, the last one finished."""

    def __init__(self, counts: list[int]):
        self.items = [SimpleNamespace(finished=i == len(counts) - 1, outputs=[SimpleNamespace(
            index=0, token_ids=list(range(n)), finish_reason="length" if i == len(counts) - 1 else None)])
            for i, n in enumerate(counts)]
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def close(self):
        self.closed = True


def _passed(counts: list[int], interval: int) -> list[int]:
    async def run():
        return [len(out.outputs[0].token_ids) async for out in IntervalStream(_Outputs(counts), interval)]
    return asyncio.run(run())


def test_interval_passes_every_n_tokens_the_first_and_the_last():
    assert _passed([1, 2, 3, 4, 5, 6, 7, 8], 3) == [1, 4, 7, 8]
    assert _passed([1, 2, 3, 4, 5, 6, 7, 8], 1) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert _passed([2, 3, 9, 10], 4) == [2, 9, 10]  # (a step with several tokens counts them all)
    stream = _Outputs([1])
    IntervalStream(stream, 2).close()
    assert stream.closed


def test_a_request_can_only_ask_for_larger_chunks():
    def req(**body):
        return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True, **body)

    assert stream_interval(1, req()) == 1
    assert stream_interval(4, req()) == 4
    assert stream_interval(4, req(stream_interval=2)) == 4  # (vLLM: clamped up to the server's)
    assert stream_interval(4, req(stream_interval=9)) == 9
    assert stream_interval(4, CompletionRequest(prompt="x", stream_interval=9)) == 1  # not streamed
    with pytest.raises(OpenAIError) as e:
        stream_interval(1, req(stream_interval=0))
    assert e.value.param == "stream_interval"


def test_access_log_filter_drops_the_listed_paths_only():
    f = EndpointFilter(endpoint_paths(" /health, /metrics ,"), root_path="/api")

    def record(path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    assert endpoint_paths("/health,,/metrics") == {"/health", "/metrics"}
    assert not f.filter(record("/health")) and not f.filter(record("/metrics?x=1"))
    assert not f.filter(record("/api/health"))  # (behind --root-path)
    assert f.filter(record("/v1/models")) and f.filter(record("/healthz"))
    assert f.filter(logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "no args", None, None))


def test_tokenizer_info_is_the_tokenizers_config_made_json(tmp_path):
    from tiny_models import make_tokenizer

    tok = make_tokenizer(str(tmp_path))
    info = tokenizer_info_of(tok, "{{ messages }}")
    assert info["tokenizer_class"] == type(tok).__name__ and info["chat_template"] == "{{ messages }}"
    assert info["eos_token"] == tok.eos_token  # (an AddedToken in the tokenizer's own settings: its text)
    import json

    json.dumps(info)
    assert tokenizer_info_of(tok, None)["chat_template"] == tok.chat_template


def test_max_logprobs_minus_one_is_no_limit_and_minus_one_the_whole_vocabulary():
    state = _state()
    state.engine.vocab_size = 500
    assert state.check_logprobs(20, "top_logprobs") == 20
    for n in (21, -1):
        with pytest.raises(OpenAIError, match="between 0 and 20"):
            state.check_logprobs(n, "top_logprobs")
    state.max_logprobs = -1
    assert state.check_logprobs(400, "top_logprobs") == 400
    assert state.check_logprobs(-1, "prompt_logprobs") == 500
    with pytest.raises(OpenAIError, match="or -1, got -2"):
        state.check_logprobs(-2, "logprobs")


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_tools_leave_the_template_under_tool_choice_none_with_the_flag():
    state = _state()
    _chat(state, tools=TOOLS, tool_choice="none")
    assert state.tokenizer.template_tools == TOOLS  # (vLLM's default: the template still sees them)
    state.exclude_tools_when_tool_choice_none = True
    _chat(state, tools=TOOLS, tool_choice="none")
    assert state.tokenizer.template_tools is None
    _chat(state, tools=TOOLS, tool_choice="required")
    assert state.tokenizer.template_tools == TOOLS
