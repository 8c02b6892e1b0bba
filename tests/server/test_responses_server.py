"""POST /v1/responses and GET /v1/responses/{id} with the official openai client, on the tiny random model
(conftest.py `tiny_server`): the Response shape, greedy answers identical to chat completions for the same messages,
streamed events, the store and previous_response_id, function tools (named / required, a tool round trip),
text.format structured outputs, the 400s / 404s and the HTTP counters. Reasoning and "auto" tool parsing are checked
at the unit level (fixed model text through the output shaping), as the tiny server runs without parsers."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from server_helpers import ServerProc, free_port, wait_idle
from structured_cases import CHOICES, SCHEMA, check_schema_output, check_tagged_output, structural_tag
from tiny_models import make_model
from voltllm.engine.outputs import CompletionOutput, RequestOutput
from voltllm.entrypoints.openai.responses_protocol import ResponsesRequest, input_messages
from voltllm.entrypoints.openai.responses_store import ResponseStore
from voltllm.entrypoints.openai.serving_chat import ChatPlan, ChoiceView
from voltllm.entrypoints.openai.serving_responses import _Events, _Run, _stream, output_items

WEATHER = {"type": "function", "name": "get_weather", "description": "current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 3}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
COUNT = {"type": "function", "name": "count", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"], "additionalProperties": False}}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base + "/v1", api_key="none", max_retries=0, timeout=60)


def _create(client, **kw):
    kw.setdefault("max_output_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.responses.create(model="tiny", **kw)


def _chat_text(client, messages, max_tokens, **kw):
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return out.choices[0].message.content, out.usage


def _bad(fn, status=400) -> dict:
    with pytest.raises(openai.APIStatusError) as exc:
        fn()
    assert exc.value.status_code == status, exc.value
    return exc.value.response.json()["error"]


# -- server: shape, chat equivalence, streaming -------------------------------------------------------------------
def test_response_shape_and_same_text_as_chat(client):
    r = _create(client, instructions="Be brief.", input="Hello there", max_output_tokens=6, extra_body=NO_EOS,
                metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny" and r.created_at > 0
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.error is None and r.instructions == "Be brief." and r.max_output_tokens == 6 and r.temperature == 0
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True and r.store is True
    assert r.metadata == {"k": "v"} and r.previous_response_id is None and r.text.format.type == "text"
    [msg] = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    [part] = msg.content
    assert part.type == "output_text" and part.annotations == [] and r.output_text == part.text
    u = r.usage
    assert u.output_tokens == 6 and u.input_tokens > 0 and u.total_tokens == u.input_tokens + 6
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0
    text, usage = _chat_text(client, [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hello there"}], 6, extra_body=NO_EOS)
    assert r.output_text == text and u.input_tokens == usage.prompt_tokens


def test_input_items_match_chat_messages(client):
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
             {"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Again"},
                                          {"type": "input_text", "text": "x"}]}]
    r = _create(client, input=items, max_output_tokens=10)
    messages = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again\nx"}]
    text, usage = _chat_text(client, messages, 10)
    assert r.output_text == text and r.usage.input_tokens == usage.prompt_tokens


def test_streamed_events(client):
    plain = _create(client, input="Stream me", max_output_tokens=8, extra_body=NO_EOS)
    events = list(_create(client, input="Stream me", max_output_tokens=8, extra_body=NO_EOS, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], kinds
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and set(kinds[4:-4]) == {"response.output_text.delta"}
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == plain.output_text and events[-4].text == text
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == text and final.output[0].id == item_id
    assert final.usage.output_tokens == 8
    assert client.responses.retrieve(final.id).output_text == text  # streamed responses are stored too


def test_store_and_previous_response_id(client):
    first = _create(client, input="Name a color.", instructions="Short answers.", max_output_tokens=5)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    second = _create(client, input="And another?", previous_response_id=first.id, max_output_tokens=5)
    assert second.previous_response_id == first.id and second.id != first.id
    # the conversation continues (without the first request's instructions, as OpenAI does)
    text, usage = _chat_text(client, [{"role": "user", "content": "Name a color."},
                                      {"role": "assistant", "content": first.output_text},
                                      {"role": "user", "content": "And another?"}], 5)
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    unstored = _create(client, input="Forget me.", store=False, max_output_tokens=2)
    assert unstored.store is False
    body = _bad(lambda: client.responses.retrieve(unstored.id), 404)
    assert "not found" in body["message"] and body["type"] == "invalid_request_error"
    body = _bad(lambda: _create(client, input="x", previous_response_id=unstored.id))
    assert body["param"] == "previous_response_id" and "not found" in body["message"], body


# -- server: tools and structured outputs -------------------------------------------------------------------------
def _check_weather(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and len(args["city"]) <= 3 and args["unit"] in ("c", "f"), args
    return args


def test_named_function_and_tool_round_trip(client):
    r = _create(client, input="Weather in Paris?", tools=[WEATHER, COUNT], max_output_tokens=60,
                tool_choice={"type": "function", "name": "get_weather"})
    assert r.status == "completed" and r.tool_choice.name == "get_weather"
    assert [t.name for t in r.tools] == ["get_weather", "count"]
    [call] = r.output
    assert call.type == "function_call" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and call.status == "completed"
    _check_weather(call.arguments)
    # the call and its output back as input: the same prompt as the chat request with tool_calls + a tool message
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}]
    back = _create(client, input=items, tools=[WEATHER, COUNT], tool_choice="none", max_output_tokens=6)
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                  for t in (WEATHER, COUNT)]
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [chat_call]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "22 C"}]
    text, usage = _chat_text(client, messages, 6, tools=chat_tools, tool_choice="none")
    assert back.output_text == text and back.usage.input_tokens == usage.prompt_tokens
    # previous_response_id keeps the call: the same prompt again
    follow = _create(client, previous_response_id=r.id, tools=[WEATHER, COUNT], tool_choice="none", max_output_tokens=6,
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}])
    assert follow.usage.input_tokens == usage.prompt_tokens and follow.output_text == text


def test_required_tool_choice_streamed(client):
    events = list(_create(client, input="Count.", tools=[COUNT, WEATHER], tool_choice="required", stream=True,
                          parallel_tool_calls=False, max_output_tokens=60))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == "response.completed", [e.type for e in events]
    [call] = final.response.output
    assert call.type == "function_call" and call.name in ("count", "get_weather")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments and done.item_id == call.id
    args = json.loads(call.arguments)
    if call.name == "count":
        assert set(args) == {"n"} and type(args["n"]) is int and 0 <= args["n"] <= 9, args
    else:
        _check_weather(call.arguments)
    assert not [e for e in events if e.type.startswith("response.output_text")]


def test_structured_outputs_structural_tag_as_in_chat(client):
    """vLLM's Responses API takes a structural tag in structured_outputs (JSON text), as chat does: the same greedy
    text as chat with that constraint; text.format structural_tag is refused (OpenAI's text formats have none, nor
    do vLLM's), pointing there; two constraints are a 400."""
    forced = {"structural_tag": json.dumps(structural_tag(at_least_one=True, stop_after_first=True))}
    r = _create(client, input="Give me a record.", max_output_tokens=80, extra_body={"structured_outputs": forced})
    assert len(check_tagged_output(r.output_text)) == 1 and r.status == "completed", r.output_text
    chat, _ = _chat_text(client, [{"role": "user", "content": "Give me a record."}], 80,
                         extra_body={"structured_outputs": forced})
    assert r.output_text == chat
    stream = list(client.responses.create(model="tiny", input="Give me a record.", max_output_tokens=80,
                                          temperature=0, stream=True, extra_body={"structured_outputs": forced}))
    assert stream[-1].response.output_text == chat
    r = _create(client, input="Pick one.", extra_body={"structured_outputs": {"choice": CHOICES}})
    assert r.output_text in CHOICES
    body = _bad(lambda: _create(client, input="x", text={"format": structural_tag()}))
    assert body["param"] == "text" and "structured_outputs.structural_tag" in body["message"], body
    body = _bad(lambda: _create(client, input="x", text={"format": {"type": "json_object"}},
                                extra_body={"structured_outputs": forced}))
    assert "one structured-output constraint" in body["message"] and "text.format" in body["message"], body
    body = _bad(lambda: _create(client, input="x", extra_body={"structured_outputs": {"structural_tag": "{}"}}))
    assert body["param"] == "structured_outputs" and "structural tag" in body["message"], body


def test_text_format_json_schema_and_object(client):
    r = _create(client, input="A record.", max_output_tokens=80,
                text={"format": {"type": "json_schema", "name": "rec", "schema": SCHEMA, "strict": True}})
    assert r.text.format.type == "json_schema"
    check_schema_output(r.output_text)
    body = _bad(lambda: _create(client, input="x", text={"format": {"type": "json_schema", "name": "r",
                                                                    "schema": {"type": "nope"}}}))
    assert body["param"] == "text", body
    body = _bad(lambda: _create(client, input="x", tools=[{"type": "function", "name": "f",
                                                           "parameters": {"type": "object"}}],
                                tool_choice="required", text={"format": {"type": "json_object"}}))
    assert "text.format" in body["message"] and "response_format" not in body["message"], body


# -- server: refusals, 404s, counters -----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"name": "untyped"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"background": True, "store": False}, "store"),
    ({"include": ["message.output_text.bogus"]}, "include"),
    ({"truncation": "middle"}, "truncation"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "sometimes", "tools": []}}, "tool_choice"),
    ({"extra_body": {"conversation": "conv_1"}}, "conversation"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),  # no --enable-auto-tool-choice on this server
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"extra_body": {"n": 2}}, "n"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"input": [{"type": "function_call_output", "call_id": "call_none", "output": "1"}]}, "input"),
])
def test_refused(client, kw, param):
    kw.setdefault("input", "hi")
    body = _bad(lambda: client.responses.create(model="tiny", **kw))
    assert body["param"] == param and body["type"] == "invalid_request_error", body


def test_http_counters(client, tiny_server):
    _bad(lambda: client.responses.retrieve("resp_nope"), 404)
    text = httpx.get(tiny_server.base + "/metrics", timeout=10).text
    assert 'path="/v1/responses",status="200"' in text
    assert 'path="/v1/responses/{response_id}",status="404"' in text


def _aborted(server) -> float:
    text = httpx.get(server.base + "/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("voltllm:request_success_total{") and 'finished_reason="abort"' in line)


def test_disconnect_mid_stream_aborts(tiny_server):
    before = _aborted(tiny_server)
    body = {"model": "tiny", "input": "Go on.", "max_output_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=tiny_server.base, timeout=60) as h:
        with h.stream("POST", "/v1/responses", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 5:
                    break  # leaving the block closes the connection mid-stream
    wait_idle(tiny_server, 30)
    assert _aborted(tiny_server) == before + 1


# -- what agent clients send (Codex CLI, the Agents SDK) -------------------------------------------------------------
def test_agent_client_fields(client, tiny_server):
    """include reasoning.encrypted_content (nothing to add: reasoning comes back as plain text), truncation auto,
    max_tool_calls, tools of other types (left out: nothing here runs them), allowed_tools, nulls for defaults."""
    r = _create(client, input="Weather in Paris?", include=["reasoning.encrypted_content"], truncation="auto",
                max_output_tokens=80,
                max_tool_calls=2, tools=[{"type": "web_search"}, {"type": "local_shell"},
                                         {"type": "custom", "name": "apply_patch"}, WEATHER,
                                         dict(WEATHER, name="get_time")],
                tool_choice={"type": "allowed_tools", "mode": "required",
                             "tools": [{"type": "function", "name": "get_weather"}]})
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls), r.output  # get_time was not allowed
    assert r.truncation == "auto" and r.max_tool_calls == 2
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "stream": None, "store": None}
    assert httpx.post(tiny_server.base + "/v1/responses", json=body, timeout=60).status_code == 200


def test_output_text_logprobs(client):
    r = _create(client, input="Hello", max_output_tokens=5, include=["message.output_text.logprobs"], top_logprobs=2,
                extra_body=NO_EOS)
    lps = r.output[-1].content[0].logprobs
    assert len(lps) == r.usage.output_tokens == 5
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps) == r.output_text


# -- background responses, cancel, delete -------------------------------------------------------------------------
def _poll(client, rid, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_background_response_is_polled_to_completion(client):
    r = _create(client, input="Hello there", background=True, max_output_tokens=6, extra_body=NO_EOS)
    assert r.background is True and r.status == "queued" and r.output == []
    done = _poll(client, r.id)
    assert done.status == "incomplete" and done.background is True and done.usage.output_tokens == 6
    plain = _create(client, input="Hello there", max_output_tokens=6, extra_body=NO_EOS)
    assert done.output_text == plain.output_text  # greedy: the same answer as in the foreground
    follow = _create(client, input="More.", previous_response_id=r.id)  # a completed one can be continued
    assert follow.status in ("completed", "incomplete")
    _bad(lambda: client.responses.cancel(plain.id))  # only background responses can be cancelled
    assert client.responses.cancel(r.id).status == "incomplete"  # finished: unchanged


def test_background_cancel_aborts_the_engine_request(client, tiny_server):
    before = _aborted(tiny_server)
    r = _create(client, input="Go on.", background=True, max_output_tokens=900, extra_body=NO_EOS)
    deadline = time.monotonic() + 30
    while client.responses.retrieve(r.id).status == "queued" and time.monotonic() < deadline:
        time.sleep(0.05)
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    wait_idle(tiny_server, 30)
    assert _aborted(tiny_server) == before + 1  # its KV blocks were freed, not left running
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"  # again: unchanged
    body = _bad(lambda: _create(client, input="x", previous_response_id=r.id))
    assert body["param"] == "previous_response_id"


def test_background_survives_the_client_and_delete_stops_it(tiny_server, client):
    before = _aborted(tiny_server)
    body = {"model": "tiny", "input": "Go on.", "max_output_tokens": 900, "ignore_eos": True, "background": True}
    rid = httpx.post(tiny_server.base + "/v1/responses", json=body, timeout=60).json()["id"]  # connection closed
    time.sleep(0.5)
    assert client.responses.retrieve(rid).status in ("queued", "in_progress")
    deleted = httpx.delete(f"{tiny_server.base}/v1/responses/{rid}", timeout=10).json()
    assert deleted == {"id": rid, "object": "response.deleted", "deleted": True}
    wait_idle(tiny_server, 30)
    assert _aborted(tiny_server) == before + 1
    _bad(lambda: client.responses.retrieve(rid), 404)
    assert httpx.delete(f"{tiny_server.base}/v1/responses/{rid}", timeout=10).status_code == 404
    _bad(lambda: _create(client, input="x", background=True, stream=True))


@pytest.fixture(scope="module")
def parser_server(tmp_path_factory):
    """The tiny model again, with --enable-auto-tool-choice, the hermes tool parser and the qwen3 reasoning parser
    (the one extra server of this file): "auto" and the parsers' plumbing end to end. The random model writes no
    tags, so the answers are plain messages, the same as chat's."""
    path = make_model(str(tmp_path_factory.mktemp("tiny_parsers")), "llama")
    srv = ServerProc([path, "--device", "cpu", "--block-size", "4", "--served-model-name", "tiny",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                      "--disable-log-stats", "--disable-uvicorn-access-log"], free_port(), env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy(180)
        yield srv
    finally:
        srv.stop()


def test_auto_tools_and_reasoning_parser_served(parser_server):
    c = openai.OpenAI(base_url=parser_server.base + "/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(model="tiny", max_output_tokens=12, temperature=0, tools=[WEATHER], extra_body=NO_EOS)
    r = c.responses.create(input="Weather?", **kw)
    assert r.tool_choice == "auto" and [i.type for i in r.output] == ["message"], r.output
    events = list(c.responses.create(input="Weather?", stream=True, **kw))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}], max_tokens=12,
                                     temperature=0, tools=[{"type": "function", "function": {
                                         k: v for k, v in WEATHER.items() if k != "type"}}], extra_body=NO_EOS)
    msg = chat.choices[0].message
    assert msg.reasoning_content is None and not msg.tool_calls  # (the random model writes no tags)
    assert "reasoning" in msg.model_extra and msg.model_extra["reasoning"] is None  # vLLM's newer name too
    assert r.output_text == streamed == msg.content and r.usage.output_tokens_details.reasoning_tokens == 0
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == streamed


# -- unit: output shaping with the parsers, input translation, the store --------------------------------------------
def _state(**kw):
    tok = SimpleNamespace(encode=lambda text, add_special_tokens=False: text.split())
    return SimpleNamespace(**{"reasoning_parser": None, "reasoning_delimiters": None, "tool_call_parser": None,
                              "generation_defaults": {}, "tokenizer": tok, **kw})


def _plan(use_tools=False):
    return ChatPlan("resp_1", "m", 1, "<|im_start|>assistant\n", use_tools, None, 1, None)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TEXT = ('<think>\nCheck the weather.\n</think>\n\nLet me look.<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>')


def test_output_items_reasoning_message_and_call():
    state = _state(reasoning_parser="qwen3", tool_call_parser="hermes")
    view = ChoiceView(state, _plan(use_tools=True), TOOLS, streaming=False)
    items = output_items(*view.view(TEXT, True))
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["id"].startswith("rs_") and items[0]["summary"] == []
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Check the weather.\n"}]
    assert items[1]["content"][0]["text"] == "Let me look." and items[1]["status"] == "completed"
    call = items[2]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    only_call = output_items(*ChoiceView(state, _plan(True), TOOLS, False).view(TEXT.split("Let me look.")[1], True))
    assert [i["type"] for i in only_call] == ["function_call"]  # no empty message beside a call


class _FakeStream:
    def __init__(self, text: str, step: int, finish: str):
        self.outs = []
        for end in list(range(step, len(text), step)) + [len(text)]:
            done = end == len(text)
            c = CompletionOutput(0, text[:end], list(range(end // 4)), finish_reason=finish if done else None)
            self.outs.append(RequestOutput("resp_1", None, [1, 2, 3], [c], done))

    async def __aiter__(self):
        for o in self.outs:
            yield o

    def close(self):
        pass


def _run_stream(text: str, finish: str = "stop", store=None):
    state = _state(reasoning_parser="qwen3", tool_call_parser="hermes")
    plan = _plan(use_tools=True)
    req = ResponsesRequest(input="hi", tools=[{"type": "function", "name": "get_weather"}])
    run = _Run(state, ResponseStore() if store is None else store, req, plan, [{"role": "user", "content": "hi"}])
    view = ChoiceView(state, plan, TOOLS, streaming=True)

    async def go():
        return [e async for e in _stream(run, view, [_FakeStream(text, 5, finish)], _Events())]
    events = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(go())]
    return events


def test_stream_shaping_reasoning_message_and_call():
    store = ResponseStore()
    events = _run_stream(TEXT, store=store)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    content = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert reasoning == "Check the weather.\n" and content == "Let me look."
    # the reasoning item is done before the message starts; the call comes last
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    [args_done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(args_done["arguments"]) == {"city": "Paris"}
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["status"] == "completed"
    out = final["response"]["output"]
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call"]
    assert all(i["status"] == "completed" for i in out)
    assert final["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == 3  # (words, by the fake)
    conv = store.conversation("resp_1")
    assert conv[-1]["role"] == "assistant" and conv[-1]["content"] == "Let me look."
    assert conv[-1]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_stream_shaping_cut_short():
    events = _run_stream("<think>still thinking about it", finish="length")
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in final["response"]["output"]] == ["reasoning", "message"]
    assert final["response"]["output"][0]["content"][0]["text"] == "still thinking about it"


def test_input_translation():
    msgs = input_messages([
        {"role": "system", "content": "S"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": {"x": 1}},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2]["tool_calls"][1]["function"]["arguments"] == '{"x": 1}'
    assert msgs[4] == {"role": "tool", "tool_call_id": "c2", "content": "two"}
    assert input_messages("hey") == [{"role": "user", "content": "hey"}]
    req = ResponsesRequest(input="x", tools=[{"type": "function", "name": "f", "parameters": {"type": "object"},
                                              "strict": True}], tool_choice={"type": "function", "name": "f"})
    assert req.chat_tools() == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                                  "strict": True}}]
    assert req.chat_tool_choice() == {"type": "function", "function": {"name": "f"}}
    fmt = {"type": "json_schema", "name": "s", "schema": SCHEMA, "strict": True}
    assert ResponsesRequest(input="x", text={"format": fmt}).response_format() == {
        "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    assert ResponsesRequest(input="x", text={"format": {"type": "json_object"}}).response_format() == {
        "type": "json_object"}
    assert ResponsesRequest(input="x", text={"format": {"type": "text"}}).response_format() is None


def test_input_reasoning_items_reach_the_template():
    """As vLLM: a resent output's reasoning item is the `reasoning` of its assistant turn (the message and calls
    after it join that turn), so the template shows the earlier reasoning (as reasoning_content too); OpenAI's
    summary is read when there is no content; encrypted reasoning is a 400."""
    from jinja2 import Template

    from voltllm.entrypoints.openai.errors import OpenAIError
    from voltllm.entrypoints.openai.serving_common import normalize_messages

    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    msgs = input_messages([
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Check the weather."}]},
        said, call, {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "It is mild."}]},
        {**said, "content": [{"type": "output_text", "text": "18 C."}]}])
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[1]["reasoning"] == "Check the weather." and msgs[1]["content"] == "Let me look."
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1"]
    assert (msgs[3]["reasoning"], msgs[3]["content"]) == ("It is mild.", "18 C.")
    template = Template("{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
                        "{% endif %}{{ m.content }}|{% endfor %}")
    assert template.render(messages=normalize_messages(msgs)) == (
        "q|<think>Check the weather.</think>Let me look.|18 C|<think>It is mild.</think>18 C.|")
    # a reasoning item after a turn that has reasoning already opens a turn of its own
    two = input_messages([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "a"}]},
                          {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "b"}]}])
    assert two == [{"role": "assistant", "content": None, "reasoning": "a"},
                   {"role": "assistant", "content": None, "reasoning": "b"}]
    with pytest.raises(OpenAIError) as exc:
        input_messages([{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}])
    assert exc.value.status == 400 and "encrypted reasoning content is not supported" in exc.value.message


def test_function_call_output_needs_its_call():
    """OpenAI's 400 for an output whose call_id no earlier function_call (in the input or the previous response's
    conversation) made."""
    from voltllm.entrypoints.openai.errors import OpenAIError
    from voltllm.entrypoints.openai.responses_protocol import call_ids

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "c1", "output": "one"}
    assert [m["role"] for m in input_messages([call, out])] == ["assistant", "tool"]
    for items, missing in (([out], "c1"), ([out, call], "c1"), ([call, {**out, "call_id": "c2"}], "c2")):
        with pytest.raises(OpenAIError) as exc:  # none, one made after it, another call's
            input_messages(items)
        e = exc.value
        assert (e.status, e.param, e.code) == (400, "input", None)
        assert e.message == f"No tool call found for function call output with call_id {missing}."
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]}]
    assert call_ids(history) == {"c1"}
    assert input_messages([out], call_ids(history)) == [{"role": "tool", "tool_call_id": "c1", "content": "one"}]


def test_store_is_bounded():
    store = ResponseStore(capacity=3)
    for i in range(5):
        store.put(f"r{i}", {"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    assert len(store) == 3 and store.response("r0") is None and store.response("r1") is None
    assert store.response("r4") == {"id": "r4"} and store.conversation("r2") == [{"role": "user", "content": "2"}]


def test_api_key_covers_responses():
    from starlette.testclient import TestClient

    from voltllm.entrypoints.openai.app import build_app

    http = TestClient(build_app(SimpleNamespace(runner="generate"), api_key="k"))
    assert http.post("/v1/responses", json={"input": "hi"}).status_code == 401
    assert http.get("/v1/responses/resp_x").status_code == 401
    got = http.get("/v1/responses/resp_x", headers={"Authorization": "Bearer k"})
    assert got.status_code == 404 and got.json()["error"]["type"] == "invalid_request_error"


def test_stream_error_is_an_in_band_event():
    from voltllm.engine.async_llm import RequestAbortedError
    from voltllm.entrypoints.openai.serving_common import sse_body

    class Failing(_FakeStream):
        async def __aiter__(self):
            yield self.outs[0]
            raise RequestAbortedError("the engine went away")

    state = _state()
    plan = _plan()
    run = _Run(state, ResponseStore(), ResponsesRequest(input="hi"), plan, [])
    ev, stream = _Events(), Failing("some words here", 5, "stop")
    watcher = SimpleNamespace(disconnected=False, stop=lambda: None)

    async def go():
        body = sse_body(_stream(run, ChoiceView(state, plan, None, True), [stream], ev), [stream], watcher, "r",
                        done=None, error_event=ev.error)
        return [e async for e in body]
    raw = asyncio.run(go())
    assert not any("[DONE]" in e for e in raw)
    events = [json.loads(e.split("data: ", 1)[1]) for e in raw]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "error" and events[-1]["code"] == "request_aborted"
    assert "the engine went away" in events[-1]["message"] and raw[-1].startswith("event: error\n")
    assert "response.output_text.delta" in [e["type"] for e in events]
